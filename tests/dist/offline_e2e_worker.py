"""torchrun worker: a real SFT / RM / DPO / PPO job (launchers/train.py's ``run``) on a model dir.

    torchrun --nproc-per-node 2 tests/dist/offline_e2e_worker.py CONFIG MODEL_DIR OUT_DIR [overrides...] RESULT.json
"""

from __future__ import annotations

import sys

from tests.dist.e2e_worker import run_job
from tests.dist.report import exit_now


def main() -> None:
    config, model_dir, out_dir, *overrides, result_path = sys.argv[1:]
    run_job(model_dir, out_dir, overrides, result_path, config=config)


if __name__ == "__main__":
    main()
    exit_now()
