#!/usr/bin/env bash
# Set up (if needed) and run every check CI runs: ruff, mypy, pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests benchmarks examples
.venv/bin/mypy
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
