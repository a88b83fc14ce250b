"""What every job does around its loop: resolve the model directory, validate the config
before any process group starts, start the groups, write the resolved config, log to
TensorBoard, show progress, write ``summary.json`` and shut down."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml

from alignment.algorithms.config import routing_replay
from alignment.config import JobConfig, config_yaml, fit_context, job_config, parallel_sizes, validate
from alignment.data.text_files import read_jsonl
from alignment.models.config import lora_spec
from alignment.models.families import get_bridge, text_config
from alignment.models.hf_assets import prepare_hf_dir
from alignment.models.hf_files import check_hf_dir
from alignment.models.lora_export import save_peft_adapter
from alignment.rollout.config import rollout_ranks
from alignment.rollout.engines.disaggregated import serve
from alignment.rollout.engines.factory import build_engine
from alignment.schema import ConfigError
from alignment.training.host_memory import bound_onednn_primitive_cache, return_freed_memory_to_os
from alignment.training.offload import offload_enabled
from launchers.build import rollout_layout
from launchers.console import route_third_party_output
from launchers.input_checks import check_inputs
from launchers.job_guard import die_with_launcher, lock_run_dir
from launchers.memory_plan import check_memory
from launchers.phase_log import open_log
from launchers.preemption import install
from launchers.profiling import PhaseTimers, StepProfiler, memory_report
from launchers.summary import job_summary
from launchers import trackers
from launchers.teardown import close_job
from parallel.layout import ParallelLayout
from parallel.reshard import Resharder
from parallel.state import env_world, init_distributed, is_rollout_rank, shutdown, trainer_rollout_group


#: the job's YAML file (set by ``launchers/train.py``), copied into the run directory as ``job.yaml``
JOB_FILE_ENV = "MEGALIGN_JOB_FILE"
#: set by ``megalign train``, which printed the start-up summary (launchers/summary.py) before the ranks started
SUMMARY_ENV = "MEGALIGN_SUMMARY_PRINTED"


@dataclass
class Run:
    """One job's process-wide state: ranks, the HF model dir and config, the output dir and
    (rank 0 only) the TensorBoard writer and the experiment trackers (``logger.backends``)."""

    cfg: JobConfig
    rank: int
    world: int
    hf_dir: Path
    hf_config: Any  # transformers' PretrainedConfig
    out: Path
    writer: Any = None  # torch.utils.tensorboard's SummaryWriter (rank 0)
    history: list[dict[str, float]] = field(default_factory=list)
    profiler: Any = None  # launchers.profiling.StepProfiler (profile.*)
    timers: PhaseTimers = field(default_factory=PhaseTimers)  # summed phase times, e.g. checkpoint
    prompts: Any = None  # what the job reads, checked at start: PromptSets (RL) or ExampleCounts (SFT / RM / DPO)
    trackers: list[trackers.Tracker] = field(default_factory=list)  # rank 0: logger.backends but tensorboard
    tracker_ids: dict[str, str] = field(default_factory=dict)  # rank 0: the run ids a resume read, kept

    @property
    def resolved_config(self) -> str:
        """The job's config with every interpolation resolved (YAML), as saved with the run and
        with every checkpoint."""
        return config_yaml(self.cfg)

    def log(self, values: dict[str, float], step: int) -> None:
        """Scalars to TensorBoard and every tracker at ``step`` (rank 0 writes)."""
        if self.writer is not None:
            for k, v in values.items():
                self.writer.add_scalar(k, v, step)
            self.writer.flush()
        self.trackers = trackers.each(self.trackers, self.cfg.logger, lambda t: t.log(values, step))

    def start_trackers(self, resumed: Path | None) -> None:
        """Rank 0: start ``logger.backends``' trackers (:func:`launchers.trackers.start`), continuing the runs
        the checkpoint ``resumed`` names (None: new runs), with the resolved config as their parameters."""
        if self.rank == 0:
            config = yaml.safe_load(self.resolved_config)
            self.tracker_ids = trackers.saved_ids(resumed)  # kept for a tracker left out (on_error=warn)
            self.trackers = trackers.start(self.cfg.logger, self.cfg.run_name or self.out.name, config, self.out,
                                           resumed)

    def log_table(self, name: str, path: Path, step: int) -> None:
        """Rank 0: the JSON-lines table ``path`` (the rollout table, held-out answers) to every tracker as
        ``name`` at ``step``, when it was written."""
        if self.trackers and Path(path).is_file():
            rows = [r for _, r in read_jsonl(path, name)]
            self.trackers = trackers.each(self.trackers, self.cfg.logger, lambda t: t.log_rows(name, rows, step))

    def tracker_files(self) -> dict[str, str]:
        """What a checkpoint keeps of the trackers: each one's run id (:data:`launchers.trackers.IDS_FILE`), those
        the resumed checkpoint named included."""
        ids = {**self.tracker_ids, **{t.name: t.run_id for t in self.trackers}}
        return {trackers.IDS_FILE: json.dumps(ids)} if ids else {}

    def close_loggers(self) -> None:
        """Rank 0: close the TensorBoard writer and end every tracker's run (it stays resumable)."""
        if self.writer is not None:
            self.writer.close()
        self.trackers = trackers.each(self.trackers, self.cfg.logger, lambda t: t.close(), closing=True)

    def seconds_since_launch(self) -> float:
        """Wall seconds since this process started (``psutil``'s creation time): the start-up cost
        when called before the first step."""
        import time

        import psutil

        return time.time() - psutil.Process().create_time()

    def progress(self, start: int, total: int, desc: str):
        """``range(start, total)``, with a tqdm bar on rank 0 when ``trainer.progress_bar``."""
        steps = range(start, total)
        if self.rank == 0 and self.cfg.trainer.progress_bar:
            from tqdm import tqdm

            return tqdm(steps, desc=desc, dynamic_ncols=True, initial=start, total=total)
        return steps

    def finish(self, summary: dict, message: str, engine=None) -> dict:
        """Rank 0 prints ``message`` and writes ``summary.json``; all ranks wait, then the rollout
        ``engine`` is closed (vLLM's teardown also tears down torch.distributed) and the groups shut down."""

        reports = [None] * self.world
        traces = self.profiler.written if self.profiler is not None else []
        dist.all_gather_object(reports, {**memory_report(self.rank), "host": os.uname().nodename, "traces": traces})
        summary.update(memory=reports, phase_timers=self.timers.as_dict())
        if self.rank == 0:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
        close_job(self, message, engine)
        return summary


