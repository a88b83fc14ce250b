"""The RL loop's schedule (launchers/loop.py): which step's batch is sampled by which policy
version for rollout.max_staleness = 0, 1, 2, from a fresh start and from a resume; the prompts of
every step; and, end to end on a tiny model under torchrun, one-step off-policy GRPO whose
importance weights use the engine's own logprobs, SIGKILLed mid-run and resumed without skipping
or repeating a prompt."""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import dataclass

import pytest

from launchers.loop import RolloutQueue, prompts_of_step
from tests.conftest import ROOT, run_torchrun, run_torchrun_killed
from tests.dist.tiny_llama import save_tiny_hf_dir


@dataclass
class FakeRollout:
    version: int
    seconds: float = 0.5
    step: int = -1


def schedule(max_staleness: int, first: int, end: int, reseeds: bool = False) -> list[tuple]:
    """Run the queue as the loop does (step s is trained by the policy of version s) and list the
    events: ("collect", step, version) and ("train", step, version of its batch); with ``reseeds``
    also ("reseed", step)."""
    events = []

    def collect(step, version):
        events.append(("collect", step, version))
        return FakeRollout(version)

    reseed = (lambda step: events.append(("reseed", step))) if reseeds else None
    queue = RolloutQueue(collect, max_staleness, first, end, reseed=reseed)
    for step in range(first, end):
        n = len(events)
        rollout, seconds = queue.pop(step, version=step)
        collected = sum(e[0] == "collect" for e in events[n:])
        assert rollout.step == step and seconds == 0.5 * collected  # the sampling done in this call
        events.append(("train", step, rollout.version))
    return events


def test_max_staleness_0_is_the_synchronous_loop():
    # each step samples its own batch with the policy it then trains: today's loop, event for event
    assert schedule(0, 0, 3) == [("collect", 0, 0), ("train", 0, 0), ("collect", 1, 1), ("train", 1, 1),
                                 ("collect", 2, 2), ("train", 2, 2)]


def test_max_staleness_1_samples_the_next_batch_before_training():
    assert schedule(1, 0, 4) == [("collect", 0, 0), ("collect", 1, 0), ("train", 0, 0),
                                 ("collect", 2, 1), ("train", 1, 0),
                                 ("collect", 3, 2), ("train", 2, 1),
                                 ("train", 3, 2)]  # nothing sampled past the last step


def test_max_staleness_2_from_a_resume_refills_the_queue_with_the_resumed_policy():
    assert schedule(2, 3, 6) == [("collect", 3, 3), ("collect", 4, 3), ("collect", 5, 3), ("train", 3, 3),
                                 ("train", 4, 3), ("train", 5, 3)]


def overlapped_schedule(max_staleness: int, first: int, end: int, reseeds: bool = False) -> list[tuple]:
    """As :func:`schedule`, with ``post`` (engines on rollout ranks of their own) and the loop's
    ``complete()`` after each step trained; ("post", step) when a batch's generation starts."""
    events = []

    def collect(step, version):
        events.append(("collect", step, version))
        return FakeRollout(version)

    reseed = (lambda step: events.append(("reseed", step))) if reseeds else None
    queue = RolloutQueue(collect, max_staleness, first, end, post=lambda step: events.append(("post", step)),
                         reseed=reseed)
    for step in range(first, end):
        rollout, _ = queue.pop(step, version=step)
        events.append(("train", step, rollout.version))
        queue.complete()
    return events


def test_posted_batches_are_sampled_while_a_step_trains():
    # max_staleness=1: step s + 1's generation starts before step s trains and is collected after it,
    # by the same policy versions as without posting
    assert overlapped_schedule(1, 0, 4) == [("collect", 0, 0), ("post", 1), ("train", 0, 0), ("collect", 1, 0),
                                            ("post", 2), ("train", 1, 0), ("collect", 2, 1),
                                            ("post", 3), ("train", 2, 1), ("collect", 3, 2),
                                            ("train", 3, 2)]
    collected = [e for e in overlapped_schedule(2, 3, 7) if e[0] != "post"]
    plain = schedule(2, 3, 7)
    assert sorted(e for e in collected if e[0] == "collect") == sorted(e for e in plain if e[0] == "collect")
    assert [e for e in collected if e[0] == "train"] == [e for e in plain if e[0] == "train"]
    # max_staleness=0 keeps nothing ahead: nothing to post
    assert overlapped_schedule(0, 0, 2) == schedule(0, 0, 2)
    queue = RolloutQueue(lambda step, version: FakeRollout(version), 1, 0, 4, post=lambda step: None)
    queue.pop(0, 0)
    with pytest.raises(RuntimeError, match="the batch of step 1 was posted but never completed"):
        queue.pop(1, 1)


