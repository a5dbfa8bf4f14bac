"""The simulated meshes the tests share, named by shape.

Invariants:

- One name, one mesh: ``M<sizes>`` is ``DeviceMesh.cpu`` of those sizes over the
  axis names its rank gets below (1-D: ``"x"``; 2-D: ``("dp", "tp")``; 3-D:
  ``("a", "b", "c")``). Meshes are values (equal by shape, names and devices), so
  sharing one object changes nothing a test can see.
- Only plain meshes live here; a test that needs other names or draws random
  meshes (hypothesis strategies) builds its own.
- The factories take ``n``, the device count of a body that runs on both runtimes
  (``n`` simulated devices or ``n`` Gloo processes).

>>> M22
DeviceMesh(dp=2, tp=2)
>>> [m.mesh_shape for m in meshes_for(4)]
[(4,), (2, 2)]
"""

from __future__ import annotations

from shardwise import DeviceMesh

# 1-D lines
M2 = DeviceMesh.cpu(2, "x")
M3 = DeviceMesh.cpu(3, "x")
M4 = DeviceMesh.cpu(4, "x")

# 2-D grids: data parallel x tensor parallel
M22 = DeviceMesh.cpu((2, 2), ("dp", "tp"))
M23 = DeviceMesh.cpu((2, 3), ("dp", "tp"))
M24 = DeviceMesh.cpu((2, 4), ("dp", "tp"))
M41 = DeviceMesh.cpu((4, 1), ("dp", "tp"))

# 3-D
M222 = DeviceMesh.cpu((2, 2, 2), ("a", "b", "c"))


def line(n: int) -> DeviceMesh:
    """``n`` devices in a row, axis ``"x"``."""
    return DeviceMesh.cpu((n,), ("x",))


def grid(n: int) -> DeviceMesh:
    """``n`` (even) devices as ``(2, n // 2)`` over ``("dp", "tp")``."""
    return DeviceMesh.cpu((2, n // 2), ("dp", "tp"))


def meshes_for(n: int) -> list[DeviceMesh]:
    """The meshes a body checks on ``n`` devices: the line, and the 2x2 grid when
    ``n == 4``."""
    out = [line(n)]
    if n == 4:
        out.append(M22)
    return out
