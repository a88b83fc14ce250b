"""Partial rollouts carried across steps (``alignment/rollout/engines/carryover.py``) with a scripted engine whose answers
have a long tail: a step takes the groups that finished, in admission order, the others keep generating under the
next version, each token keeps the version that sampled it, rows too stale restart from the prompt, and what is in
flight is what a checkpoint keeps."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
import torch

from alignment.data.samples import SamplingConfig
from alignment.rollout.engines.carried_remote import CarryServer
from alignment.rollout.engines.carryover import CarryOverPool
from alignment.trainers.rl_phases import token_staleness
from tests.conftest import SMOLLM2_EOS as EOS
from tests.scripted_engine import ScriptedEngine


def continuing(prompt: str, k: int) -> str:
    """The answer to "Say N x." is N x's: a continuation writes the ones still missing (one token each)."""
    target = int(re.search(r"Say (\d+) x\.", prompt).group(1))
    have = len(prompt) - len(prompt.rstrip("x"))
    return "x" * (target - have)


@pytest.fixture
def engine(smollm2_tokenizer):
    return ScriptedEngine(smollm2_tokenizer, continuing, routing=True)


def prompt(engine, n: int) -> list[int]:
    return engine.char_ids(f"Say {n} x.")


def test_a_step_takes_the_finished_groups_and_the_long_tail_goes_on_under_the_next_version(engine, smollm2_tokenizer,
                                                                                            monkeypatch):
    x = engine.char_ids("x")[0]
    pool = CarryOverPool(SamplingConfig(n=2, temperature=1.0, max_tokens=20), chunk_tokens=3, max_staleness=2)
    for index, n in enumerate([2, 9, 4]):  # answers of 2, 9 and 4 tokens (+ EOS)
        pool.admit(index, prompt(engine, n))
    # version 0: two groups must finish: "2" after one chunk (3 tokens: xx EOS), "4" after two (xxx, x EOS)
    assert pool.generate(engine, version=0, needed=2) == 2 and pool.ready() == [0, 2]
    taken, base = pool.take(2, smollm2_tokenizer)
    assert [g.index for g in taken] == [0, 2] and base == 0
    [a, _], [c, _] = (g.samples for g in taken)
    assert a.response_ids == [x, x, EOS] and c.response_ids == [x] * 4 + [EOS] and c.finished
    assert c.weight_updates == [0] * 5
    # the long answer keeps its 6 tokens of version 0 and goes on under version 1, with a new prompt beside it
    assert pool.in_flight() == [1] and len(pool.groups[0].rows[0].ids) == 6
    pool.admit(3, prompt(engine, 1))
    assert pool.generate(engine, version=1, needed=2) == 2 and pool.ready() == [1, 3]
    taken, base = pool.take(2, smollm2_tokenizer)
    [b, _], [d, _] = (g.samples for g in taken)
    assert base == 0 and b.response_ids == [x] * 9 + [EOS]
    assert b.weight_updates == [0] * 6 + [1] * 4 and d.weight_updates == [1, 1]
    # each token's staleness when version 1 trains this batch (version base = 0): 1 for the old tokens, 0 after
    monkeypatch.setattr("alignment.trainers.rl_phases.all_reduce_sum", lambda xs: xs)
    monkeypatch.setattr("alignment.trainers.rl_phases.all_reduce_max", lambda xs: xs)
    stale = token_staleness([b, d], staleness=1 - base, count=True)
    assert stale == {"rollout/token_staleness": 6 / 12, "rollout/token_staleness_max": 1.0}
    # R3: every position keeps the routing of the chunk (the engine call) that first routed it
    # the four engine calls: 0 routed the prompt and the first 2 tokens, 1 the next 3, 2 the next 3 (version 1), 3 the
    # next 1; the last token (EOS) never fed back
    p = len(b.prompt_ids)
    expected = torch.tensor([0] * (p + 2) + [1] * 3 + [2] * 3 + [3] * 1 + [-1], dtype=torch.int16)
    assert torch.equal(b.routed_experts[:, 0, 0], expected) and torch.equal(b.routed_experts[:, 1, 0], expected)
    assert pool.in_flight() == [] and pool.pop_counts() == {"rollout/restarted_rows": 0.0,
                                                            "rollout/in_flight_groups": 0.0}


