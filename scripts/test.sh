#!/usr/bin/env bash
# The whole test suite, Slurm and nemo-run tests included (what CI runs): set up if needed, then pytest.
#   bash scripts/test.sh                      both tiers (CONTRIBUTING.md, test tiers)
#   bash scripts/test.sh [pytest arguments]   e.g. tests/test_losses.py -x: pytest with them, as given
# The fast tier (-m "not slow": single-threaded, nothing launched) runs on TEST_WORKERS processes
# (pytest-xdist, default 2); then the slow tier one test at a time, since each of its tests
# launches processes that use every core.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
. "${VENV:-.venv}/bin/activate"
if [ $# -gt 0 ]; then
    exec python -m pytest -q "$@"
fi
python -m pytest -q -m "not slow" -n "${TEST_WORKERS:-2}" tests
exec python -m pytest -q -m slow --durations=15 tests  # the 15 slowest: the CI budget (45 min)
