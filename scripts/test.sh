#!/usr/bin/env bash
# The whole test suite, Slurm and nemo-run tests included (what CI runs): set up if needed, then pytest.
#   bash scripts/test.sh [pytest arguments, e.g. tests/test_losses.py -x]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
. "${VENV:-.venv}/bin/activate"
exec python -m pytest -q "${@:-tests}"
