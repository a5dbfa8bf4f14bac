"""Floor 3, core: the distributed Tensor and its machinery.

``tensor`` (the :class:`~shardwise.tensors.tensor.Tensor` class, torch's routing and
the placing functions) derives from three bases, one concept each: ``meta`` (fields
and metadata) < ``relayout`` (layout changes) < ``grad`` (autograd). Beside them:
``chunks`` (blocks as DCP chunks) and ``dtensor`` (the DTensor bridge). The op
registry that fills the Tensor's routing table lives one folder over, in ``ops/``.
"""
