"""Floor 3, core: torch ops on shardwise Tensors (the op registry and its executor).

``execute`` runs one op: bind its rule, decide layouts, relayout the operands, run the
torch op on local blocks, wrap. ``compute`` holds the compute ops on the rule table,
``registry`` the handler table's tools and the fallback, and one module per family
(``elementwise``, ``conversions``, ``factories``, ``inplace``, ``foreach``, ``shapes``,
``views``, ``joins``, ``indexing``, ``reductions``, ``nn``, ``linalg``, ``matmuls``,
``losses``, ``layers``, ``spectral``, ``sampling``, ``autograd``) the handlers of
torch's functions, each registered at import by ``@register`` right above it;
``torch_api`` imports every family and sets the fallback (the Tensor loads it on its
first torch call). Importing this package fills the registry too.
"""

from shardwise.ops import torch_api as _torch_api  # noqa: F401  (fills the op registry)
