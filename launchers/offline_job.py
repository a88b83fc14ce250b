"""SFT, reward-model, DPO and process-reward-model jobs (``algorithm.name`` = sft | rm | dpo | prm),
run by ``launchers/train.py`` with ``--config-name sft|rm|dpo|prm``.

config -> validate -> groups -> tokenise the dataset -> build the model (LM, or scalar-head
reward model) and, for the DPO family, a frozen reference -> :mod:`launchers.loop`, whose
``collect`` takes each step's global batch of the shuffled dataset (a fresh shuffle per epoch, the
same on every rank) and whose evaluation is the held-out loss and metrics of the objective.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch

from alignment.config import JobConfig
from alignment.algorithms import registry
from alignment.data.examples import tokenize_split
from alignment.data.images import ImageInputs
from alignment.models.families import text_config
from alignment.trainers import offline
from alignment.training.batching import MicroBatching
from alignment.training.dp_balance import global_batch_share
from alignment.trainers.interfaces import JobSpec
from launchers import loop
from launchers.build import build_models
from launchers.common import start
from launchers.input_checks import image_processor
from parallel.state import replica_group


def make_objective(cfg, vocab_size: int):
    """The loss function object for ``cfg.algorithm``: its trainer's ``objective(cfg, vocab_size)``
    (:mod:`alignment.algorithms.registry`: :mod:`alignment.trainers.sft` / ``reward_model`` / ``dpo`` / ``process_reward``)."""
    return registry.get(cfg.algorithm.name).trainer_module().objective(cfg, vocab_size)


def export_config(cfg, hf_config, tokenizer, bridge):
    """The HF config written with the export: a sequence classifier (``score`` head, the family's
    ``*ForSequenceClassification``) for a reward model."""
    if not registry.of(cfg).scalar_head:
        return hf_config
    out = type(hf_config).from_dict(hf_config.to_dict())
    out.architectures = [bridge.hf_architecture]
    out.num_labels = 1
    # HF pools at the last token that is not ``pad_token_id``; our score is read at the real
    # last token, which is the EOS. So the exported pad id must not be the EOS (SmolLM2 pads
    # with <|im_end|>): use the tokenizer's pad, else its unk, else id 0, whichever is not EOS.
    candidates = [tokenizer.pad_token_id, tokenizer.unk_token_id, 0]
    out.pad_token_id = next(c for c in candidates if c is not None and c != tokenizer.eos_token_id)
    return out


@dataclass
class StepBatch:
    """One step's batch on this DP rank: the padded tensors (``batch``), the DP token imbalance of
    the global batch's split (:func:`alignment.training.dp_balance.global_batch_share`), the
    passes over the data so far (``epoch``), the seconds it took (``seconds``) and the loop's ``step``."""

    batch: dict
    imbalance: float
    epoch: float
    seconds: float = 0.0
    step: int = -1


class HeldoutLoss:
    """An offline job's :class:`alignment.trainers.interfaces.Evaluation`: the objective's loss and metrics on this
    DP rank's held-out batches (``evaluate()``: the global metrics; collective), ``examples`` of
    them in all, and ``train_size`` training examples (for the summary)."""

    def __init__(self, job, evaluate, examples: int, train_size: int):
        self.job, self.evaluate, self.examples, self.train_size = job, evaluate, examples, train_size
        self.first = None

    def baseline(self) -> None:
        pass

    def before(self, step: int) -> dict[str, float]:  # noqa: ARG002 - logged at the start step
        self.first = self.evaluate()
        if self.job.rank == 0:
            print(f"held-out before ({self.examples} examples): {json.dumps(self.first)}", flush=True)
        return {f"heldout/{k}": v for k, v in self.first.items()}

    def beside_first_step(self) -> None:  # nothing deferred
        return None

    def measure(self, step: int) -> dict[str, float]:  # noqa: ARG002 - the metrics carry no step
        return {f"heldout/{k}": v for k, v in self.evaluate().items()}

    def final(self) -> tuple[dict[str, float], dict, str]:
        after = self.evaluate()
        summary = {"heldout_before": self.first, "heldout_after": after, "heldout_size": self.examples,
                   "train_size": self.train_size}
        return {f"heldout/{k}": v for k, v in after.items()}, summary, f"held-out after: {json.dumps(after)}"