def test_rows_too_stale_for_the_policy_about_to_train_start_again(engine, smollm2_tokenizer):
    pool = CarryOverPool(SamplingConfig(n=2, temperature=1.0, max_tokens=20), chunk_tokens=2, max_staleness=1)
    pool.admit(7, prompt(engine, 12))
    pool.admit(8, prompt(engine, 1))
    assert pool.generate(engine, version=0, needed=1) == 1 and pool.take(1, smollm2_tokenizer)[0][0].index == 8
    pool.admit(9, prompt(engine, 1))
    pool.generate(engine, version=1, needed=1)  # group 7's rows: 2 tokens of version 0, then 2 of version 1
    assert [r.updates for r in pool.groups[0].rows] == [[0, 0, 1, 1]] * 2
    pool.take(1, smollm2_tokenizer)
    # version 3 would train tokens of version 0 and 1: more than max_staleness=1 behind: both rows restart
    pool.admit(10, prompt(engine, 1))
    assert pool.restart_stale(3) == 2 and [r.ids for r in pool.groups[0].rows] == [[], []]
    assert pool.pop_counts() == {"rollout/restarted_rows": 2.0, "rollout/in_flight_groups": 2.0}
    pool.generate(engine, version=3, needed=2)
    [(i, item, [s, _]), _], base = pool.take(2, smollm2_tokenizer)
    assert i == 7 and item is None and base == 3 and s.weight_updates == [0] * 13 and len(s.response_ids) == 13


def test_the_trainers_wait_only_on_the_rows_of_the_oldest_groups_and_the_new_prompts_grow_while_they_train(
        engine, smollm2_tokenizer):
    engine.tokenizer = smollm2_tokenizer
    server = CarryServer(engine, engines=1, me=0)
    sampling = SamplingConfig(n=2, temperature=1.0, max_tokens=30)
    header = lambda version: (version, 2, sampling, 4, 1)  # noqa: E731  (needed=2 groups, chunks of 4)
    say = lambda *ns: [(i, prompt(engine, n)) for i, n in ns]  # noqa: E731
    # step 0: groups 0 (2 x's), 1 (6 x's) due; group 2 (20 x's, the next step's) waits: calls hold 0 and 1 only
    [(dp, taken, base, counts)] = server.handle(header(0), [(0, say((0, 2), (1, 6), (2, 20)))])
    assert dp == 0 and [g.index for g in taken] == [0, 1] and base == 0
    lengths = [len(prompts) for prompts, _ in engine.calls]
    assert lengths == [4, 2] and counts == {"rollout/restarted_rows": 0.0, "rollout/in_flight_groups": 1.0}
    assert [len(r.ids) for r in server.pools[0].groups[0].rows] == [0, 0]  # not grown while the trainers waited
    # while the trainers train, every live row grows: group 2's, by chunks of 4 at the version the engine holds
    assert server.busy() and server.advance() == 8 and len(engine.calls) == 3 and len(engine.calls[-1][0]) == 2
    server.version += 1  # a weight sync
    # step 1: group 3 (1 x) admitted; groups 2 and 3 are the oldest two: both grow until both are ready
    [(_, taken, base, _)] = server.handle(header(1), [(0, say((3, 1)))])
    assert [g.index for g in taken] == [2, 3] and base == 0
    assert taken[0].samples[0].weight_updates == [0] * 4 + [1] * 17 and not server.busy()


def test_what_is_refused(engine, smollm2_tokenizer):
    pool = CarryOverPool(SamplingConfig(n=2, temperature=1.0, max_tokens=8), chunk_tokens=4, max_staleness=1)
    pool.admit(0, prompt(engine, 2))
    with pytest.raises(ValueError, match="prompt 0 is in flight already"):
        pool.admit(0, prompt(engine, 2))
    with pytest.raises(ValueError, match="1 groups are in flight, 2 are needed: admit more prompts"):
        pool.generate(engine, version=0, needed=2)
    with pytest.raises(ValueError, match="0 groups are ready, 1 were asked for"):
        pool.take(1, smollm2_tokenizer)
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        CarryOverPool(SamplingConfig(n=2), chunk_tokens=0, max_staleness=1)


def test_the_loop_admits_each_steps_prompts_ahead_and_a_resume_deals_what_was_in_flight():
    from launchers.carried import CarriedPrompts
    from launchers.loop import indices_of_step

    def carried(dp_rank: int) -> CarriedPrompts:
        pool = CarryOverPool(SamplingConfig(n=2, max_tokens=8), chunk_tokens=4, max_staleness=1)
        return CarriedPrompts(pool, lambda items: [[7, i] for i in items], lambda i: 100 + i,
                              lambda step: indices_of_step(step, 4, dp_rank, 2), ahead=1, dp_rank=dp_rank, dp=2)

    rank0 = carried(0)
    rank0.start(0, 3, None)  # a fresh run of 3 steps, 4 prompts a step over 2 DP ranks
    rank0.admit_through(0)  # step 0 admits its own prompts and the next step's: positions 0-1 and 4-5
    assert rank0.pool.in_flight() == [0, 1, 4, 5] and [g.item for g in rank0.pool.groups] == [100, 101, 104, 105]
    assert rank0.pool.groups[0].prompt == [7, 100] and rank0.next == 2
    rank0.admit_through(1)
    rank0.admit_through(2)  # nothing past the last step
    assert rank0.pool.in_flight() == [0, 1, 4, 5, 8, 9] and rank0.next == 3
    # a resume at step 2 of a run that kept 5 prompts in flight: each rank admits its share again, oldest first,
    # then goes on from the saved next step
    rank1 = carried(1)
    rank1.start(2, 5, {"indices": [9, 2, 6, 7, 3], "next": 3})
    assert rank1.pool.in_flight() == [3, 7] and rank1.next == 3
    rank1.admit_through(2)
    assert rank1.pool.in_flight() == [3, 7, 14, 15]


