"""Floor 4: per-device code on local blocks (JAX's ``shard_map`` semantics).

``shard_map`` (the public ``shardwise.shard_map``), ``io`` (its in/out specs and
output assembly), ``guard`` (the write guard on input blocks) and ``lax`` (the
collectives by mesh-axis name, public as ``shardwise.lax``).
"""
