"""Check a job's config for the world size an allocation gives, before any training process
starts (``slurm/launch.sh`` runs it on the batch node, ``launchers/nemo_launch.py`` before it
submits): Hydra composes ``configs/<name>.yaml`` with the overrides (unknown keys and wrong
types are errors), then :func:`alignment.config.validate` checks the parallel layout and batch
sizes against that world size and the model, the same checks every rank makes at start.

    python launchers/preflight.py --world-size 16 --config-name grpo parallel.tensor_model_parallel_size=2

Prints ``preflight ok: ...`` and exits 0, or prints the error (naming the field and the fix)
and exits 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from alignment.compose import compose  # noqa: E402 - after the path, for `python launchers/preflight.py`
from alignment.config import job_config, validate  # noqa: E402
from alignment.models.hf_assets import prepare_hf_dir  # noqa: E402
from alignment.schema import ConfigError, plain  # noqa: E402
from parallel.layout import LayoutError  # noqa: E402


def model_config(path: str, resolve: bool, revision: str | None = None):
    """The HF config of ``model.path``, or None when it is not an HF directory and ``resolve`` is
    False (a GGUF or "smollm2" is converted once, ~30 s, by :func:`prepare_hf_dir`)."""
    from transformers import AutoConfig

    p = Path(path).expanduser()
    if p.is_dir() and (p / "config.json").exists():
        return AutoConfig.from_pretrained(p)
    if not resolve:
        return None

    return AutoConfig.from_pretrained(prepare_hf_dir(path, revision=revision))


def check(config_name: str, overrides: list[str], world_size: int, resolve_model: bool = True,
          config_dir: str | None = None):
    """Compose ``configs/<config_name>.yaml`` with ``overrides`` and validate it for ``world_size``
    processes; returns the typed config (:class:`alignment.config.JobConfig`).

    Raises:
        hydra.errors.*Exception / omegaconf errors: an unknown key or a wrong type in ``overrides``.
        alignment.schema.ConfigError / parallel.layout.LayoutError: a value that cannot work for
            this world size or model, naming the field and the valid values (without the model
            only TP x PP x CP dividing ``world_size`` is checked).
        ValueError: ``world_size`` < 1.
    """

    if world_size < 1:
        raise ValueError(f"world size {world_size}: must be >= 1 (nodes x processes per node)")
    cfg = job_config(compose(config_name, overrides, config_dir))
    hf_config = model_config(cfg.model.path, resolve_model, cfg.model.revision)
    if hf_config is not None:
        validate(cfg, world_size=world_size, hf_config=hf_config)
        return cfg
    p = cfg.parallel  # without the model: the part of the layout check that needs only the world size
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    if world_size % (tp * pp * cp):
        raise LayoutError(f"world size {world_size} is not divisible by parallel.tensor_model_parallel_size x "
                          f"pipeline_model_parallel_size x context_parallel_size = {tp} x {pp} x {cp}; change them "
                          f"or launch a multiple of {tp * pp * cp} processes (nodes x processes per node)")
    c = cfg.cluster
    if c.gpus_per_node and world_size != c.nodes * c.gpus_per_node:

        raise ConfigError(f"cluster.nodes x cluster.gpus_per_node = {c.nodes} x {c.gpus_per_node} processes, but the "
                          f"allocation starts {world_size}: match them, or set cluster=local / cluster.gpus_per_node=0")
    return cfg


def main(argv: list[str] | None = None) -> int:
    """Command line: ``--world-size N --config-name NAME [overrides...]``; returns the exit code."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", type=int, required=True, help="nodes x processes per node")
    ap.add_argument("--config-name", required=True, help="a config in configs/ (grpo, sft, rm, dpo, ppo, ...)")
    ap.add_argument("--config-dir", default=None, help="a folder of your own job files, searched before configs/")
    ap.add_argument("--no-resolve-model", action="store_true", help="skip model checks unless model.path is an HF dir")
    ap.add_argument("overrides", nargs="*", help="hydra overrides, key=value")
    args = ap.parse_args(argv)

    try:
        cfg = check(args.config_name, args.overrides, args.world_size, resolve_model=not args.no_resolve_model,
                    config_dir=args.config_dir)
    except Exception as e:  # noqa: BLE001 - every config error is reported the same way
        print(f"preflight: config error for --config-name {args.config_name} at world size {args.world_size}: "
              f"{type(e).__name__}: {e}", flush=True)
        return 2
    print(f"preflight ok: {args.config_name} ({cfg.algorithm.name}), world size {args.world_size}, "
          f"parallel {plain(cfg.parallel)}, output_dir {cfg.output_dir}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