def test_a_checkpoint_of_a_step_not_trained_keeps_the_groups_taken_for_it(monkeypatch, engine, smollm2_tokenizer):
    """A reward server failing with on_error=stop saves step s before it trains, after its groups were taken."""
    from launchers import carried as carried_module
    from launchers.carried import CarriedPrompts

    class OneRank:
        def rank(self):
            return 0

    monkeypatch.setattr(carried_module, "replica_group", OneRank)
    monkeypatch.setattr(carried_module.dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(carried_module.dist, "all_gather_object", lambda out, obj: out.__setitem__(0, obj))
    pool = CarryOverPool(SamplingConfig(n=1, temperature=1.0, max_tokens=20), chunk_tokens=4, max_staleness=1)
    lengths = [1, 9, 2, 9]  # the prompts at positions 0-3: "Say n x."
    carried = CarriedPrompts(pool, lambda items: [prompt(engine, n) for n in items], lambda i: lengths[i],
                             lambda step: range(2 * step, 2 * step + 2), ahead=1, dp_rank=0, dp=1)
    carried.start(0, 2, None)
    carried.admit_through(0)
    taken, _ = pool.step(engine, 0, 2, smollm2_tokenizer)
    carried.took(0, pool.last_taken)
    assert pool.last_taken == [0, 2] and pool.in_flight() == [1, 3]
    assert json.loads(carried.save(0)["in_flight.json"]) == {"indices": [0, 1, 2, 3], "next": 2}  # before training
    assert json.loads(carried.save(1)["in_flight.json"]) == {"indices": [1, 3], "next": 2}  # after it trained


CARRY = ("rollout.partial=true", "rollout.partial_carry_over=true", "rollout.max_staleness=1",
         "algorithm.rollout_correction.is_level=token")


def test_carried_partial_rollouts_are_validated_before_start():
    from alignment.config import validate
    from alignment.schema import ConfigError
    from tests.test_config import SMOLLM2, cfg

    validate(cfg(*CARRY, "rollout.prompts_per_step=6"), world_size=3, hf_config=SMOLLM2)  # colocated, vLLM engines of one rank
    validate(cfg(*CARRY, "parallel.tensor_model_parallel_size=3"), world_size=3, hf_config=SMOLLM2)
    validate(cfg(*CARRY, "rollout.placement=disaggregated", "rollout.rollout_ranks=1"), world_size=3,
             hf_config=SMOLLM2)  # the engines' own pools
    cases = [
        (("rollout.partial_carry_over=true",), "rollout.partial_carry_over=true carries partial rollouts across "
                                               "steps, but rollout.partial=false; set rollout.partial=true"),
        ((*CARRY[:2], "algorithm.rollout_correction.is_level=token"),
         "rollout.partial=true trains tokens sampled by older weights, but rollout.max_staleness=0 allows none"),
        ((*CARRY, "rollout.backend=megatron"), "not yet with rollout.backend=megatron; set rollout.backend=vllm"),
        ((*CARRY, "rollout.tensor_parallel_size=2"), "not yet of rollout.tensor_parallel_size=2 ranks"),
        ((*CARRY, "rollout.environment=tools", "rollout.max_turns=2"), "not rollout.environment=tools's episodes"),
        ((*CARRY, "algorithm.dynamic_sampling=true"), "algorithm.dynamic_sampling refills a batch"),
        ((*CARRY, "rollout.agent=examples.agents.react_math:run"), "max_staleness=1 are not supported with it yet"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            validate(cfg(*overrides), world_size=2, hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match="carries GRPO's single answers across steps, not algorithm.name=rft"):
        validate(cfg(*CARRY[:3], name="rft"), world_size=2, hf_config=SMOLLM2)


@pytest.mark.heavy(cheap="tests/test_carryover.py::test_a_step_takes_the_finished_groups_and_the_long_tail_goes_on_"
                         "under_the_next_version")
@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_carried_partial_rollouts_killed_and_resumed(tmp_path, placement):
    """GRPO at DP 2, colocated vLLM or 2 trainers + 1 vLLM rank whose pools grow while the trainers train, answers
    of uneven lengths (the EOS-prone tiny model, chunks of 4 tokens, 2 prompts a rank a step and the next step's
    admitted ahead): SIGKILLed as step 2 is about to train and resumed. The 4 steps train their 16 prompts once
    each, none lost or twice; the groups carried over hold tokens of an older policy, never more than
    max_staleness=1 behind, and the TIS weights per token equal the hand-computed ones from the engine's per-token
    logprobs."""
    from omegaconf import OmegaConf

    from alignment.data.tasks import load_problems
    from launchers.carried import saved_in_flight
    from tests.conftest import run_torchrun, run_torchrun_killed
    from tests.dist.tiny_llama import save_eos_prone_hf_dir
    from tests.test_staleness import COMMON, records

    model_dir = save_eos_prone_hf_dir(tmp_path / "eos_prone")
    out, killed_rec, resumed_rec, result = (tmp_path / d for d in ("run", "rec_killed", "rec_resumed", "r.json"))
    killed_rec.mkdir()
    resumed_rec.mkdir()
    carry = ["rollout.partial=true", "rollout.partial_carry_over=true", "rollout.partial_chunk_tokens=4"]
    nproc = 2
    if placement == "disaggregated":  # the third process only generates
        carry, nproc = [*carry, "rollout.placement=disaggregated", "rollout.rollout_ranks=1"], 3
    log = tmp_path / "killed.log"
    code = run_torchrun_killed("staleness_worker.py", str(model_dir), str(out), str(killed_rec), "2", *COMMON, *carry,
                               str(result), log=log, nproc=nproc)
    assert code != 0 and (killed_rec / "rank0.killed").read_text() == "2", log.read_text()[-4000:]
    # steps 0 and 1 admitted the prompts of steps 0-2 (one step ahead) and trained 8 of those 12 groups
    saved = saved_in_flight(out / "checkpoints" / "step_2")
    assert saved["next"] == 3 and len(saved["indices"]) == 4 and set(saved["indices"]) <= set(range(12))
    run_torchrun("staleness_worker.py", str(model_dir), str(out), str(resumed_rec), "-1", *COMMON, *carry,
                 str(result), timeout=900, nproc=nproc)
    s = json.loads((result).read_text())
    assert s["start_step"] == 2

    before, after = records(killed_rec), records(resumed_rec)
    assert sorted({r["step"] for r in before}) == [0, 1] and sorted({r["step"] for r in after}) == [2, 3]
    for r in before + after:
        # the TIS weights the loss used == min(pi_old / pi_engine, 2) by hand from the engine's logprobs per token
        assert r["rollout_correction/is_weight_mean"] == pytest.approx(r["hand_is_weight_mean"], rel=1e-5), r
        assert 0 <= r["token_staleness"][0] and r["token_staleness"][1] <= 1, r  # max_staleness=1
        assert len(r["questions"]) == 2  # prompts_per_step / DP groups a rank
    carried = [r for r in before + after if r["token_staleness"][1] == 1]
    assert carried  # tokens sampled by the policy before the one that trained them (disaggregated: while it trained)
    if placement == "colocated":  # answers went on under the next policy
        assert any(r["spanning_answers"] for r in carried)
    for m in s["history"]:  # the ages' histogram: tokens 0 or 1 update old, whose mean is the fraction 1 old
        ages = [m["rollout/token_staleness_hist/0"], m["rollout/token_staleness_hist/1"]]
        assert sum(ages) == pytest.approx(1.0) and m["rollout/token_staleness"] == pytest.approx(ages[1])
    # in flight after step 2: the 4 admitted again + step 3's 4 - the 4 trained; after the last step: none
    assert [m["rollout/in_flight_groups"] for m in s["history"]] == [4.0, 0.0]

    # no prompt lost or trained twice: steps 0-1 before the kill, 2-3 after (the 4 left in flight at the kill
    # admitted again) trained exactly the 4 steps' 16 prompts, and nothing is left in flight at the end
    cfg = OmegaConf.load(out / "config.yaml")
    train = load_problems(cfg.data.task, "train", cfg.data.train_size, seed=cfg.seed,
                          generator_kwargs=dict(cfg.data.generator_kwargs))
    trained = Counter(q for r in before + after for q in r["questions"])
    assert trained == Counter(p.question for p in train[:16])
    assert saved_in_flight(out / "checkpoints" / "step_4") == {"indices": [], "next": 4}
    # carried over: some rank's step trained other prompts than its own share of the step's (the synchronous loop's)
    assert any(set(r["questions"]) != {p.question for p in train[4 * r["step"] + 2 * r["rank"]:][:2]}
               for r in before + after)
