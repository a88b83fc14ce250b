"""torchrun worker: a real SFT / RM / DPO / PPO job (launchers/train.py's ``run``) on a model dir.

    torchrun --nproc-per-node 2 tests/dist/offline_e2e_worker.py CONFIG MODEL_DIR OUT_DIR [overrides...] RESULT.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    config, model_dir, out_dir, *overrides, result_path = sys.argv[1:]
    from alignment.config import register
    from launchers.train import run

    register()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = compose(config, overrides=[f"model.path={model_dir}", f"output_dir={out_dir}", "model.dtype=float32",
                                            *overrides])
    summary = run(cfg)
    if os.environ.get("RANK", "0") == "0":
        Path(result_path).write_text(json.dumps(summary, default=float))


if __name__ == "__main__":
    main()