def cpu_threads(world: int) -> int:
    """Intra-op threads of this process: 8 with a GPU; on a CPU-only run ``MEGALIGN_CPU_THREADS``
    when set, else the host's CPUs shared among its ``LOCAL_WORLD_SIZE`` processes (default: all
    ``world`` ranks on this host). Raises a ConfigError naming the variable when it is not a
    positive integer. (Several "nodes" on one host, as the Slurm tests run them, set it: torchrun's
    workers see ``LOCAL_WORLD_SIZE=1`` per node.)"""
    if torch.cuda.is_available():
        return 8
    if value := os.environ.get("MEGALIGN_CPU_THREADS"):
        if not value.isdigit() or int(value) < 1:
            raise ConfigError(f"MEGALIGN_CPU_THREADS={value!r}: give a positive number of threads per process")
        return int(value)
    return max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world)))


def export_adapters(job: Run, model, bridge) -> None:
    """With ``model.lora``: the adapters as a PEFT directory ``<output_dir>/hf_adapter`` for the
    base in ``job.hf_dir`` (beside the merged ``hf/`` export); nothing otherwise. Collective."""

    spec = lora_spec(job.cfg.model.lora, job.cfg.seed)
    if spec is not None:
        save_peft_adapter(model, bridge, spec, job.hf_dir, job.out / "hf_adapter")


def serve_as_rollout_rank(cfg, hf_dir: Path, hf_config) -> None:
    """All a rollout rank of a disaggregated job does: build its vLLM engine from ``hf_dir`` (the
    initial policy) and the receiving side of the weight sync, serve the trainers until they stop
    it (:func:`alignment.rollout.engines.disaggregated.serve`), then close the engine and the groups."""

    group, r = trainer_rollout_group(), cfg.rollout
    trainers = group.size - r.rollout_ranks
    engine = build_engine(r, seed=cfg.seed, dtype=cfg.model.dtype, hf_dir=hf_dir, policy=None, vocab_size=text_config(hf_config).vocab_size,
                          rank=group.rank - trainers, data_parallel_size=1, steps=cfg.trainer.steps,
                          record_routing=routing_replay(cfg.algorithm) == "r3")
    resharder = Resharder(None, rollout_layout(get_bridge(hf_config), cfg), vllm_tp=r.tensor_parallel_size,
                          bucket_bytes=r.sync_bucket_mb << 20, group=group, dtype=getattr(torch, cfg.model.dtype),
                          device="cuda" if torch.cuda.is_available() else "cpu")
    try:
        # MEGALIGN_PARTIAL_HOLD_CHUNKS (tests): partial rollouts take the update after that many chunks
        serve(engine, resharder, group, trainers, r.tensor_parallel_size,
              hold_chunks=int(os.environ.get("MEGALIGN_PARTIAL_HOLD_CHUNKS", "0")), carry=r.partial_carry_over)
    finally:
        engine.close()
        shutdown()


def check_output_dir(output_dir: str) -> None:
    """``output_dir`` is a folder this process can write, or can be created (its nearest existing parent is a
    writable folder); nothing is created here.

    Raises:
        ConfigError: naming ``output_dir``, what is in the way and the fix.
    """
    path = Path(output_dir).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    why = None
    if not existing.is_dir():
        why = f"{existing} is a file"
    elif not os.access(existing, os.W_OK | os.X_OK):
        why = f"{existing} is not writable by this user"
    if why:
        raise ConfigError(f"output_dir={output_dir}: cannot be {'written' if existing == path else 'created'} ({why}); "
                          "give a folder you can write, e.g. output_dir=outputs/<run>")


