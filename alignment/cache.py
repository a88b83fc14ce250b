"""Where megalign keeps what it derives once: converted models (``hf/``), the demo data sets
(``data/``), held-out accuracies of base checkpoints (``heldout/``), evaluation results
(``evaluate/``) and vLLM's compiled models (``compile/``, :mod:`alignment.rollout.engines.compile_cache`).
One root for all of it: ``$MEGALIGN_CACHE``, default ``~/.cache/megalign``."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "MEGALIGN_CACHE"


def cache_root() -> Path:
    """``$MEGALIGN_CACHE`` (``~`` expanded), else ``~/.cache/megalign``; not created here."""
    return Path(os.environ.get(CACHE_ENV) or "~/.cache/megalign").expanduser()
