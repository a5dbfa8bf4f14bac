#!/usr/bin/env bash
# Create .venv (once) with torch==2.13.0 and shardwise installed editable with its test
# tools, rich (the `viz` extra: colour tables in visualize and the demo) and transformers
# (the `hf` extra: the tests that run Hugging Face models).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
# torch first, pinned: the CPU build of this exact version is on the machine's disk.
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test,viz,hf]'
