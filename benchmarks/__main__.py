"""``python -m benchmarks``: the whole suite (the same as ``shardwise bench``)."""

import sys

from benchmarks.suite import main

if __name__ == "__main__":
    sys.exit(main())
