#!/usr/bin/env bash
# Set up (if needed) and run the main demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/shardwise demo "$@"
