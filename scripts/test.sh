#!/usr/bin/env bash
# The whole test suite, Slurm and nemo-run tests included (what CI runs): set up if needed, then pytest.
#   bash scripts/test.sh                      both tiers (CONTRIBUTING.md, test tiers)
#   bash scripts/test.sh [pytest arguments]   e.g. tests/test_losses.py -x: pytest with them, as given
# Both tiers run on TEST_WORKERS processes (pytest-xdist, default 2): the fast tier (-m "not slow":
# single-threaded, nothing launched) test by test; the slow tier a file at a time on each worker
# (--dist loadfile; tests/conftest.py puts the files with heavy tests first). Its launches leave about
# a quarter of the cores idle (start-up, rendezvous, waits) that a second test fills: 45:46 -> 30:39
# on 2 AMX cores, 2026-12-02. Tests marked serial (a machine-wide resource: the local Slurm cluster,
# the sandbox's count of nobody's processes) run alone after it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
. "${VENV:-.venv}/bin/activate"
if [ $# -gt 0 ]; then
    exec python -m pytest -q "$@"
fi
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)," \
     "$(grep -qw avx512f /proc/cpuinfo && echo AVX-512 || echo 'no AVX-512')"
tier() {  # the tier's name, then pytest's arguments: runs it and prints its time
    local name=$1 start=$SECONDS
    shift
    python -m pytest -q "$@" tests
    echo "$name: $((SECONDS - start)) s"
}
tier "fast tier" -m "not slow" -n "${TEST_WORKERS:-2}"
tier "slow tier, parallel part" -m "slow and not serial" -n "${TEST_WORKERS:-2}" --dist loadfile \
    --no-loadscope-reorder --durations=15
tier "slow tier, serial part" -m "slow and serial"