def check_job(cfg: JobConfig, world_size: int):
    """What :func:`start` checks before any process group: the config against the world size and
    the model (:func:`alignment.config.validate`), then the job's inputs
    (:func:`launchers.input_checks.check_inputs`), then its memory per GPU against the cluster's
    (:func:`launchers.memory_plan.check_memory`). Returns ``(hf_dir, hf_config, note, prompts)``:
    ``prompts`` an RL job's :class:`alignment.data.prompt_data.PromptSets` (else None).

    Raises:
        ConfigError, LayoutError, CheckpointError, FileNotFoundError, ValueError: naming the field
            or file and the fix (docs/reference/bad-inputs.md).
    """
    from transformers import AutoConfig, AutoTokenizer

    cfg = job_config(cfg)  # typed once: the checks below resolve defaults in it
    check_output_dir(cfg.output_dir)
    hf_dir = prepare_hf_dir(cfg.model.path, revision=cfg.model.revision)  # a Hub id: downloaded once per node
    check_hf_dir(hf_dir, "model.path", tokenizer=True)  # a damaged file named before transformers reads it
    hf_config = AutoConfig.from_pretrained(hf_dir)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    context_given = cfg.rollout.max_model_len is not None
    validate(cfg, world_size=world_size, hf_config=hf_config, tokenizer_size=len(tokenizer))  # resolves the model's
    note, prompts = check_inputs(cfg, hf_config, tokenizer)
    if not context_given and getattr(prompts, "longest", 0):  # an RL job's prompts: the context they need
        fit_context(cfg, prompts.longest)
    check_memory(cfg, hf_config, world_size - rollout_ranks(cfg.rollout))  # cluster.gpu_memory_gib
    trackers.check_servers(cfg.logger)  # a tracking server that does not answer
    return hf_dir, hf_config, note, prompts


def start(cfg: JobConfig, composed=None) -> Run:
    """Validate ``cfg`` against the world size and the model and check its inputs
    (:mod:`launchers.input_checks`), both before any process group; set
    the CPU threads per process, initialise the parallel groups, create the output dir with
    ``config.yaml`` and a TensorBoard writer.

    Before anything else, a rank started by torchrun asks to die with the launcher, and every rank
    takes its lock on the output directory (:mod:`launchers.job_guard`).

    The rollout ranks of a disaggregated job (``rollout.placement``) do not return: they serve
    the trainers' generation and weight syncs until the trainers stop them, then exit (status 0).
    The returned :class:`Run` is a trainer's (``world``: the trainer ranks)."""

    install()  # SIGUSR1/SIGTERM: checkpoint at the next step boundary and exit (launchers/preemption.py)
    die_with_launcher()  # under torchrun: SIGKILLed when the launcher dies, never an orphan
    rank, world, _ = env_world()
    lock_run_dir(cfg.output_dir, rank)  # one job per run directory: a second is refused before it writes
    open_log(cfg.output_dir, rank)  # where this rank is, for the report of a job that dies
    return_freed_memory_to_os()
    bound_onednn_primitive_cache()
    if cfg.trainer.quiet:
        log = route_third_party_output(Path(cfg.output_dir) / "logs" / f"rank{rank}.log")
        if rank == 0:
            print(f"third-party output (vLLM, torch, ...): {log}", flush=True)
    hf_dir, hf_config, note, prompts = check_job(cfg, world)
    if rank == 0 and not os.environ.get(SUMMARY_ENV):  # megalign train printed it before the ranks started
        print("\n".join(job_summary(composed, cfg, hf_config, prompts, note, world)), flush=True)
    torch.set_num_threads(cpu_threads(world))
    engines = rollout_ranks(cfg.rollout)
    init_distributed(ParallelLayout(world_size=world - engines, **parallel_sizes(cfg.parallel)), seed=cfg.seed,
                     timeout_minutes=cfg.trainer.collective_timeout_s / 60, rollout_ranks=engines)
    if is_rollout_rank():
        serve_as_rollout_rank(cfg, hf_dir, hf_config)
        raise SystemExit(0)
    world -= engines
    run = Run(cfg, rank, world, hf_dir, hf_config, Path(cfg.output_dir), prompts=prompts)
    run.profiler = StepProfiler(cfg.profile, rank)

    if cfg.trainer.offload and not offload_enabled(True) and rank == 0:
        print("trainer.offload=true is a no-op without a GPU (host memory is the device memory)", flush=True)
    if rank == 0:
        run.out.mkdir(parents=True, exist_ok=True)
        (run.out / "config.yaml").write_text(run.resolved_config)
        job_file = os.environ.get(JOB_FILE_ENV)
        if job_file and Path(job_file).is_file():  # the job as written (config.yaml: as resolved)
            shutil.copyfile(job_file, run.out / "job.yaml")
        if "tensorboard" in cfg.logger.backends:
            from torch.utils.tensorboard import SummaryWriter

            run.writer = SummaryWriter(str(run.out / "tensorboard"))
    return run
