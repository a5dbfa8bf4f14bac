"""Floor 3, core: torch ops on shardwise Tensors (the op registry and its executor).

``execute`` runs one op: bind its rule, decide layouts, relayout the operands, run the
torch op on local blocks, wrap. ``compute`` holds the compute ops on the rule table,
``registry`` the handler table's tools and the fallback, and the ``torch_*`` modules
the handlers of torch's functions by family; ``torch_api`` fills the registry (the
Tensor loads it on its first torch call). Importing this package fills it too.
"""

from shardwise.ops import torch_api as _torch_api  # noqa: F401  (fills the op registry)
