"""Per-device graph ops (``shardwise.graph.ops``) and their signal buffers.

Where ``shardwise.ops`` works on one global Tensor laid out on a mesh, this
package works on *lists of per-device values*: single-device Tensors, one per
device, as in the reference graph API.

Invariants:
- A per-device value is a single-device :class:`shardwise.Tensor`; a
  ``TensorType`` may stand in for it, and then every op only checks and
  returns output types (abstract evaluation, no allocation).
- The participants of a collective are given by its signal buffers
  (:class:`Signals`): at least 1 (one is a no-op), on distinct devices, in
  input order.
- Ops never modify their inputs; outputs are new values, bit-identical to the
  torch expressions they document, and differentiable.
- :func:`to_tensor` / :func:`from_tensor` convert between a list of
  per-device values and a distributed Tensor, losslessly.

>>> signals = Signals([CPU(0), CPU(1)])
>>> x0 = shardwise.tensor([1.0], device=CPU(0))
>>> x1 = shardwise.tensor([2.0], device=CPU(1))
>>> [y.to_torch().tolist() for y in ops.allgather([x0, x1], signals)]
[[1.0, 2.0], [1.0, 2.0]]
"""

from shardwise.graph import ops
from shardwise.graph.interop import from_tensor, to_tensor
from shardwise.graph.signals import SIGNAL_BUFFER_BYTES, SignalBuffer, Signals
from shardwise.graph.values import AxisError

__all__ = [
    "SIGNAL_BUFFER_BYTES",
    "AxisError",
    "SignalBuffer",
    "Signals",
    "from_tensor",
    "ops",
    "to_tensor",
]
