"""Hydra composition of a job's config from the repository's ``configs/`` folder, outside
``@hydra.main``: what ``megalign train``, the preflight check, the evaluation suites and the docs
tests compose, exactly as ``launchers/train.py`` would at start."""

from __future__ import annotations

from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import DictConfig

from alignment.config import register

#: the config groups and jobs (``configs/<name>.yaml``, ``configs/recipes/...``)
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def compose(config_name: str, overrides: list[str]) -> DictConfig:
    """``configs/<config_name>.yaml`` composed with the Hydra ``overrides`` (``key=value``,
    ``group=option``, ``+key=value``), the schema's types and defaults applied.

    Raises:
        hydra.errors.*Exception / omegaconf errors: an unknown key or a wrong type in ``overrides``.
    """
    register()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return hydra_compose(config_name, overrides=list(overrides))
