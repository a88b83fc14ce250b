"""Two GRPO steps of the real pipeline (Hydra config -> Megatron policy/reference ->
vLLM rollouts -> training -> in-memory weight sync -> checkpoints) on a tiny random
Llama under torchrun with 2 processes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import Job, run_jobs, run_torchrun
from tests.dist.tiny_llama import save_eos_prone_hf_dir, save_tiny_hf_dir

pytestmark = pytest.mark.slow  # launches processes: the full suite only (CONTRIBUTING.md, test tiers)


COMMON = ["rollout.prompts_per_step=4", "rollout.group_size=4", "trainer.micro_batch_size=2", "data.heldout_size=8",
          "data.train_size=50", "rollout.max_tokens=16", "rollout.eval_max_tokens=8", "trainer.lr=1e-3",
          "trainer.progress_bar=false"]


def test_two_grpo_steps_tiny_model(tmp_path):
    model_dir = save_tiny_hf_dir(tmp_path / "tiny")
    out = tmp_path / "run"
    # in one launch: two steps, then the resume of this test's second part, then the first step again with the
    # base model evaluated before it rather than beside it
    first_run = ["rollout.check_weight_sync=true", "algorithm.clip_ratio_c=3.0", "trainer.save_heldout_answers=true"]
    s, resumed, before = run_jobs(
        Job("grpo", model_dir, out, ["trainer.steps=2", *COMMON, *first_run], reward="even_length"),
        # Same output dir, one more step: the run resumes from step 2 (model, Adam state, step), with
        # idle models offloaded between phases (forced on CPU: the same copies as on GPU), and ONE vLLM
        # engine with tensor_parallel_size=2 across both ranks (external_launcher): each rank gets its
        # vLLM TP shard from the resharder; the two DP ranks' prompts are generated together; dynamic
        # sampling keeps both ranks in step; sequences are re-dealt over the DP ranks by token count
        # (balance_batch) and trained packed; the policy loss is now GSPO's (a config switch on resume).
        Job("grpo", model_dir, out, ["trainer.steps=3", *COMMON, "trainer.offload=true", "rollout.tensor_parallel_size=2",
                                     "rollout.check_weight_sync=true", "algorithm.dynamic_sampling=true",
                                     "trainer.sequence_packing=true", "trainer.balance_batch=true",
                                     "algorithm.policy_loss=gspo"],
            reward="even_length", env={"MEGALIGN_OFFLOAD_ON_CPU": "1"}, result=tmp_path / "resumed.json"),
        Job("grpo", model_dir, tmp_path / "before", ["trainer.steps=1", *COMMON, *first_run, "trainer.export_hf=false",
                                                      "trainer.eval_before_overlap=false"], reward="even_length"))
    first, second = s["history"]
    for m in (first, second):  # DP=2, TP=1: every rank rewrites its own full shard, nothing moves;
        # the check probed all 26 engine parameters (embedding, final norm, 6 per layer; LM head tied)
        assert m["weight_sync/sent_mb"] == 0.0 and m["weight_sync/checked"] == 26.0, m
    assert first["kl"] == 0.0 and first["grad_norm"] > 0.0 and 0.0 < first["reward/std"]
    assert second["kl"] > 0.0  # the policy moved away from the reference
    # vLLM sampled step 2 with the weights trained in step 1: its logprobs must match the trainer's
    for m in (first, second):
        assert 1.0 <= m["token_mult_prob_error"] < 1.0 + 1e-4, m
        assert all(m[f"time/{k}"] > 0 for k in ("rollout", "logprobs", "train", "weight_sync"))
        # the mismatch metrics are logged with the correction off: fp32 engine = trainer, so no gap
        assert 0.0 <= m["rollout_correction/kl"] < 1e-6 and 1.0 - 1e-4 < m["rollout_correction/ratio_max"] < 1.0 + 1e-4
        assert m["rollout_correction/is_weight_mean"] == 1.0 and m["rollout_correction/masked_fraction"] == 0.0
    # outputs: config, TensorBoard events, Megatron checkpoint, HF export that transformers loads
    assert (out / "config.yaml").exists() and list((out / "tensorboard").glob("events.*"))
    assert (out / "checkpoints" / "step_2" / "metadata.json").exists()
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(out / "hf").state_dict()
    from tests.export_check import check_export

    check_export(out / "hf", model_dir)  # the tokenizer's files are the model's, not vLLM's cached wrapper's
    initial = load_file(model_dir / "model.safetensors")
    moved = max((exported[k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-4  # trained weights were exported, not the initial ones
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(out / "tensorboard"))
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    for tag in ("reward/mean", "reward/std", "heldout/accuracy", "kl", "entropy", "clip_fraction",
                "response_length", "token_mult_prob_error", "tokens_per_s", "time/rollout", "time/weight_sync",
                "time/logprobs", "time/train"):
        assert tag in tags, tag
    assert torch.isfinite(torch.tensor(first["entropy"]))
    # the held-out accuracy counted again from the graded answers the job saved: each of the 8 problems
    # once, each answer right exactly when its length is even (the even_length grader), their mean the
    # accuracy the job logged before and after training
    for when, logged in (("step_0", s["heldout_accuracy_before"]), ("final", s["heldout_accuracy_after"])):
        answers = [json.loads(line) for line in (out / "heldout" / f"{when}.jsonl").read_text().splitlines()]
        assert len(answers) == 8 and all(a["question"] and a["answer"] for a in answers), when
        assert all(a["right"] == (len(a["response"]) % 2 == 0) for a in answers), when
        assert sum(a["right"] for a in answers) / 8 == logged, (when, logged)

    # the base model's accuracy measured on the engine while step 1 trained (trainer.eval_before_overlap) is
    # the one measured before step 1, and step 1 trained on the same samples (sampled before the evaluation)
    assert s["heldout_before_overlapped"] and not before["heldout_before_overlapped"]
    assert s["heldout_accuracy_before"] == before["heldout_accuracy_before"]
    for key in ("reward/mean", "reward/std", "loss/policy", "grad_norm", "entropy", "response_length", "token_mult_prob_error"):
        assert first[key] == before["history"][0][key], (key, first[key], before["history"][0][key])
    assert resumed["start_step"] == 2 and len(resumed["history"]) == 1
    assert (out / "checkpoints" / "step_3" / "metadata.json").exists()
    m = resumed["history"][0]
    assert 1.0 <= m["token_mult_prob_error"] < 1.0 + 1e-4  # engine got the resumed (and reloaded) weights
    assert m["offload/gb_moved"] > 0 and m["offload/seconds"] > 0
    assert m["weight_sync/checked"] == 26.0  # every parameter of this rank's vLLM TP shard verified


def test_the_mean_reward_of_a_learnable_task_rises(tmp_path):
    """GRPO learns: on a tiny model that ends its answers after a varying number of tokens
    (tests/dist/tiny_llama.py's ``save_eos_prone_hf_dir``), with the ``length`` reward alone
    (``-response_tokens / rollout.max_tokens``), 8 steps at lr 1e-5 make the answers shorter: the
    mean reward of the last three steps is well above the first two's (measured: -0.375, -0.316
    -> -0.062, -0.066, -0.070), and the policy moved away from the reference as it rose."""
    model_dir = save_eos_prone_hf_dir(tmp_path / "eos_prone")
    out, result = tmp_path / "run", tmp_path / "run.json"
    run_torchrun("e2e_worker.py", str(model_dir), str(out), "task", "trainer.steps=8", "rollout.prompts_per_step=4",
                 "rollout.group_size=4", "trainer.micro_batch_size=4", "data.heldout_size=4", "data.train_size=60",
                 "rollout.max_tokens=16", "rollout.eval_max_tokens=8", "trainer.lr=1e-5", "trainer.progress_bar=false",
                 "trainer.eval_before=false", "trainer.save_checkpoint=false", "trainer.export_hf=false",
                 "reward.functions=[{name: length}]", str(result))
    history = json.loads(result.read_text())["history"]
    rewards = [h["reward/mean"] for h in history]
    assert len(rewards) == 8 and rewards[0] < -0.2 and history[0]["reward/std"] > 0.1, rewards
    first, last = sum(rewards[:2]) / 2, sum(rewards[-3:]) / 3
    assert last > first + 0.15, rewards
    for h in history:  # the reward is the length, token for token
        assert h["reward/mean"] == pytest.approx(-h["response_length"] / 16, abs=1e-6), h
    assert history[0]["kl"] == 0.0 and min(h["kl"] for h in history[-3:]) > 0.5, [h["kl"] for h in history]


@pytest.mark.heavy(cheap="tests/test_agent_e2e.py::test_grpo_trains_on_an_openai_client_agents_episodes")
def test_megatron_backend_samples_with_the_trained_policy(tmp_path):
    """``rollout.backend=megatron``: Megatron-Core's inference engine generates on the policy's own
    model (DP=2, then TP=2; no vLLM engine, no resharder, nothing synced), with idle models offloaded between
    phases (forced on CPU) and the KV cache freed after each rollout; REINFORCE++-baseline
    advantages whitened over the valid tokens of both ranks' batch. In fp32 the trainer's
    logprobs of the sampled tokens equal the engine's (KV-cache decode against a full forward) at
    both steps: the second step sampled with the weights the first one trained."""
    model_dir = save_tiny_hf_dir(tmp_path / "tiny")
    out, result = tmp_path / "run", tmp_path / "result.json"
    run_torchrun("e2e_worker.py", str(model_dir), str(out), "even_length", "trainer.steps=2",
                 "rollout.prompts_per_step=4", "rollout.group_size=4", "trainer.micro_batch_size=2",
                 "data.heldout_size=8", "data.train_size=50", "rollout.max_tokens=16", "rollout.eval_max_tokens=8",
                 "trainer.lr=1e-3", "trainer.progress_bar=false", "rollout.backend=megatron", "trainer.offload=true",
                 "trainer.export_hf=false", "trainer.save_checkpoint=false",
                 "algorithm.advantage_estimator=reinforce_plus_plus_baseline", "algorithm.whiten_level=token",
                 str(result), timeout=900,
                 env={"MEGALIGN_OFFLOAD_ON_CPU": "1"})
    s = json.loads(result.read_text())
    first, second = s["history"]
    assert first["kl"] == 0.0 and second["kl"] > 0.0 and first["grad_norm"] > 0.0 and 0.0 < first["reward/std"]
    for m in (first, second):
        assert 1.0 <= m["token_mult_prob_error"] < 1.0 + 1e-4, m
        assert 0.0 <= m["rollout_correction/kl"] < 1e-6, m
        assert not any(k.startswith("weight_sync/") for k in m), m  # no copy of the weights to update
        assert m["offload/gb_moved"] > 0 and m["response_length"] > 0
    assert 0.0 <= s["heldout_accuracy_before"] <= 1.0 and 0.0 <= s["heldout_accuracy_after"] <= 1.0
    # TP=2: both ranks run every prompt through their halves together (megatron-core gathers the
    # vocabulary-parallel logits) and draw the same tokens from one seed per replica; the
    # trainer's TP=2 logprobs of those tokens equal the engine's, at both steps
    tp_out, tp_result = tmp_path / "run_tp2", tmp_path / "result_tp2.json"
    run_torchrun("e2e_worker.py", str(model_dir), str(tp_out), "even_length", "trainer.steps=2",
                 "rollout.prompts_per_step=4", "rollout.group_size=4", "trainer.micro_batch_size=4",
                 "data.heldout_size=8", "data.train_size=50", "rollout.max_tokens=16", "rollout.eval_max_tokens=8",
                 "trainer.lr=1e-3", "trainer.progress_bar=false", "rollout.backend=megatron",
                 "parallel.tensor_model_parallel_size=2", "trainer.export_hf=false", "trainer.save_checkpoint=false",
                 str(tp_result), timeout=900)
    t = json.loads(tp_result.read_text())
    for m in t["history"]:
        assert 1.0 <= m["token_mult_prob_error"] < 1.0 + 1e-4, m
        assert m["grad_norm"] > 0.0 and m["response_length"] > 0
    assert t["history"][1]["kl"] > 0.0
    assert 0.0 <= t["heldout_accuracy_before"] <= 1.0


@pytest.mark.heavy(cheap="tests/test_grpo_e2e.py::test_two_grpo_steps_tiny_model")
def test_variant_rloo_dr_grpo_aggregation_clip_higher_without_reference(tmp_path):
    """The critic-free variants run through the same pipeline: RLOO advantages, Dr.GRPO's
    constant-length normalisation, CISPO's loss with a clip-higher bound, dynamic sampling and
    overlong shaping, two epochs of two mini-batches, kl_coef=0 (no reference model), and the
    rollout correction on (token-level truncated IS and a geometric mask); trained with TP=2, so
    the weight sync reshards across ranks into each rank's TP=1 engine. The reward is composite:
    the grader, a reward model's whitened score (a tiny model with a new scalar head, at TP=2) and
    a length penalty, plus the overlong shaping."""
    model_dir = save_tiny_hf_dir(tmp_path / "tiny")
    out, result = tmp_path / "run", tmp_path / "result.json"
    run_torchrun("e2e_worker.py", str(model_dir), str(out), "even_length", "trainer.steps=2",
                 "rollout.prompts_per_step=4", "rollout.group_size=4", "trainer.micro_batch_size=4",
                 "data.heldout_size=8", "data.train_size=50", "rollout.max_tokens=16", "rollout.eval_max_tokens=8",
                 "trainer.lr=1e-3", "trainer.progress_bar=false", "algorithm.advantage_estimator=rloo",
                 "algorithm.loss_agg_mode=seq-mean-token-sum-norm", "algorithm.clip_ratio_high=0.28",
                 "algorithm.kl_coef=0.0", "algorithm.dynamic_sampling=true", "algorithm.overlong_buffer_len=8",
                 "algorithm.ppo_epochs=2", "algorithm.num_mini_batches=2", "parallel.tensor_model_parallel_size=2",
                 "algorithm.policy_loss=cispo", "algorithm.rollout_correction.is_level=token",
                 "algorithm.rollout_correction.mask_level=geometric", f"model.reward_model_path={model_dir}",
                 "reward.functions=[{name: correctness}, {name: reward_model, weight: 0.5, whiten: true}, "
                 "{name: length, weight: 0.1}]", str(result), timeout=900)
    first, second = json.loads(result.read_text())["history"]
    for m in (first, second):  # each term logged; the whitened one has mean 0 over the global batch
        assert -1.0 <= m["reward/length"] < 0.0 and -1.0 <= m["reward/overlong"] <= 0.0 and m["reward/reward_model"]
        expected = m["reward/correctness"] + 0.1 * m["reward/length"] + m["reward/overlong"]
        assert abs(m["reward/mean"] - expected) < 1e-5, m
    # TP=2 training, a TP=1 engine on each rank: each rank receives the other half of every split tensor
    assert first["weight_sync/sent_mb"] > 0.0 and first["weight_sync/peak_staged_mb"] > 0.0
    assert first["grad_norm"] > 0.0 and second["grad_norm"] > 0.0
    assert first["kl"] == 0.0 and second["kl"] == 0.0  # no KL term without a reference model
    for m in (first, second):
        # old_logprobs come from the trainer before the first update: they match the engine's
        assert 1.0 <= m["token_mult_prob_error"] < 1.0 + 1e-4, m
        assert m["clip_fraction"] > 0.0  # later updates move the ratio away from 1: CISPO caps the weight
        # the old logprobs are the trainer's, computed before the first update: fp32 = the engine's,
        # so every importance weight is 1 (up to rounding) and nothing is masked
        assert abs(m["rollout_correction/is_weight_mean"] - 1.0) < 1e-4 and m["rollout_correction/masked_fraction"] == 0
        assert 1 <= m["dynamic_sampling/rounds"] <= 3 and m["dynamic_sampling/filled_groups"] >= 0


@pytest.mark.heavy(cheap="tests/test_context_parallel.py::test_layout_equals_single_process_unpacked_model")
def test_context_parallel_ring_and_ulysses_with_packing(tmp_path):
    """The GRPO job with every sequence split over 2 ranks: ring attention (CP=2) with packed
    token-budget micro-batches, then Ulysses (CP=2, all-to-all) with packing. The trainer's
    logprobs of the sampled tokens equal vLLM's (token_mult_prob_error ~ 1): the whole
    CP + packing path computes the same model as the engine."""
    model_dir = save_tiny_hf_dir(tmp_path / "tiny")
    common = ["trainer.steps=2", "rollout.prompts_per_step=4", "rollout.group_size=4", "trainer.micro_batch_size=4",
              "data.heldout_size=8", "data.train_size=50", "rollout.max_tokens=16", "rollout.eval_max_tokens=8",
              "trainer.lr=1e-3", "trainer.progress_bar=false", "parallel.context_parallel_size=2",
              "trainer.sequence_packing=true", "trainer.export_hf=false"]
    before = {}
    variants = (("ring", ["parallel.cp_comm_type=p2p", "trainer.max_tokens_per_microbatch=512",
                          "rollout.max_model_len=512"]),
                ("ulysses", ["parallel.cp_comm_type=a2a"]))
    summaries = run_jobs(*(Job("grpo", model_dir, tmp_path / name, [*common, *extra], reward="even_length")
                           for name, extra in variants))  # one launch, the jobs in turn
    for (name, _), summary in zip(variants, summaries):
        out = tmp_path / name
        first, second = summary["history"]
        # the same base model, prompts and engine settings: the second run reads the first's
        # before-training accuracy back (trainer.eval_cache) instead of generating
        assert summary["heldout_before_cached"] == (name == "ulysses"), (name, summary["heldout_before_cached"])
        before[name] = summary["heldout_accuracy_before"]
        assert (out / "checkpoints" / "step_2" / "metadata.json").exists(), name  # CP peers save one replica
        assert first["kl"] == 0.0 and second["kl"] > 0.0, name  # trained: the policy left the reference
        for m in (first, second):
            assert m["grad_norm"] > 0.0, (name, m)
            assert 1.0 <= m["token_mult_prob_error"] < 1.0 + 1e-4, (name, m)
    assert before["ulysses"] == before["ring"]


@pytest.mark.heavy(cheap="tests/test_families.py::test_two_rank_layouts_and_gradients")
def test_qwen3_moe_with_expert_parallelism(tmp_path):
    """GRPO on a tiny random Qwen3-MoE (4 experts, top-2, one dense layer) with its experts over both
    ranks (EP=2), on the ``length`` smoke-test task (6-token answers of 20-40 characters: rewards
    differ even for a random model): the resharder stacks each rank's experts into
    vLLM's fused-MoE tensors; after every update the engine samples with the trained weights
    (token_mult_prob_error ~ 1, every engine parameter probed through its kernel); routing
    statistics and the load-balancing loss reach TensorBoard; and the first step equals the
    same job's with all experts on every rank (EP=1). Then R3: sampled by the Megatron engine at EP=2, and by vLLM
    (its routes recorded inside the engine) at EP=2 and at TP=2."""
    from tests.dist.tiny_models import save_tiny_dir

    model_dir = save_tiny_dir(tmp_path / "moe", "qwen3_moe")
    common = ["rollout.prompts_per_step=4", "rollout.group_size=4", "trainer.micro_batch_size=4",
              "data.task=length", "data.heldout_size=8", "data.train_size=50", "rollout.max_tokens=6",
              "rollout.eval_max_tokens=8", "trainer.lr=1e-3", "trainer.progress_bar=false",
              "model.moe_aux_loss_coeff=0.01", "rollout.check_weight_sync=true"]
    # R3 (the third job): the Megatron engine generates at EP=2 (both ranks' forwards in lockstep) and records
    # each token's experts; the old-logprob pass and both mini-batch updates replay them
    r3_common = [c for c in common if c != "rollout.check_weight_sync=true"]
    # R3 from vLLM (the fourth and fifth): its routers' choices recorded inside the engine, replayed at EP=2 and at
    # TP=2 (one vLLM engine over both ranks there, each rank recording); the second step's samples come from the synced weights (their routes too, or the replay would break
    # token_mult_prob_error)
    r3_vllm = ["algorithm.routing_replay=r3", "algorithm.num_mini_batches=2", "trainer.export_hf=false", *common]
    ep2, ep1, r3, r3_vllm_ep2, r3_vllm_tp2 = run_jobs(  # one launch, the jobs in turn
        Job("grpo", model_dir, tmp_path / "ep2", ["trainer.steps=2", "parallel.expert_model_parallel_size=2", *common]),
        Job("grpo", model_dir, tmp_path / "ep1", ["trainer.steps=1", "parallel.expert_model_parallel_size=1", *common]),
        Job("grpo", model_dir, tmp_path / "r3", ["trainer.steps=2", "parallel.expert_model_parallel_size=2",
                                                 "rollout.backend=megatron", "algorithm.routing_replay=r3",
                                                 "algorithm.num_mini_batches=2", "trainer.export_hf=false",
                                                 *r3_common]),
        Job("grpo", model_dir, tmp_path / "r3_vllm_ep2", ["trainer.steps=2", "parallel.expert_model_parallel_size=2",
                                                          *r3_vllm]),
        Job("grpo", model_dir, tmp_path / "r3_vllm_tp2", ["trainer.steps=2", "parallel.tensor_model_parallel_size=2",
                                                          "parallel.sequence_parallel=true", "rollout.tensor_parallel_size=2",
                                                          *r3_vllm]))
    runs = {2: ep2["history"], 1: ep1["history"]}
    first, second = runs[2]
    for m in (first, second):
        assert 1.0 <= m["token_mult_prob_error"] < 1.0 + 1e-4, m
        assert m["weight_sync/checked"] == 3 + 3 * 9 + 8, m  # embed, norm, LM head; 3 MoE layers; 1 dense
        assert m["weight_sync/sent_mb"] > 0.0  # each rank receives the other rank's experts
        assert 1.0 <= m["moe/load_imbalance"] <= m["moe/load_imbalance_max"] <= 2.0  # 4 experts, top-2
        assert m["moe/aux_loss"] > 0.9 and m["grad_norm"] > 0.0
    assert first["reward/std"] > 0.0 and second["kl"] > 0.0  # a reward signal, and the policy moved
    ep1 = runs[1][0]
    for key in ("loss/policy", "grad_norm", "entropy", "moe/load_imbalance", "moe/aux_loss"):
        assert abs(first[key] - ep1[key]) <= 1e-5 * max(1.0, abs(ep1[key])), (key, first[key], ep1[key])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tmp_path / "ep2" / "tensorboard"))
    ea.Reload()
    assert {"moe/load_imbalance", "moe/load_imbalance_max", "moe/aux_loss"} <= set(ea.Tags()["scalars"])
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "ep2" / "hf")  # per-expert checkpoint, loads
    assert exported.config.num_experts == 4
    # R3: the old pass's logprobs of the sampled tokens are the engine's (fp32). The routers' own choices agree
    # with the rollout's in the old pass and first update (tests/test_families.py: exactly) but not all after the
    # first update moved the weights
    for name, run in (("megatron", r3), ("vllm_ep2", r3_vllm_ep2), ("vllm_tp2", r3_vllm_tp2)):
        for m in run["history"]:
            assert 1.0 <= m["token_mult_prob_error"] < 1.0 + 1e-4, (name, m)
            assert 0.5 < m["moe/routing_agreement"] < 1.0 and m["grad_norm"] > 0.0, (name, m)


@pytest.mark.heavy(cheap="tests/test_agent_e2e.py::test_grpo_trains_on_an_openai_client_agents_episodes")
def test_multi_turn_episodes_train_on_the_model_tokens(tmp_path):
    """GRPO on 3-turn episodes (tests/dist/echo_env.py answers every turn) sampled by vLLM, trained
    with context parallelism 2 and packing: the trainer's logprobs equal vLLM's on every generated
    token of every turn (fp32: token_mult_prob_error == 1; an environment token counted as the
    model's would break it), the environment's reward is a reward term, the rollout table holds
    the conversations, and the sampled held-out evaluation gives pass@1 and pass@2."""
    model_dir = save_tiny_hf_dir(tmp_path / "tiny")
    out, result = tmp_path / "run", tmp_path / "result.json"
    run_torchrun("e2e_worker.py", str(model_dir), str(out), "even_length", "trainer.steps=2",
                 "rollout.prompts_per_step=2", "rollout.group_size=4", "trainer.micro_batch_size=2",
                 "data.heldout_size=4", "data.train_size=20", "rollout.max_tokens=64", "rollout.eval_max_tokens=8",
                 "rollout.environment=tests.dist.echo_env:build", "rollout.max_turns=3",
                 "rollout.max_tokens_per_turn=8", "parallel.context_parallel_size=2", "trainer.sequence_packing=true",
                 "reward.functions=[{name: correctness}, {name: environment, weight: 0.5}]",
                 "trainer.rollout_table_every=1", "trainer.lr=1e-3", "trainer.progress_bar=false",
                 "rollout.eval_pass_k=2", "trainer.grad_stats_every=2", str(result), timeout=900)
    summary = json.loads(result.read_text())
    history = summary["history"]
    for when in ("before", "after"):  # 2 sampled episodes per held-out problem: pass@1 <= pass@2, maj@2 <= pass@2
        assert 0.0 <= summary[f"pass@1_{when}"] <= summary[f"pass@2_{when}"] <= 1.0
        assert 0.0 <= summary[f"maj@2_{when}"] <= summary[f"pass@2_{when}"]
        assert summary[f"tool_call_rate_{when}"] == 1.0  # the scripted environment counts every turn a call
    # trainer.grad_stats_every=2: layer-group norms at step 2 only, adding up to the step's gradient norm (CP=2)
    groups = {k: v for k, v in history[1].items() if k.startswith("grad_norm/")}
    assert not any(k.startswith("grad_norm/") for k in history[0])
    assert {"grad_norm/embedding", "grad_norm/layer_00/attention", "grad_norm/layer_03/mlp"} <= set(groups), groups
    assert sum(v * v for v in groups.values()) ** 0.5 == pytest.approx(history[1]["grad_norm"], rel=1e-4)
    for m in history:
        assert 1.0 <= m["token_mult_prob_error"] < 1.0 + 1e-4, m
        assert m["rollout_correction/kl"] < 1e-6
        assert m["episode/turns"] > 2.0 and m["episode/env_tokens"] > 0
        assert m["episode/generated_tokens"] < m["response_length"]  # the rest came from the environment
        assert m["reward/environment"] == 0.25 * m["episode/turns"]  # 0.25 per answered turn
        assert m["episode/tool_calls"] == m["episode/turns"] and m["episode/tool_call_rate"] == 1.0
    rows = [json.loads(line) for line in (out / "rollouts" / "step_000002.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(r["turns"] >= 2 for r in rows)
    r = rows[0]
    assert [m["role"] for m in r["messages"]][:4] == ["user", "assistant", "user", "assistant"]
    assert "Turn 1: go on." in r["response"] and r["reward/environment"] == 0.25 * r["turns"]
