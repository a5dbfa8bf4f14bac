#!/usr/bin/env bash
# shardwise on a GPU in one command (at most 8 minutes on one GPU): correctness on CUDA,
# NCCL in one process, torchrun runs where several GPUs are visible, per-op dispatch and
# training-step speed. Prints a short table, writes bench-results/gpu-<device>.json and
# exits 1 if a check failed. Options go to `python -m benchmarks.gpu_check` (--device
# cpu runs the same checks on the CPU; --size small; --out DIR; --only CHECK...).
#
# Which Python: where python3 already holds a CUDA build of torch that sees a GPU, that
# one, with this checkout on its path (GPU machines are often offline, and setup.sh
# installs the CPU build); anywhere else the .venv of scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
then
    export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    bash scripts/setup.sh
    PY=.venv/bin/python
fi
export PYTHONUNBUFFERED=1
# the checks bound themselves (8 minutes in all); this bound is for the runner itself
exec timeout --signal=KILL 560 "$PY" -m benchmarks.gpu_check "$@"
