"""Entry point: ``torchrun --nproc-per-node 2 launchers/train.py [--config-dir DIR] [--config-name NAME]
[hydra overrides]`` (what ``megalign train`` launches, and ``srun`` / nemo-run run).

config (composed as every entry composes it: :func:`alignment.compose.compose_job`) -> validate (before any
process group) -> init groups -> build models -> the job's loop (:mod:`launchers.loop` for the RL jobs).
Works the same under ``srun`` and as a single process.
"""

from __future__ import annotations

import logging
import os
import random
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if os.getcwd() not in sys.path:  # as `python -m`: your own modules (rewards, agents) import from here
    sys.path.insert(1, os.getcwd())

from alignment.algorithms import registry  # noqa: E402
from alignment.algorithms.config import OnlineDPOConfig, has_section, reference_policy  # noqa: E402
from alignment.compose import compose_job, split_job_args  # noqa: E402
from alignment.config import JobConfig, job_config  # noqa: E402
from alignment.data.prompt_data import training_order  # noqa: E402
from alignment.rewards.policy import process_reward_weight, reward_terms  # noqa: E402
from alignment.trainers import rl_phases  # noqa: E402
from alignment.trainers.heldout import HeldoutAccuracy  # noqa: E402
from alignment.trainers.interfaces import JobSpec  # noqa: E402
from launchers import loop, offline_job, ppo_job  # noqa: E402
from alignment.rollout.engines.carryover import CarryOverPool  # noqa: E402
from alignment.rollout.config import rollout_ranks  # noqa: E402
from alignment.rollout.engines.carried_remote import RemotePool  # noqa: E402
from launchers.build import build_models  # noqa: E402
from launchers.carried import CarriedPrompts  # noqa: E402
from launchers.common import JOB_FILE_ENV, start  # noqa: E402
from launchers.console import BAD_INPUT_EXIT, report_bad_input, route_third_party_output  # noqa: E402
from launchers.phase_log import record_error  # noqa: E402
from launchers.preemption import install  # noqa: E402
from parallel.state import env_world, replica_group  # noqa: E402


def needs_reference(cfg) -> bool:
    """A frozen reference policy: for the KL term (``algorithm.kl_coef > 0``) or online DPO's
    losses that use one (all but ``simpo`` / ``orpo``): :func:`alignment.algorithms.config.reference_policy`."""
    return reference_policy(cfg.algorithm)


def roles(cfg) -> list[str]:
    """The models a GRPO-family, ``distill``, ``rft`` or ``online_dpo`` job builds (:func:`launchers.build.build_models`):
    the policy and its rollout engine; the frozen reference (:func:`needs_reference`); ``distill``'s teacher; the reward
    model when ``reward.functions`` names ``reward_model``; the process reward model for ``process_reward``."""
    return ["policy", "engine", *(["reference"] if needs_reference(cfg) else []),
            *(["teacher"] if registry.get(cfg.algorithm.name).teacher else []),
            *(["reward_model"] if any(term.name == "reward_model" for term in reward_terms(cfg)) else []),
            *(["process_reward_model"] if process_reward_weight(cfg) else [])]


def run(cfg, composed=None) -> dict:
    """Run the job ``cfg.algorithm.name`` names; returns the summary written to ``<output_dir>/summary.json``.

    The composed config becomes the typed :class:`alignment.config.JobConfig` here, once
    (:func:`alignment.config.job_config`); everything below reads that. The algorithm's record
    (:mod:`alignment.algorithms.registry`) says which job runs it: ``offline`` (``sft``, ``rm``, ``dpo``,
    ``prm``: :mod:`launchers.offline_job`), ``ppo`` (:mod:`launchers.ppo_job`), ``online`` (the GRPO family,
    ``rft``, ``online_dpo``, ``distill``: :mod:`launchers.loop` with :func:`run_rl`'s pieces).
    """
    cfg = job_config(cfg)
    job = registry.get(cfg.algorithm.name).job
    if job == "offline":
        return offline_job.run(cfg, composed)
    if job == "ppo":
        return ppo_job.run(cfg, composed)
    return run_rl(cfg, composed)


