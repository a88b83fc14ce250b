"""``megalign``: one command for every job and tool.

    megalign train [--nproc N] [--config-name NAME] [hydra overrides]   # compose, check, then torchrun
    megalign train --config-dir my_configs --config-name my_job         # a job file of your own (my_configs/my_job.yaml)
    megalign train --config-name sft --dry-run trainer.steps=4          # check only: "ok: ..." or one error line
    megalign train --config-name dpo --print-config                     # the resolved config a job would run
    megalign convert [--nproc N] import|export|reshape SRC OUT [--tp ...]
    megalign evaluate | plan | profile | init-model | plot | rerank | vision-task [their own arguments, --help]

``megalign train`` composes the job's config (``configs/<name>.yaml`` with the overrides) and checks
it once in this process, with the checks every rank makes at start (the config against the world
size and the model, then the job's inputs: :func:`launchers.common.check_job`); only then does it
start ``--nproc`` processes of ``launchers/train.py`` as ``torchrun`` would
(``torch.distributed.run``'s own launcher, in this process). A bad input prints one line,
``megalign: error: <what and how to fix>``, and exits with status 2: no traceback from any rank
and no launcher report. ``--debug`` shows the tracebacks instead.

Each other subcommand hands its arguments to the tool's own ``main`` (``tools/<tool>.py``);
``convert --nproc N`` runs ``tools/convert_checkpoint.py`` under the same launcher.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import signal
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args, get_args_parser

from alignment.compose import compose_job, split_job_args
from alignment.config import config_yaml, job_config
from alignment.schema import ConfigError, plain
from alignment.training.checkpoint import latest_checkpoint
from launchers.common import SUMMARY_ENV, check_job
from launchers.console import BAD_INPUT_EXIT, ERROR_FILE_ENV, error_line
from launchers.job_guard import check_run_dir_free
from launchers.phase_log import failure_report
from launchers.summary import job_summary, mark_unread, unread_settings
from parallel.layout import LayoutError

ROOT = Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = ROOT / "launchers" / "train.py"

#: what torch's launcher handles while it runs (it raises SignalException from them); put back after
LAUNCHER_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
#: subcommand -> (module, one-line help); each module has ``main(argv)``, imported when its command runs
TOOLS = {
    "evaluate": ("tools.evaluate", "checkpoints side by side on fixed suites (tools/evaluate.py)"),
    "plan": ("tools.plan_layout", "every valid parallel layout of a model on a cluster, with its memory"),
    "profile": ("tools.profile_step", "run a job with the profiler on, or report on a finished run"),
    "init-model": ("tools.init_model", "a randomly initialised HF model from an architecture config"),
    "plot": ("tools.plot_metrics", "a run's TensorBoard curves as PNG files"),
    "rerank": ("tools.rerank", "best-of-N reranking with process / outcome reward models"),
    "vision-task": ("tools.vision_task", "the shape-count image task, a VLM from a text model, its accuracy"),
}


@contextlib.contextmanager
def quiet_libraries(debug: bool):
    """Keep the parent's checks and the launcher to megalign's own lines: library warnings and
    logs below ERROR off (the launcher's own, ``torch.distributed.elastic``, entirely), restored on
    exit. ``debug``: leave everything on."""
    if debug:
        yield
        return
    names = ("", "transformers", "torch.distributed.elastic", "hydra")
    levels = {n: logging.getLogger(n).level for n in names}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in names:
            logging.getLogger(n).setLevel(logging.CRITICAL if n == "torch.distributed.elastic" else logging.ERROR)
        try:
            yield
        finally:
            for n, level in levels.items():
                logging.getLogger(n).setLevel(level)


def _train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megalign train", description="Compose and check a job's config, then run it "
                                "with --nproc processes (torchrun). Other arguments: --config-name NAME (a shipped "
                                "job, or NAME.yaml in --config-dir DIR) and key=value overrides.")
    p.add_argument("--nproc", type=int, default=1, help="processes per node (torchrun --nproc-per-node)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes (>1: also --rdzv-endpoint HOST:PORT)")
    p.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous, with --nnodes > 1")
    p.add_argument("--dry-run", action="store_true", help="check the config and inputs, print 'ok: ...', start nothing")
    p.add_argument("--print-config", action="store_true", help="check, then print the resolved config (YAML), what "
                   "the job does not read marked, and exit")
    p.add_argument("--debug", action="store_true", help="tracebacks instead of one-line errors")
    return p


@dataclass
class Checked:
    """A job composed and checked (:func:`check`): its :class:`alignment.compose.Composition`, the typed
    config, the model's directory and HF config, the resume note and the data read (an RL job's prompts,
    an SFT / RM / DPO job's example counts)."""

    composed: object
    cfg: object
    hf_dir: Path
    hf_config: object
    note: str | None
    prompts: object


def check(name: str, overrides: list[str], world_size: int, config_dir: str | None = None) -> Checked:
    """Compose the job ``name`` (``configs/<name>.yaml``, or ``<config_dir>/<name>.yaml``) with
    ``overrides`` (:func:`alignment.compose.compose_job`) and make every rank's start-up checks for
    ``world_size`` processes (:func:`launchers.common.check_job`), before any process starts.

    Raises:
        ConfigError, LayoutError, CheckpointError, FileNotFoundError, ValueError, Hydra's errors:
            naming the field or file and the fix (docs "Bad inputs").
    """
    composed = compose_job(name, overrides, config_dir)
    cfg = job_config(composed.cfg)
    check_run_dir_free(cfg.output_dir)  # no live job writes there
    hf_dir, hf_config, note, prompts = check_job(cfg, world_size)
    return Checked(composed, cfg, hf_dir, hf_config, note, prompts)


def launch(script: Path, script_args: list[str], nproc: int, nnodes: int = 1, rdzv_endpoint: str | None = None,
           env: dict | None = None, failures: dict | None = None) -> int:
    """Run ``python script script_args`` in ``nproc`` processes per node with
    ``torch.distributed.run``'s launcher in this process (one node: as ``--standalone``). Returns
    the exit status: 0, or that of the rank that failed first (the launcher then stops the others).
    ``failures``: filled, when given, with every failed rank's ``(pid, exit code)`` by global rank.
    After a failure, whatever a failed rank started and left (its process group) is killed."""
    endpoint = "localhost:0" if nnodes == 1 else str(rdzv_endpoint)  # torchrun --standalone's, on one node
    targs = ["--nproc-per-node", str(nproc), "--nnodes", str(nnodes), "--rdzv-backend", "c10d",
             "--rdzv-endpoint", endpoint, "--rdzv-id", "megalign"]
    args = get_args_parser().parse_args([*targs, str(script), *script_args])
    saved = dict(os.environ)
    handlers = {sig: signal.getsignal(sig) for sig in LAUNCHER_SIGNALS}  # the launcher installs its own
    os.environ.update(env or {})  # the ranks inherit this process's environment
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # megalign sets its threads per process (launchers/common.start)
    try:
        config, cmd, cmd_args = config_from_args(args)
        elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
    except ChildFailedError as e:
        if failures is not None:
            failures.update({rank: (f.pid, f.exitcode) for rank, f in e.failures.items()})
        for f in e.failures.values():  # each rank led a process group: what it started goes with it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(f.pid, signal.SIGKILL)
        return e.get_first_failure()[1].exitcode or 1  # the root cause: the others were stopped after it
    finally:
        os.environ.clear()
        os.environ.update(saved)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return 0


def train(argv: list[str]) -> int:
    """``megalign train``; returns the exit status (2: a bad input, one line printed)."""
    opts, rest = _train_parser().parse_known_args(argv)
    with quiet_libraries(opts.debug):
        return _train(opts, rest)


def _train(opts, rest: list[str]) -> int:
    world = opts.nproc * opts.nnodes
    try:
        if opts.nproc < 1 or opts.nnodes < 1:
            raise ConfigError(f"--nproc {opts.nproc} --nnodes {opts.nnodes}: both must be >= 1")
        if opts.nnodes > 1 and not opts.rdzv_endpoint:
            raise ConfigError(f"--nnodes {opts.nnodes} needs --rdzv-endpoint HOST:PORT (the first node's address), "
                             "or launch each node with srun (slurm/)")
        name, config_dir, overrides = split_job_args(rest)
        checked = check(name, overrides, world, config_dir)
        if opts.print_config:  # validated, as the job would run, with what it does not read marked
            print(mark_unread(config_yaml(checked.cfg), unread_settings(checked.cfg)), end="")
            return 0
        lines = job_summary(checked.composed, checked.cfg, checked.hf_config, checked.prompts, checked.note, world)
    except Exception as e:  # noqa: BLE001 - every bad input ends the same way: one line
        if opts.debug:
            raise
        print(error_line(e), file=sys.stderr, flush=True)
        return BAD_INPUT_EXIT
    cfg = checked.cfg
    print("\n".join(lines), flush=True)
    if opts.dry_run:
        print(f"ok: {name} ({cfg.algorithm.name}), {world} process(es), model {checked.hf_dir}, "
              f"parallel {plain(cfg.parallel)}, output_dir {cfg.output_dir}", flush=True)
        return 0
    with tempfile.TemporaryDirectory(prefix="megalign-") as tmp:
        errors = Path(tmp) / "error"
        env = {SUMMARY_ENV: "1"} if opts.debug else {ERROR_FILE_ENV: str(errors), SUMMARY_ENV: "1"}
        failures: dict = {}
        job = [f"--config-name={name}", *([f"--config-dir={Path(config_dir).expanduser().resolve()}"] if config_dir
                                          else [])]
        status = launch(TRAIN_SCRIPT, [*job, *overrides], opts.nproc, opts.nnodes,
                        opts.rdzv_endpoint, env, failures)
        if status and errors.exists():  # a rank's bad input (launchers/train.py): its first line
            print(errors.read_text().splitlines()[0], file=sys.stderr, flush=True)
            return BAD_INPUT_EXIT
        if status:
            why = failure_report(failures, cfg.output_dir, cfg.trainer.collective_timeout_s) if failures else \
                f"exit status {status} of a rank"
            latest = latest_checkpoint(Path(cfg.output_dir) / "checkpoints")
            resume = f"the same command resumes from {latest}" if latest else "no checkpoint was complete yet"
            print(f"megalign: error: the job failed: {why}; {resume} (a rank's traceback, if any, is above)",
                  file=sys.stderr, flush=True)
        return status


def convert(argv: list[str]) -> int:
    """``megalign convert [--nproc N] ...``: ``tools/convert_checkpoint.py`` in this process (N=1)
    or under the launcher."""
    p = argparse.ArgumentParser(prog="megalign convert", add_help=False)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--debug", action="store_true", help="show tracebacks instead of one error line")
    opts, rest = p.parse_known_args(argv)
    tool = importlib.import_module("tools.convert_checkpoint")
    if opts.nproc > 1:
        if "-h" not in rest and "--help" not in rest:
            try:  # the layout against the model, before any rank starts
                tool.check_layout(rest, opts.nproc)
            except (LayoutError, FileNotFoundError, OSError, ValueError) as e:
                if opts.debug:
                    raise
                print(error_line(e), file=sys.stderr, flush=True)
                return BAD_INPUT_EXIT
        return launch(ROOT / "tools" / "convert_checkpoint.py", rest, opts.nproc)
    tool.main(rest)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The ``megalign`` entry point; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if os.getcwd() not in sys.path:  # as `python -m`: your own modules (rewards, agents) import from here
        sys.path.insert(1, os.getcwd())
    commands = {"train": "compose, check and run a job (torchrun)",
                "convert": "HF <-> Megatron checkpoints (tools/convert_checkpoint.py)",
                **{k: v[1] for k, v in TOOLS.items()}}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        width = max(map(len, commands))
        usage = "usage: megalign COMMAND [ARGS] (megalign COMMAND --help)\n\n" + "\n".join(
            f"  {k:<{width}}  {v}" for k, v in commands.items())
        if argv and argv[0] not in ("-h", "--help"):
            print(f"megalign: error: unknown command {argv[0]!r}: one of {', '.join(commands)}", file=sys.stderr)
            return BAD_INPUT_EXIT
        print(usage)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "train":
        return train(rest)
    if command == "convert":
        return convert(rest)
    status = importlib.import_module(TOOLS[command][0]).main(rest)
    return status if isinstance(status, int) else 0


if __name__ == "__main__":
    sys.exit(main())
