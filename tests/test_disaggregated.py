"""Disaggregated placement (``rollout.placement=disaggregated``): the split is validated before
any process group starts; prompts are dealt over the engines and come back to their trainers
in order; the weight sync from trainer shards to engine ranks of their own equals vLLM's own
sharding for DP/TP/PP trainers and vLLM TP 1/2 (4 processes, no vLLM); and end to end, GRPO with
one trainer rank and one vLLM rank samples with the weights it trains (fp32: the engine's
logprobs equal the trainer's at every step, before and after a sync)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from safetensors.torch import load_file

from alignment.config import validate
from alignment.data.samples import Sample, SamplingConfig
from alignment.rollout.config import rollout_ranks
from alignment.rollout.engines.disaggregated import GENERATE, STOP, SYNC, RemoteEngine, deal, serve
from alignment.schema import ConfigError
from tests.conftest import run_torchrun
from tests.dist.tiny_llama import save_tiny_hf_dir
from tests.test_config import SMOLLM2, cfg

SPLIT = ("rollout.placement=disaggregated", "rollout.rollout_ranks=2")


def test_the_split_is_validated_before_start():
    c = cfg(*SPLIT, "parallel.tensor_model_parallel_size=3", "rollout.prompts_per_step=6")
    assert rollout_ranks(c.rollout) == 2 and rollout_ranks(cfg().rollout) == 0
    validate(c, world_size=8, hf_config=SMOLLM2)  # 6 trainers at TP 3 (DP 2) + 2 engine ranks
    validate(cfg(*SPLIT, name="ppo"), world_size=4, hf_config=SMOLLM2)
    validate(cfg(*SPLIT, "rollout.partial=true", "rollout.max_staleness=1", "algorithm.rollout_correction.is_level=token"),
             world_size=4, hf_config=SMOLLM2)
    cases = [
        ((*SPLIT,), 2, r"rollout.rollout_ranks=2: of the 2 processes started, the last rollout_ranks generate and "
                       r"the others train, so it must be in \[1, 1\]"),
        (("rollout.rollout_ranks=1",), 2, "rollout.rollout_ranks=1 only applies to rollout.placement=disaggregated"),
        (("rollout.placement=split",), 2, "rollout.placement='split': valid values are colocated, disaggregated"),
        ((*SPLIT, "rollout.backend=megatron"), 4, "set rollout.backend=vllm"),
        ((*SPLIT, "rollout.tensor_parallel_size=4"), 4, r"rollout.tensor_parallel_size=4 must divide "
                                                        r"rollout.rollout_ranks=2 .* valid: \[1, 2\]"),
        ((*SPLIT, "rollout.check_weight_sync=true"), 4, "rollout.check_weight_sync=true compares"),
        # the trainers' layout is checked over the trainer ranks only: 4 of them, TP 3 does not divide
        ((*SPLIT, "parallel.tensor_model_parallel_size=3"), 6, "tensor_model_parallel_size=3 does not divide the "
                                                                "world size 4"),
        ((*SPLIT, "rollout.prompts_per_step=4"), 5, r"rollout.prompts_per_step=4 must be a multiple of the "
                                                    r"data-parallel size 3 \(world 3 /"),
        # partial rollouts: rollout ranks of their own, a batch sampled ahead, one rank per engine, single answers
        (("rollout.partial=true", "rollout.max_staleness=1"), 2, "rollout.partial=true within a step updates the "
                                                               "engines' weights while they generate.* set rollout."
                                                               "placement=disaggregated .*partial_carry_over=true"),
        ((*SPLIT, "rollout.partial=true"), 4, "continues the batch sampled ahead under the new weights, but "
                                              r"rollout.max_staleness=0 allows none; set rollout.max_staleness=1"),
        ((*SPLIT, "rollout.partial=true", "rollout.max_staleness=1", "rollout.tensor_parallel_size=2"), 4,
         "not yet of rollout.tensor_parallel_size=2 ranks; set it to 1"),
        ((*SPLIT, "rollout.partial=true", "rollout.max_staleness=1", "rollout.environment=tools"), 4,
         "not rollout.environment=tools's episodes yet"),
        ((*SPLIT, "rollout.partial_chunk_tokens=0"), 4, r"rollout.partial_chunk_tokens=0"),
        ((*SPLIT, "rollout.partial=true", "rollout.max_staleness=1", "algorithm.rollout_correction.is_level=token",
          "algorithm.dynamic_sampling=true"), 4, "algorithm.dynamic_sampling refills a batch after it was collected"),
    ]
    for overrides, world, message in cases:
        with pytest.raises((ConfigError, ValueError), match=message):
            validate(cfg(*overrides), world_size=world, hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match="algorithm.name=sft trains on fixed data"):
        validate(cfg(*SPLIT, name="sft"), world_size=4, hf_config=SMOLLM2)


def test_prompts_are_dealt_round_robin_over_engines():
    lists = [[[1], [2], [3]], [[4]], []]  # three trainers' prompts
    assert deal(lists, 2) == [[(0, 0, [1]), (0, 2, [3])], [(0, 1, [2]), (1, 0, [4])]]
    assert deal(lists, 1) == [[(0, 0, [1]), (0, 1, [2]), (0, 2, [3]), (1, 0, [4])]]
    assert deal([[], []], 3) == [[], [], []]


class ScriptedGroup:
    """One rank's view of the stateless group: ``broadcast_object`` and ``all_gather_object``
    return the scripted values in turn (what the other ranks would have sent) and record what this
    rank sent."""

    def __init__(self, rank: int, size: int, broadcasts=(), gathers=(), flag_after: int | None = None):
        self.rank, self.size, self.sent = rank, size, []
        self.broadcasts, self.gathers = list(broadcasts), list(gathers)
        self.flag_after, self.flag_checks = flag_after, 0  # a flag seen from the flag_after-th look on

    def broadcast_object(self, obj, src):
        self.sent.append(("broadcast", obj))
        return obj if self.rank == src else self.broadcasts.pop(0)

    def raise_flag(self, name):
        self.sent.append(("flag", name))

    def flag_raised(self, name):
        self.flag_checks += 1
        self.sent.append(("look", name))
        return self.flag_after is not None and self.flag_checks >= self.flag_after

    def all_gather_object(self, obj):
        self.sent.append(("all_gather", obj))
        return self.gathers.pop(0) if self.gathers else [obj] * self.size


def test_a_reseed_reaches_the_engines_with_the_next_request():
    # trainer side: the step goes with the first request after reseed (a posted request may be
    # generating when the loop reseeds for the next step), and only with it
    sampling = SamplingConfig(n=2, temperature=1.0, max_tokens=4)
    group = ScriptedGroup(0, 2, gathers=[[[[5]], None], [None, ([(0, 0, ["s"])], (2.0, 0.5))]])
    remote = RemoteEngine(group, tokenizer=None, trainers=1)
    remote.reseed(3)
    remote.prefetch([[5]], sampling)
    assert remote.generate([[5]], sampling) == [["s"]]
    # the engine's busy and idle seconds came with its samples
    assert remote.pop_stats() == {"rollout/engine_busy_s": 2.0, "rollout/engine_idle_s": 0.5}
    assert remote.pop_stats() == {}
    remote.prefetch([[6]], sampling)
    commands = [obj for kind, obj in group.sent if kind == "broadcast"]
    assert commands == [(GENERATE, sampling, 3, 0), (GENERATE, sampling, None, 0)]

    # rollout side: the engine reseeds with the step before generating that request, not otherwise
    class Engine:
        calls = []

        def reseed(self, step):
            self.calls.append(("reseed", step))

        def generate(self, prompts, sampling):
            self.calls.append(("generate", prompts))
            return [[Sample(p, [1], [0.0], "x", True)] * sampling.n for p in prompts]

    engine = Engine()
    rank = ScriptedGroup(1, 2, broadcasts=[(GENERATE, sampling, 7, 0), (GENERATE, sampling, None, 0), (STOP,)],
                         gathers=[[[[5], [6]], None], [None, None], [[[8]], None], [None, None]])
    serve(engine, resharder=None, group=rank, trainers=1, engine_tp=1)
    assert engine.calls == [("reseed", 7), ("generate", [[5], [6]]), ("generate", [[8]])]


class ChunkEngine:
    """A rollout engine whose k-th generated token of a call, for the row ``prompt + prefix``, is
    ``100 * weights + len(prefix) + k`` with logprob ``-(that) / 1000``; ``eos`` ends a row at that
    response length. Logs every call and weight load."""

    tokenizer = None

    def __init__(self, prompt_len: int, eos_at: dict[int, int]):
        self.prompt_len, self.eos_at, self.weights, self.log = prompt_len, eos_at, 0, []

    def generate(self, prompts, sampling):
        assert sampling.n == 1
        self.log.append(("generate", [len(p) - self.prompt_len for p in prompts], sampling.max_tokens))
        out = []
        for p in prompts:
            row, done = p[0], len(p) - self.prompt_len
            ids, finished = [], False
            for k in range(sampling.max_tokens):
                ids.append(100 * self.weights + done + k)
                if done + k + 1 == self.eos_at.get(row):
                    finished = True
                    break
            out.append([Sample(list(p), ids, [-t / 1000 for t in ids], "", finished)])
        return out

    def load_resharded(self, buckets):
        self.weights += 1
        self.log.append(("load", self.weights))

    def reseed(self, step):
        self.log.append(("reseed", step))


class NoBuckets:
    def buckets(self):
        return []


def test_partial_rollout_takes_the_update_between_chunks_event_by_event():
    """rollout.partial: one trainer, one engine rank; 2 prompts x 1 sample, 6 tokens in chunks of 2. Row 1
    ends at its 3rd token; the sync flag is seen at the 2nd look (after chunk 2): the engine loads the new
    weights there, and row 0 goes on from its 4-token prefix under them, its tokens stamped 1 update."""
    sampling = SamplingConfig(n=1, temperature=1.0, max_tokens=6)
    # trainer side: the posted request is partial; the sync raises its flag before broadcasting
    trainer = ScriptedGroup(0, 2, gathers=[[[[0, 9], [1, 9]], None], [None, ([(0, 0, ["a"]), (0, 1, ["b"])], (1, 0))]])
    remote = RemoteEngine(trainer, tokenizer=None, trainers=1, partial_chunk_tokens=2)
    remote.prefetch([[0, 9], [1, 9]], sampling)
    remote.load_resharded([])
    assert remote.generate([[0, 9], [1, 9]], sampling) == [["a"], ["b"]]
    assert [e for e in trainer.sent if e[0] != "all_gather"] == [
        ("broadcast", (GENERATE, sampling, None, 2)), ("flag", "partial_sync/1"), ("broadcast", (SYNC,))]
    # rollout side
    engine = ChunkEngine(prompt_len=2, eos_at={1: 3})
    rank = ScriptedGroup(1, 2, broadcasts=[(GENERATE, sampling, None, 2), (SYNC,), (STOP,)],
                         gathers=[[[[0, 9], [1, 9]], None]], flag_after=2)
    serve(engine, NoBuckets(), rank, trainers=1, engine_tp=1)
    assert engine.log == [("generate", [0, 0], 2), ("generate", [2, 2], 2), ("load", 1), ("generate", [4], 2)]
    assert [e for e in rank.sent if e[0] == "look"] == [("look", "partial_sync/1")] * 2
    (_, (handed, (busy, idle))), = [e for e in rank.sent if e[0] == "all_gather" and e[1] is not None]
    assert busy >= 0 and idle >= 0
    (_, _, [row0]), (_, _, [row1]) = handed
    assert row0.response_ids == [0, 1, 2, 3, 104, 105] and row0.weight_updates == [0, 0, 0, 0, 1, 1]
    assert row0.logprobs == [-t / 1000 for t in row0.response_ids] and not row0.finished
    assert row1.response_ids == [0, 1, 2] and row1.weight_updates is None and row1.finished


def test_partial_rollout_waits_for_the_update_when_it_finishes_first():
    """Every row done before the flag: the engine waits for the sync before handing the batch over
    (all tokens of the posted policy); the trainers stopping instead ends the rank; a hold of 1 chunk
    (MEGALIGN_PARTIAL_HOLD_CHUNKS) takes the update after the first chunk without looking for a flag."""
    sampling = SamplingConfig(n=2, temperature=1.0, max_tokens=2)
    engine = ChunkEngine(prompt_len=1, eos_at={})
    rank = ScriptedGroup(1, 2, broadcasts=[(GENERATE, sampling, 4, 2), (SYNC,), (STOP,)], gathers=[[[[0]], None]])
    serve(engine, NoBuckets(), rank, trainers=1, engine_tp=1)
    assert engine.log == [("reseed", 4), ("generate", [0, 0], 2), ("load", 1)]
    (_, (handed, _)), = [e for e in rank.sent if e[0] == "all_gather" and e[1] is not None]
    assert [s.weight_updates for s in handed[0][2]] == [None, None]
    stopped = ScriptedGroup(1, 2, broadcasts=[(GENERATE, sampling, None, 2), (STOP,)], gathers=[[[[0]], None]])
    serve(ChunkEngine(prompt_len=1, eos_at={}), NoBuckets(), stopped, trainers=1, engine_tp=1)  # returns
    held = ChunkEngine(prompt_len=1, eos_at={})
    rank = ScriptedGroup(1, 2, broadcasts=[(GENERATE, replace(sampling, max_tokens=4), None, 2), (SYNC,), (STOP,)],
                         gathers=[[[[0]], None]])
    serve(held, NoBuckets(), rank, trainers=1, engine_tp=1, hold_chunks=1)
    assert held.log == [("generate", [0, 0], 2), ("load", 1), ("generate", [2, 2], 2)]


def test_an_engine_reports_its_busy_and_idle_seconds(monkeypatch):
    from alignment.rollout.engines import disaggregated

    ticks = iter([0.0, 1.0, 3.0, 4.0, 4.5, 10.0, 11.0])  # start; generate 1-3; load 4-4.5; split 10; split 11
    monkeypatch.setattr(disaggregated.time, "perf_counter", lambda: next(ticks))
    engine = disaggregated.TimedEngine(ChunkEngine(prompt_len=1, eos_at={}))
    engine.generate([[0]], SamplingConfig(n=1, max_tokens=1))
    engine.load_resharded([])
    assert engine.split() == (2.5, 7.5) and engine.split() == (0.0, 1.0)
    assert engine.weights == 1  # everything else reaches the engine


def test_token_staleness_counts_each_token(monkeypatch):
    from alignment.trainers import rl_phases
    from alignment.trainers.rl_phases import token_staleness

    monkeypatch.setattr(rl_phases, "all_reduce_sum", lambda values: values)  # one rank: the sums are its own
    monkeypatch.setattr(rl_phases, "all_reduce_max", lambda values: values)

    a = Sample([1], [5, 6, 7, 8], [0.0] * 4, "", True, weight_updates=[0, 0, 1, 1])
    b = Sample([1], [5, 6], [0.0] * 2, "", True, loss_mask=[1, 0])  # the environment's token does not count
    m = token_staleness([a, b], staleness=1, count=True)
    assert m == {"rollout/token_staleness": 3 / 5, "rollout/token_staleness_max": 1.0}
    assert token_staleness([a], staleness=1, count=False)["rollout/token_staleness"] == 0.0


# heavy: 4 processes on 2 cores; the disaggregated GRPO job below syncs its weights in CI
@pytest.mark.heavy(cheap="tests/test_disaggregated.py::test_grpo_with_a_trainer_rank_and_a_rollout_rank")
@pytest.mark.slow
def test_weight_sync_from_trainers_to_engine_ranks(tmp_path):
    """gqa test model: 4 layers, hidden 96, untied; 27 vLLM tensors per engine rank. The replicated
    norms (2 per layer + the final one, 96 floats each) go whole to every vLLM TP rank, the rest is split."""
    path = tmp_path / "disaggregated_reshard.json"
    run_torchrun("disaggregated_reshard_worker.py", str(path), nproc=4, timeout=600)
    cases = json.loads(path.read_text())
    assert sorted(cases) == sorted(f"tp{tp}_pp{pp}->vllm_tp{v}" for tp, pp in ((1, 1), (2, 1), (1, 2)) for v in (1, 2))
    norms = (2 * 4 + 1) * 96 * 4
    for name, c in cases.items():
        vtp = int(name[-1])
        assert c["wrong"] == 0 and c["tensors"] == [27, 27], (name, c["first_wrong"])
        assert c["trainer_tensors"] == 0 and c["engines_sent"] == 0  # trainers only send, engines only receive
        # each engine rank receives exactly its vLLM TP shard, all of it from the trainers
        assert c["received_bytes"] == [(c["model_bytes"] - norms) // vtp + norms] * 2, name
        assert sum(c["sent_bytes"]) == sum(c["received_bytes"]), name
    # DP 2: both trainers hold everything and the engine ranks take turns, one trainer each
    assert cases["tp1_pp1->vllm_tp1"]["sent_bytes"] == [cases["tp1_pp1->vllm_tp1"]["model_bytes"]] * 2


@pytest.mark.slow
def test_grpo_with_a_trainer_rank_and_a_rollout_rank(tmp_path):
    """1 trainer (Megatron, fp32) + 1 rank running the vLLM engine: prompts and samples cross
    the stateless group, the whole model crosses it after every step; the engine's logprobs of
    the sampled tokens equal the trainer's at step 1 (initial weights) and step 2 (synced
    weights); the held-out evaluation runs on the engine rank too; a resumed run syncs the loaded
    weights first, and one-step off-policy it trains on batches the engine sampled meanwhile."""
    model_dir = save_tiny_hf_dir(tmp_path / "tiny")
    out, result = tmp_path / "run", tmp_path / "result.json"
    common = ["rollout.prompts_per_step=4", "rollout.group_size=4", "trainer.micro_batch_size=4", "data.heldout_size=8",
              "data.train_size=50", "rollout.max_tokens=16", "rollout.eval_max_tokens=8", "trainer.lr=1e-3",
              "trainer.progress_bar=false", "rollout.placement=disaggregated", "rollout.rollout_ranks=1",
              "trainer.export_hf=false"]
    run_torchrun("e2e_worker.py", str(model_dir), str(out), "even_length", "trainer.steps=2", *common, str(result),
                 timeout=900)
    s = json.loads(result.read_text())
    assert s["world_size"] == 1 and len(s["memory"]) == 1  # the summary is the trainers'
    first, second = s["history"]
    assert first["kl"] == 0.0 and second["kl"] > 0.0 and first["grad_norm"] > 0.0 and 0.0 < first["reward/std"]
    model_bytes = 4 * sum(t.numel() for t in load_file(model_dir / "model.safetensors").values())
    for m in (first, second):
        assert 1.0 <= m["token_mult_prob_error"] < 1.0 + 1e-4, m
        assert 0.0 <= m["rollout_correction/kl"] < 1e-6, m
        # the whole model leaves the trainer every step (vLLM TP 1; the tied LM head is not sent twice)
        assert m["weight_sync/sent_mb"] * 2**20 == pytest.approx(model_bytes), m
    assert 0.0 <= s["heldout_accuracy_before"] <= 1.0 and 0.0 <= s["heldout_accuracy_after"] <= 1.0
    # resume from step 2 for two more steps, one-step off-policy: the engine rank starts from the
    # initial HF weights and the trainer's loaded ones reach it before the first rollout; step 3's
    # batch is posted before step 2 trains and sampled by the engine while the trainer trains
    run_torchrun("e2e_worker.py", str(model_dir), str(out), "even_length", "trainer.steps=4", *common,
                 "rollout.max_staleness=1", "algorithm.rollout_correction.is_level=token", str(result), timeout=900)
    r = json.loads(result.read_text())
    assert r["start_step"] == 2 and [m["rollout/staleness"] for m in r["history"]] == [0.0, 1.0]
    on_policy, stale = r["history"]
    assert 1.0 <= on_policy["token_mult_prob_error"] < 1.0 + 1e-4, on_policy
    # sampled by the policy one update older than the trainer's: a real gap, weighted by TIS
    assert stale["token_mult_prob_error"] > 1.0 + 1e-3 and stale["rollout_correction/kl"] > 1e-6, stale
