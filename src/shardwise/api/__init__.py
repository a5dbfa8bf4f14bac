"""Floor 4, the API: what users call by name (re-exported by ``shardwise``).

``creation`` (tensors from data or per-device pieces), ``communication`` (layout ops:
shard, all_gather, all_to_all, to_device...), ``reducing`` (all_reduce,
reduce_scatter), ``point_to_point`` (ppermute), ``autodiff`` (grad, vjp, jvp),
``abstract`` (eval_shape), ``meshes`` (init_device_mesh: meshes over accelerators in
torch's spelling) and ``distributed`` (the process world's control,
public as ``shardwise.distributed``).
"""