def run(cfg: JobConfig, composed=None) -> dict:
    """Run an SFT / RM / DPO / PRM job through :mod:`launchers.loop`; returns the summary written
    to ``<output_dir>/summary.json``.

    Raises:
        ValueError: fewer held-out examples than data-parallel ranks, or a global batch larger
            than the training set.
    """
    from megatron.core import parallel_state as ps

    job = start(cfg, composed)  # validates the config before any process group starts
    objective = make_objective(cfg, text_config(job.hf_config).vocab_size)
    models = build_models(cfg, job, ["policy", *(["reference"] if objective.needs_reference else [])],
                          value_policy=objective.value_head)
    tok = models.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    images = image_processor(job.hf_dir, job.hf_config)  # None for a text model
    train, heldout = (tokenize_split(cfg.data, cfg.algorithm, tok, split, images) for split in ("train", "heldout"))
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mbs = cfg.trainer.micro_batch_size
    rows_per_mb = MicroBatching.from_trainer(cfg.trainer, objective.rows_per_example)

    def batch_of(examples) -> dict:
        rows = [r for e in examples for r in e]
        batch = offline.build_batch([r[:2] for r in rows], pad, models, objective, rows_per_mb,
                                    [r[2] if len(r) > 2 and isinstance(r[2], ImageInputs) else None for r in rows])
        if hasattr(objective, "add_targets"):  # the PRM's step labels, KTO's desirability
            objective.add_targets(batch, rows)
        return batch

    if len(heldout) < dp:  # the PRM keeps only the solutions with a labelled step
        raise ValueError(f"{len(heldout)} held-out examples for {dp} data-parallel ranks: data.dataset={cfg.data.dataset}"
                         f" needs at least {dp} (with a labelled step within data.max_length for the PRM)")
    mine = heldout[: len(heldout) // dp * dp][dp_rank::dp]
    heldout_batches = [batch_of(mine[i : i + mbs]) for i in range(0, len(mine), mbs)]

    gbs = cfg.trainer.global_batch_size
    steps_per_epoch = len(train) // gbs
    if steps_per_epoch == 0:
        raise ValueError(f"trainer.global_batch_size={gbs} exceeds the {len(train)} training examples")
    total = steps_per_epoch * cfg.trainer.epochs
    total = min(total, cfg.trainer.steps) if cfg.trainer.steps else total

    def items(step: int) -> list[int]:  # the step's global batch: a fresh shuffle per epoch, the same on every rank
        epoch, k = divmod(step, steps_per_epoch)
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.seed + epoch)).tolist()
        return order[k * gbs : (k + 1) * gbs]

    def collect(step_idx: list[int], step: int, version: int) -> StepBatch:  # noqa: ARG001 - the loop's signature
        t0 = time.perf_counter()
        share, imbalance = global_batch_share([sum(len(r[0]) for r in train[i]) for i in step_idx], dp, dp_rank,
                                             cfg.trainer.balance_batch)
        batch = batch_of([train[step_idx[j]] for j in share])
        return StepBatch(batch, imbalance, (step + 1) / steps_per_epoch, time.perf_counter() - t0)

    def train_step(b: StepBatch) -> tuple[dict, dict]:
        t0 = time.perf_counter()
        metrics = offline.train_step(models, objective, b.batch, rows_per_mb)
        leader = replica_group().rank() == 0
        real = b.batch["input_ids"] != pad
        tokens, rows = offline.all_reduce_sum([float(real.sum()) if leader else 0.0,
                                              float(real.any(-1).sum()) if leader else 0.0], None)
        metrics.update(tokens=tokens, seq_length=tokens / rows, dp_token_imbalance=b.imbalance, epoch=b.epoch)
        return metrics, {"train": time.perf_counter() - t0}

    evaluation = HeldoutLoss(job, lambda: offline.evaluate(models, objective, heldout_batches, rows_per_mb),
                             len(mine) * dp, len(train))
    spec = JobSpec(cfg.algorithm.name, train, collect, train_step, {"policy": (models.policy, models.optimizer)},
                        evaluation, items=items, steps=total, log_prefix="train/",
                        postfix={"loss": ("loss", ".4f")},
                        hf_config=export_config(cfg, job.hf_config, tok, models.bridge),
                        export_adapters=not objective.value_head)  # a reward model's adapters need its new head
    return loop.run(job, models, spec)
