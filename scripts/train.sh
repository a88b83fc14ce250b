#!/usr/bin/env bash
# The main job (README "Quick start"): set up if needed, then GRPO on SmolLM2-135M with 2 processes.
#   bash scripts/train.sh [hydra overrides, e.g. --config-name sft  trainer.steps=4]
# NPROC=1 runs one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh train
. "${VENV:-.venv}/bin/activate"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # megalign sets its threads per process (launchers/common.start)
exec torchrun --standalone --nproc-per-node "${NPROC:-2}" launchers/train.py "$@"
