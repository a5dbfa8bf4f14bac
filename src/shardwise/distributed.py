"""Multi-process runtime control: one process per device through torch.distributed.

The public face of :mod:`shardwise.api.distributed`, where it is defined (and its
names listed, in its ``__all__``).
"""

from shardwise.api import distributed as _defined
from shardwise.api.distributed import *  # noqa: F403  (the names of _defined.__all__)

__all__ = list(_defined.__all__)
