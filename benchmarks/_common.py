"""Compatibility shim: the helpers live in :mod:`shardwise.bench.common`."""

from shardwise.bench.common import dist_time, fmt, free_port, launch, ratio, write_json

__all__ = ["dist_time", "fmt", "free_port", "launch", "ratio", "write_json"]
