"""``python -m shardwise.cli``: the ``shardwise`` command."""

import sys

from shardwise.cli.command import main

if __name__ == "__main__":
    sys.exit(main())