def test_every_step_reseeds_its_engines_once_as_its_generation_starts():
    # the engines' stream is the step's own (RolloutEngine.reseed), whether it is collected now or
    # posted and collected after a step trained, and from a resume as from the start
    for events in (schedule(0, 0, 3, True), schedule(1, 0, 4, True), schedule(2, 3, 6, True),
                   overlapped_schedule(1, 0, 4, True), overlapped_schedule(2, 3, 7, True)):
        starts = [(i, e[1]) for i, e in enumerate(events) if e[0] in ("collect", "post")]
        posted = {e[1] for e in events if e[0] == "post"}
        first_starts = [(i, step) for i, step in starts if step not in posted or events[i][0] == "post"]
        assert [e for e in events if e[0] == "reseed"] == [("reseed", step) for _, step in first_starts]
        assert all(events[i - 1] == ("reseed", step) for i, step in first_starts)
    assert [e for e in schedule(1, 0, 3, True) if e[0] != "reseed"] == schedule(1, 0, 3)
    assert overlapped_schedule(1, 0, 3, True)[:4] == [("reseed", 0), ("collect", 0, 0), ("reseed", 1), ("post", 1)]


def test_queue_refuses_a_step_out_of_order():
    queue = RolloutQueue(lambda step, version: FakeRollout(version), 1, 0, 4)
    queue.pop(0, 0)
    with pytest.raises(RuntimeError, match="step 2 got the batch of step 1"):
        queue.pop(2, 2)


def test_prompts_of_step_deal_consecutive_items_over_dp_ranks():
    items = list(range(10))
    assert prompts_of_step(items, 0, 4, 0, 2) == [0, 1] and prompts_of_step(items, 0, 4, 1, 2) == [2, 3]
    assert prompts_of_step(items, 2, 4, 0, 2) == [8, 9] and prompts_of_step(items, 2, 4, 1, 2) == [0, 1]  # wraps
    assert prompts_of_step(items, 1, 4, 0, 1) == [4, 5, 6, 7]


COMMON = ["rollout.prompts_per_step=4", "rollout.group_size=4", "trainer.micro_batch_size=2", "data.heldout_size=8",
          "data.train_size=50", "rollout.max_tokens=16", "rollout.eval_max_tokens=8", "trainer.lr=1e-3",
          "trainer.progress_bar=false", "trainer.eval_before=false", "trainer.steps=4", "trainer.save_every=1",
          "rollout.max_staleness=1", "algorithm.rollout_correction.is_level=token", "trainer.keep_last=2"]


def records(path) -> list[dict]:
    """Both ranks' records, one per (rank, step) in file order."""
    out = []
    for rank in (0, 1):
        f = path / f"rank{rank}.jsonl"
        out += [{**json.loads(line), "rank": rank} for line in f.read_text().splitlines()] if f.exists() else []
    return out


# partial rollouts: 1 trainer + 1 vLLM rank; the engine takes each update after its first chunk of 4 tokens
PARTIAL = ["rollout.placement=disaggregated", "rollout.rollout_ranks=1", "rollout.partial=true",
           "rollout.partial_chunk_tokens=4"]


@pytest.mark.heavy(
    cheap="tests/test_staleness.py::test_max_staleness_2_from_a_resume_refills_the_queue_with_the_resumed_policy")
