"""Moved to :mod:`shardwise.runtime.process.agreement`; this path stays importable."""

from shardwise.runtime.process.agreement import (
    CAP,
    DATA,
    Fingerprint,
    agree,
    fingerprint,
    foldable,
    foldable_gather,
    run,
    wait_all,
)

__all__ = ["CAP", "DATA", "Fingerprint", "agree", "fingerprint", "foldable", "foldable_gather",
           "run", "wait_all"]