def run_rl(cfg: JobConfig, composed=None) -> dict:
    """Run a GRPO-family job, rejection-sampling fine-tuning (``rft``: :mod:`alignment.trainers.rft`)
    or online DPO (``online_dpo``: :mod:`alignment.trainers.online_dpo`) through
    :mod:`launchers.loop`; returns the summary written to ``<output_dir>/summary.json``."""
    job = start(cfg, composed)  # validates the config and reads the prompts before any process group starts
    models = build_models(cfg, job, roles(cfg))
    train, heldout = training_order(cfg.data, cfg.seed, job.prompts), job.prompts.heldout

    # the algorithm's trainer (its record's): grpo (and distill), rft (SFT on the accepted samples), online_dpo
    # (DPO on the best-worst pairs of the policy's own samples), or your own (algorithm.name=module.path:Algorithm)
    name = cfg.algorithm.name
    trainer = registry.get(name).trainer_module()

    carried = carried_prompts(cfg, models, train)  # rollout.partial_carry_over: the pool in flight

    def collect(problems, step: int, version: int):
        from megatron.core import parallel_state as ps

        rng = random.Random(hash((cfg.seed, step, ps.get_data_parallel_rank())))

        def refill(k: int):  # more training problems (DAPO's dynamic sampling)
            return [train.items[rng.randrange(len(train))] for _ in range(k)]

        if carried is None:
            return trainer.collect(models, problems, cfg, version, refill)
        carried.admit_through(step)  # the prompts of steps up to step + max_staleness in flight
        rollout = trainer.collect(models, problems, cfg, version, carried=carried.pool)
        carried.took(step, carried.pool.last_taken)
        return rollout

    trained = {"policy": (models.policy, models.optimizer)}
    if has_section(cfg.algorithm, OnlineDPOConfig) and cfg.algorithm.ref_update == "iteration":
        trained["reference"] = (models.reference, None)  # the iteration's reference resumes too
    spec = JobSpec(name, train, collect,
                         lambda rollout: trainer.train(models, rollout, cfg), trained,
                         HeldoutAccuracy(job, models, heldout),
                         request=lambda problems: rl_phases.request(models.tokenizer, problems, cfg),
                         carried=carried)
    return loop.run(job, models, spec)


def carried_prompts(cfg: JobConfig, models, train) -> CarriedPrompts | None:
    """``rollout.partial_carry_over``: this rank's pool of partial rollouts carried across steps over the training
    order ``train``; None without it."""
    from megatron.core import parallel_state as ps

    r = cfg.rollout
    if not r.partial_carry_over:
        return None
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    sampling = rl_phases.sampling_config(r)  # one turn of at most max_tokens_per_turn, as without the pool
    sampling = replace(sampling, max_tokens=min(r.max_tokens, r.max_tokens_per_turn or r.max_tokens))
    pool: CarryOverPool | RemotePool = CarryOverPool(sampling, r.partial_chunk_tokens, r.max_staleness)
    if rollout_ranks(r):  # the engines' own pools, grown while the trainers train
        pool = RemotePool(models.engine, sampling, r.partial_chunk_tokens, r.max_staleness, dp_rank,
                          leader=replica_group().rank() == 0)
    return CarriedPrompts(pool, lambda problems: rl_phases.request(models.tokenizer, problems, cfg)[0],
                          lambda i: loop.item_at(train, i),
                          lambda step: loop.indices_of_step(step, r.prompts_per_step, dp_rank, dp),
                          r.max_staleness, dp_rank, dp)


def main(argv: list[str] | None = None) -> None:
    """Compose the job named on the command line (``--config-name NAME``, default ``grpo``; ``--config-dir
    DIR`` for a job file of your own) with its overrides and run it. Exits with
    ``launchers.preemption.PREEMPTED_EXIT_CODE`` (75) when stopped by SIGUSR1/SIGTERM after saving a
    checkpoint, and with 2 after a bad input under ``megalign train`` (reported in one line by the command:
    :mod:`launchers.console`)."""
    install()  # as early as possible: a signal before this would kill the process
    try:
        name, config_dir, overrides = split_job_args(list(sys.argv[1:] if argv is None else argv))
        composed = compose_job(name, overrides, config_dir)
        os.environ[JOB_FILE_ENV] = str(composed.job_file)  # copied into the run directory (launchers/common.py)
        cfg = composed.cfg
        if cfg.trainer.quiet:  # before Megatron and vLLM are imported (launchers/console.py)
            route_third_party_output(Path(cfg.output_dir) / "logs" / f"rank{env_world()[0]}.log")
        else:
            logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="[%(asctime)s][%(name)s][%(levelname)s] "
                                "- %(message)s")
        run(cfg, composed)
    except Exception as e:
        record_error(e)  # where this rank was and why it stopped, for megalign train's report
        if report_bad_input(e):  # under `megalign train`: one line, printed once by the command
            raise SystemExit(BAD_INPUT_EXIT) from None
        raise


if __name__ == "__main__":
    main()