@pytest.mark.parametrize("mode", ["colocated", "partial"])
def test_one_step_off_policy_grpo_killed_and_resumed(tmp_path, monkeypatch, mode):
    """One-step off-policy GRPO (colocated), and with partial rollouts (the batch posted ahead is continued
    under the new weights after its first chunk, so every longer answer spans an update): SIGKILLed as a
    step is about to train and resumed, no prompt lost or repeated, the TIS weights per token equal the
    hand-computed ones from the engine's per-token logprobs (of either policy)."""
    extra = PARTIAL if mode == "partial" else []
    monkeypatch.setenv("MEGALIGN_PARTIAL_HOLD_CHUNKS", "1" if mode == "partial" else "0")
    model_dir = save_tiny_hf_dir(tmp_path / "tiny")
    out, killed_rec, resumed_rec, result = (tmp_path / d for d in ("run", "rec_killed", "rec_resumed", "r.json"))
    killed_rec.mkdir()
    resumed_rec.mkdir()
    # 1. SIGKILL every rank as step 2 is about to train (step 1 checkpointed as step_2; the batch of
    #    step 3 already sampled ahead and lost with the process)
    log = tmp_path / "killed.log"
    code = run_torchrun_killed("staleness_worker.py", str(model_dir), str(out), str(killed_rec), "2", *COMMON,
                               *extra, str(result), log=log)
    assert code != 0 and (killed_rec / "rank0.killed").read_text() == "2", log.read_text()[-4000:]
    assert not result.exists()
    steps = lambda: sorted(d.name for d in (out / "checkpoints").iterdir())  # noqa: E731
    assert steps() == ["step_1", "step_2"]  # trainer.keep_last=2: both still kept
    # 2. the same command, no kill: resumes from step_2
    run_torchrun("staleness_worker.py", str(model_dir), str(out), str(resumed_rec), "-1", *COMMON, *extra,
                 str(result), timeout=900)
    s = json.loads(result.read_text())
    assert s["start_step"] == 2 and [m["rollout/staleness"] for m in s["history"]] == [0.0, 1.0]
    assert steps() == ["step_3", "step_4"]  # the two newest: older ones went once newer ones were complete

    before, after = records(killed_rec), records(resumed_rec)
    assert sorted({r["step"] for r in before}) == [0, 1] and sorted({r["step"] for r in after}) == [2, 3]
    # the batch of step s was sampled by the policy after max(s - 1, start) updates
    for r in before + after:
        start = 0 if r in before else 2
        assert r["version"] == max(r["step"] - 1, start), r
        # the TIS weights the loss used == min(pi_old / pi_engine, 2) computed by hand from the
        # logprobs the engine returned with each sample
        assert r["rollout_correction/is_weight_mean"] == pytest.approx(r["hand_is_weight_mean"], rel=1e-5), r
        if r["step"] == r["version"]:  # on-policy: fp32 engine = trainer
            assert r["token_mult_prob_error"] < 1.0 + 1e-4 and r["hand_is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
            assert r["token_staleness"] == [0, 0], r
        else:  # sampled one update ago: the weights correct a real gap
            assert r["token_mult_prob_error"] > 1.0 + 1e-4 and r["rollout_correction/kl"] > 1e-6, r
            if mode == "partial":  # the first chunk by the posted policy, the rest by the trained one
                assert r["token_staleness"] == [0, 1] and r["spanning_answers"] > 0, r
                assert r["token_mult_prob_error"] < r["stale_prob_error"], r  # the fresh tokens agree
            else:
                assert r["token_staleness"] == [1, 1] and r["token_mult_prob_error"] > 1.0 + 1e-3, r

    # no prompt skipped or repeated: the lineage of the resumed run (steps 0-1 before the kill,
    # 2-3 after) trained exactly the train set's items 0..15, step s on items 4s..4s+3
    from omegaconf import OmegaConf

    from alignment.data.tasks import load_problems

    cfg = OmegaConf.load(out / "config.yaml")
    train = load_problems(cfg.data.task, "train", cfg.data.train_size, seed=cfg.seed,
                          generator_kwargs=dict(cfg.data.generator_kwargs))
    for step in range(4):
        trained = Counter(q for r in before + after if r["step"] == step for q in r["questions"])
        assert trained == Counter(p.question for p in train[4 * step : 4 * step + 4]), step


def test_bench_pipeline_model_by_hand():
    sys.path.insert(0, str(ROOT / "bench"))
    from async_rl import pipeline_model

    m = pipeline_model({"rollout": 6.0, "logprobs": 1.0, "train": 3.0, "weight_sync": 0.5}, 0.5)
    assert m["colocated, synchronous"] == 10.5
    assert m["disaggregated 1-off, compute-bound generation, f=0.50"] == 12.5  # max(6 / 0.5, 4 / 0.5) + 0.5
    assert m["disaggregated 1-off, compute-bound generation, best f=0.60"] == pytest.approx(10.5)  # = colocated
    assert m["disaggregated 1-off, memory-bound decode, f=0.50"] == 8.5  # max(6, 4 / 0.5) + 0.5
    assert m["disaggregated 1-off, memory-bound decode, best f"] == 6.5  # max(6, 4) + 0.5
