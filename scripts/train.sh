#!/usr/bin/env bash
# The main job (README "Quick start"): set up if needed, then GRPO on SmolLM2-135M with 2 processes.
#   bash scripts/train.sh [hydra overrides, e.g. --config-name sft  trainer.steps=4]
# NPROC=1 runs one process. Same as: megalign train --nproc 2 [overrides] (after scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh train
. "${VENV:-.venv}/bin/activate"
exec megalign train --nproc "${NPROC:-2}" "$@"
