"""Tiny stages on a loaded 2-core machine: one torch thread."""

from tests.helpers.threads import one_thread

__all__ = ["one_thread"]
