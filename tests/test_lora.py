"""LoRA (``model.lora``, :mod:`parallel.lora`): the adapted TP linears equal the dense math
``x (W + scale B A)^T`` in value and gradients at TP 1 / 2 with and without sequence parallelism,
start exactly at the base model (B = 0), merge exactly for the weight sync and the HF export, and
give the reference model for free; bad settings are refused before any process group starts."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from alignment.config import validate
from alignment.models.config import lora_spec
from alignment.schema import ConfigError
from parallel.lora import FrozenBase, LoRAAdapter, LoRASpec, kaiming_uniform_a, merged_narrow
from tests.conftest import Job, run_jobs, run_torchrun
from tests.dist.tiny_llama import save_tiny_hf_dir
from tests.test_config import SMOLLM2, cfg


def test_lora_settings_are_checked_before_start():
    assert lora_spec(cfg().model.lora, 1) is None  # rank 0: full fine-tuning
    c = cfg("model.lora.rank=8", "model.lora.alpha=32", "seed=5")
    spec = lora_spec(c.model.lora, c.seed)
    assert (spec.rank, spec.scale, spec.seed) == (8, 4.0, 5) and spec.target_modules[0] == "linear_qkv"
    for name in ("grpo", "sft", "dpo", "rm", "ppo"):
        validate(cfg("model.lora.rank=8", name=name), world_size=2, hf_config=SMOLLM2)
    c = cfg(name="grpo_lora")  # the main job with adapters (docs/guides/lora.md)
    assert (c.model.lora.rank, c.model.lora.alpha, c.trainer.lr, c.run_name) == (16, 32.0, 1e-4,
                                                                                  "grpo_lora_smollm2_arithmetic")
    validate(c, world_size=2, hf_config=SMOLLM2)
    bad = {"model.lora.rank=-1": r"model.lora.rank=-1: must be >= 0",
           "model.lora.alpha=0": r"model.lora.alpha=0.0: must be > 0",
           "model.lora.dropout=1.0": r"model.lora.dropout=1.0: must be in \[0, 1\)",
           "model.lora.target_modules=[q_proj]": r"model.lora.target_modules=\['q_proj'\]: give one or more of "
                                                 r"linear_qkv, linear_proj, linear_fc1, linear_fc2"}
    for override, message in bad.items():
        extra = [] if "rank" in override else ["model.lora.rank=4"]
        with pytest.raises(ConfigError, match=message):
            validate(cfg(override, *extra), world_size=2, hf_config=SMOLLM2)


def test_targets_name_dense_and_expert_linears_as_megatron_bridge_does():
    from parallel.lora import DEFAULT_TARGETS, is_target

    dense, expert = "decoder.layers.0.mlp.linear_fc1", "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1"
    attention = "decoder.layers.1.self_attention.linear_qkv"
    assert is_target(dense, ["linear_fc1"]) and is_target(expert, ["linear_fc1"])  # both kinds
    assert is_target(dense, ["mlp.linear_fc1"]) and not is_target(expert, ["mlp.linear_fc1"])
    assert is_target(expert, ["experts.linear_fc1"]) and not is_target(dense, ["experts.linear_fc1"])
    assert not is_target(expert, ["linear_fc2", "experts.linear_fc2"]) and not is_target(attention, ["linear_proj"])
    assert all(is_target(n, DEFAULT_TARGETS) for n in (dense, expert, attention))
    validate(cfg("model.lora.rank=4", "model.lora.target_modules=[linear_qkv,experts.linear_fc1]"), world_size=2,
             hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match=r"target_modules=\['experts.linear_fc1'\]: this model has no expert layers"):
        validate(cfg("model.lora.rank=4", "model.lora.target_modules=[experts.linear_fc1]"), world_size=2,
                 hf_config=SMOLLM2)
    from tests.dist.tiny_models import tiny_qwen3_moe_config  # every layer sparse: no dense MLP to adapt

    with pytest.raises(ConfigError, match="this model has no dense MLP layers"):
        validate(cfg("model.lora.rank=4", "model.lora.target_modules=[mlp.linear_fc2]"), world_size=2,
                 hf_config=tiny_qwen3_moe_config(mlp_only_layers=()))
    validate(cfg("model.lora.rank=4", "model.lora.target_modules=[experts.linear_fc2]", "data.task=length"),
             world_size=2, hf_config=tiny_qwen3_moe_config())


def test_adapter_initialisation_is_peft_s_and_the_same_on_every_layout():
    spec = LoRASpec(rank=4, seed=1)
    a = kaiming_uniform_a(spec, "decoder.layers.3.self_attention.linear_qkv", 64)
    assert a.shape == (4, 64) and a.abs().max() <= 1 / math.sqrt(64) and a.std() > 0.5 / math.sqrt(3 * 64)
    assert torch.equal(a, kaiming_uniform_a(spec, "decoder.layers.3.self_attention.linear_qkv", 64))
    assert not torch.equal(a, kaiming_uniform_a(spec, "decoder.layers.4.self_attention.linear_qkv", 64))
    assert not torch.equal(a, kaiming_uniform_a(LoRASpec(rank=4, seed=2), "decoder.layers.3.self_attention.linear_qkv",
                                                64))
    # a row-parallel adapter keeps its columns of the full A; B starts at 0
    row = LoRAAdapter("row", 64, 32, spec, tp_size=2, tp_rank=1, stride=1, init_a=a, dtype=torch.float32,
                      device="cpu", sequence_parallel=False)
    assert torch.equal(row.A, a[:, 32:]) and row.B.shape == (32, 4) and not row.B.any()
    assert (row.A.partition_dim, row.A.tensor_model_parallel, row.B.tensor_model_parallel) == (1, True, False)
    col = LoRAAdapter("column", 64, 32, spec, tp_size=2, tp_rank=1, stride=2, init_a=a, dtype=torch.bfloat16,
                      device="cpu", sequence_parallel=True)
    assert torch.equal(col.A, a.bfloat16()) and col.B.shape == (16, 4) and col.B.dtype == torch.bfloat16
    assert (col.B.partition_dim, col.B.partition_stride) == (0, 2) and col.A.sequence_parallel


def test_merged_narrow_adds_scale_b_a_to_just_the_slice():
    spec = LoRASpec(rank=3, alpha=6.0)
    w = torch.nn.Parameter(torch.randn(10, 8))
    adapter = LoRAAdapter("column", 8, 10, spec, tp_size=1, tp_rank=0, stride=1, init_a=torch.randn(3, 8),
                          dtype=torch.float32, device="cpu", sequence_parallel=False)
    assert torch.equal(merged_narrow(w, 0, 2, 5), w.detach()[2:7])  # no adapter: the weight's slice
    w.lora_adapter = adapter
    assert torch.equal(merged_narrow(w, 0, 0, 10), w.detach())  # B = 0
    with torch.no_grad():
        adapter.B.normal_()
    full = w.detach() + 2.0 * adapter.B.detach() @ adapter.A.detach()
    torch.testing.assert_close(merged_narrow(w, 0, 2, 5), full[2:7], rtol=0, atol=1e-6)
    torch.testing.assert_close(merged_narrow(w, 1, 3, 4), full[:, 3:7], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="FrozenBase needs a model with LoRA adapters"):
        FrozenBase(torch.nn.Linear(2, 2))


@pytest.mark.slow
def test_adapted_linears_equal_the_dense_math_at_tp_1_and_2_with_and_without_sp(tmp_path):
    """Column- and row-parallel linears: output, input gradient and the full A / B gradients
    (TP slices gathered, sequence-parallel partial sums all-reduced) == fp64 autograd of
    ``x (W + scale B A)^T``; B = 0 gives the base output exactly; the base weight gets no
    gradient; dropout only in passes that build a graph. A tiny Llama with adapters on its 16
    attention / MLP linears and random B: logits == a copy holding ``W + scale B A`` in every
    adapted weight; adapters off == the base model exactly; only the adapters train; the weight
    sync yields vLLM's sharding of the merged export and never aliases an adapted weight; targets
    that adapt nothing are refused."""
    path = tmp_path / "lora.json"
    run_torchrun("lora_worker.py", str(path), nproc=2, timeout=600)
    results = json.loads(path.read_text())
    assert sorted(results) == ["tp1", "tp2", "tp2_sp"]
    for layout, r in ((layout, r) for layout, ranks in results.items() for r in ranks):  # every rank's checks
        assert len(results[layout]) == 2
        for kind in ("column", "row"):
            assert r[f"{kind}_zero_b_equal"] and r[f"{kind}_base_grad_none"], (layout, kind)
            assert r[f"{kind}_dropout_off_without_grad"] and r[f"{kind}_dropout_on_with_grad"], (layout, kind)
            for check in ("out", "dx", "dA", "dB"):
                assert r[f"{kind}_{check}"] < 1e-5, (layout, kind, check, r)
        assert r["adapted"] == 4 * 4  # 4 layers x (qkv, proj, fc1, fc2)
        assert r["model_vs_merged"] < 1e-4 and r["adapters_change_logits"] > 1e-2, (layout, r)
        assert r["disabled_equals_base"], layout
        assert r["trainable"] == ["A", "B"], layout
        assert r["nothing_adapted_refused"], layout
        # weight sync: every vLLM tensor (4 layers x 6 + embedding, norm, head) == the merged export's
        assert r["sync_wrong"] == [] and r["sync_tensors"] == 4 * 6 + 3, (layout, r["sync_wrong"])
        assert r["aliased_adapted"] == [], layout  # merged weights are new tensors, budgeted as such
    assert any("layernorm" in n for n in results["tp1"][0]["aliased"])  # whole unadapted weights still pass as they are


@pytest.mark.heavy(cheap="tests/test_lora.py::test_adapter_gradients_equal_peft_autograd_for_grpo_and_dpo")
def test_grpo_with_lora_syncs_merged_weights_and_keeps_the_base_frozen(tmp_path):
    """GRPO, fp32, TP 2 on 2 processes, rank-4 adapters: the engine's logprobs equal the trainer's
    at every step (the weight sync merges ``W + scale B A`` piece by piece), the KL to the
    reference (the policy with its adapters off) is exactly 0 before the first update and > 0
    after; the merged HF export differs from the base only in the adapted linears, everything
    else (embeddings, norms) bit-identical; the checkpoint holds only the adapters (and their
    Adam state); it resumes at TP 1 to the same merged weights and trains on."""
    model_dir = save_tiny_hf_dir(tmp_path / "tiny")
    out, result = tmp_path / "run", tmp_path / "result.json"
    common = ["rollout.prompts_per_step=4", "rollout.group_size=4", "trainer.micro_batch_size=4", "data.heldout_size=8",
              "data.train_size=50", "rollout.max_tokens=16", "rollout.eval_max_tokens=8", "trainer.lr=1e-2",
              "trainer.progress_bar=false", "parallel.tensor_model_parallel_size=2", "model.lora.rank=4",
              "algorithm.kl_coef=0.1", "trainer.use_distributed_optimizer=false"]  # its state resumes at any TP
    run_torchrun("e2e_worker.py", str(model_dir), str(out), "even_length", "trainer.steps=2", *common, str(result),
                 timeout=900)
    s = json.loads(result.read_text())
    first, second = s["history"]
    assert first["kl"] == 0.0 and second["kl"] > 0.0 and first["grad_norm"] > 0.0, (first, second)
    for m in (first, second):
        assert 1.0 <= m["token_mult_prob_error"] < 1.0 + 1e-4, m
    base, exported = load_file(model_dir / "model.safetensors"), load_file(out / "hf" / "model.safetensors")
    adapted = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert base.keys() == exported.keys()
    for name, t in base.items():
        if any(f".{a}." in name for a in adapted):
            assert not torch.equal(t, exported[name]), name  # trained through its adapter
        else:
            assert torch.equal(t, exported[name]), name  # frozen
    check_peft_adapter(model_dir, out)
    # the checkpoint holds the adapters and their Adam state only, not the frozen base
    ckpt = out / "checkpoints" / "step_2"
    ckpt_bytes = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    model_bytes = sum(t.numel() * t.element_size() for t in base.values())
    assert ckpt_bytes < model_bytes / 4, (ckpt_bytes, model_bytes)
    # resumed at TP 1 with nothing left to train: the export equals the TP 2 run's (adapters reassembled
    # from their TP shards, the gated MLP's [gate; up] rows of B included), then one more step
    tp1 = [o for o in common if not o.startswith("parallel.")]
    run_torchrun("e2e_worker.py", str(model_dir), str(out), "even_length", "trainer.steps=2", *tp1, str(result),
                 timeout=900)
    again = load_file(out / "hf" / "model.safetensors")
    for name, t in exported.items():
        torch.testing.assert_close(again[name], t, rtol=0, atol=1e-6, msg=name)
    run_torchrun("e2e_worker.py", str(model_dir), str(out), "even_length", "trainer.steps=3", *tp1, str(result),
                 timeout=900)
    r = json.loads(result.read_text())
    assert r["start_step"] == 2 and 1.0 <= r["history"][0]["token_mult_prob_error"] < 1.0 + 1e-4


def check_peft_adapter(base_dir, out) -> None:
    """``<out>/hf_adapter`` loaded by PEFT onto the HF base gives the logits of the merged export
    ``<out>/hf``, and PEFT's own merge gives its weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(out / "hf", torch_dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32),
                                           out / "hf_adapter").eval()
    ids = torch.randint(0, merged.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = merged(ids).logits, peft_model(ids).logits
        with peft_model.disable_adapter():
            base = peft_model(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)  # PEFT adds the adapter apart: equal up to rounding
    from tests.export_check import check_export

    check_export(out / "hf", base_dir)  # the merged export's dtype and tokenizer, read by transformers and vLLM
    assert (base - want).abs().max() > 1e-3  # and the adapters matter
    unloaded = peft_model.merge_and_unload().state_dict()
    for name, t in merged.state_dict().items():
        torch.testing.assert_close(unloaded[name], t, rtol=0, atol=1e-6, msg=name)


@pytest.mark.heavy(cheap="tests/test_lora.py::test_adapter_gradients_equal_peft_autograd_for_grpo_and_dpo")
def test_dpo_and_reward_model_with_lora(tmp_path):
    """DPO with rank-4 adapters: the reference is the policy with its adapters off, so the loss
    starts at exactly log 2 and falls; the reward model trains its adapters and scalar head, and
    its merged HF export, scored by transformers, reproduces the held-out accuracy and margin."""
    from tests.test_offline_e2e import COMMON, check_export_scores

    lora = ["model.lora.rank=4", "model.lora.alpha=8", "trainer.lr=1e-2", "data.train_size=8", "data.heldout_size=8",
            "trainer.global_batch_size=8", "trainer.micro_batch_size=2", "trainer.epochs=3"]
    model_dir, out = save_tiny_hf_dir(tmp_path / "tiny"), tmp_path / "rm"
    s, rm = run_jobs(  # one launch
        Job("dpo", model_dir, tmp_path / "dpo", [*COMMON, *lora, "algorithm.beta=0.5", "trainer.save_checkpoint=false",
                                                 "trainer.export_hf=false"]),
        Job("rm", model_dir, out, [*COMMON, *lora, "trainer.save_checkpoint=false"]))
    losses = [h["loss"] for h in s["history"]]
    assert abs(s["heldout_before"]["loss"] - math.log(2)) < 1e-6 and abs(losses[0] - math.log(2)) < 1e-6
    assert losses[0] > losses[1] > losses[2], losses
    losses = [h["loss"] for h in rm["history"]]
    assert losses[0] > losses[2], losses
    check_export_scores(out, rm["heldout_after"])


@pytest.mark.slow
def test_adapter_gradients_equal_peft_autograd_for_grpo_and_dpo(torchrun_json):
    """The GRPO and DPO gradients of every adapter through Megatron (DDP, schedule, TP / SP / PP
    communication, finalize_model_grads) == single-process autograd on a PEFT-wrapped HF model
    from the same adapters, at DP 2, TP 2, TP 2 + SP and PP 2 (tests/dist/lora_parity_worker.py);
    loaded from PEFT names (``load_lora_adapters``) and exported back (``export_lora_adapters``).
    Qwen3-MoE's expert adapters likewise at EP 1 / EP 2 / expert TP 2 + SP / TP 2 x EP 2, against
    PEFT's adapters on the stacked expert parameters."""
    r = torchrun_json("lora_parity_worker.py")
    moe = r["grpo_moe"]  # Qwen3-MoE: adapters on the attention and on each expert's linear_fc1 / linear_fc2
    assert moe["reference_max_grad"] > 1e-3 and moe["tensors"] == 4 * (4 + 4 * 3) * 2, moe  # 4 experts x 3 proj.
    for case in ("ep1", "ep2", "tp2_etp2_sp", "tp2_ep2_etp1"):
        assert abs(moe[case]["loss"] - moe["reference_loss"]) <= 1e-5, (case, moe[case])
        assert moe[case]["max_grad_diff"] <= 1e-5 * moe["reference_max_grad"] + 1e-7, (case, moe[case])
    # the EP 2 run's PEFT directory (per-expert names) loads onto the HF base with the reference's logits
    assert moe["peft_logits_diff"] <= 1e-5 and moe["adapter_effect"] > 1e-2, moe
    # the weight sync into vLLM's fused-MoE layout (TP 1 and 2, from EP 2) == vLLM's loaders on PEFT's merge
    # every rank's vLLM shards (TP 1, then its TP 2 rank), the same number on each
    assert moe["sync_wrong"] == [] and moe["sync_tensors"][0] > 0 and len(set(moe["sync_tensors"])) == 1, moe
    assert moe["merge_moves_experts"] > 1e-3, moe
    assert moe["checkpoint_resumes"], moe  # adapters-only checkpoint: EP 2 -> EP 1 x expert TP 2, exact, every rank
    for loss in ("grpo", "dpo"):
        res = r[loss]
        assert res["reference_max_grad"] > 1e-3 and res["tensors"] == 4 * 7 * 2, res  # 4 layers x 7 projections
        for case in ("dp2", "tp2", "tp2_sp", "pp2"):
            ref = res["reference_loss"]
            assert abs(res[case]["loss"] - ref) <= 1e-5 * max(1.0, abs(ref)), (loss, case, res[case], ref)
            assert res[case]["max_grad_diff"] <= 1e-5 * res["reference_max_grad"] + 1e-7, (loss, case, res[case])


def test_frozen_linear_input_gradient_with_transposed_strides():
    """parallel/cpu_compat.py: the input gradient of a frozen linear (a LoRA job's base and tied
    output layer) from an output gradient with a transposed layout's strides (``[s, 1, V]`` viewed
    from ``[1, s, V]``, as the logits' gradient arrives) is ``g W``, computed from re-viewed
    standard strides (oneDNN's bf16 matmul would size a buffer from the odd ones, fail and leave
    the process on PyTorch's 100x slower reference GEMM)."""
    from megatron.core.tensor_parallel.layers import LinearWithFrozenWeight

    from parallel.cpu_compat import _patch_frozen_linear_grad_strides

    _patch_frozen_linear_grad_strides()
    _patch_frozen_linear_grad_strides()  # idempotent
    assert LinearWithFrozenWeight.backward._megalign_strides
    w = torch.randn(96, 32, dtype=torch.bfloat16)
    x = torch.randn(7, 1, 32, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(1, 7, 96, dtype=torch.bfloat16).transpose(0, 1)
    assert g.stride() == (96, 7 * 96, 1) and g.is_contiguous()
    LinearWithFrozenWeight.apply(x, w, None, False, None).backward(g)
    torch.testing.assert_close(x.grad, g.contiguous().view(7, 96).matmul(w).view(7, 1, 32), rtol=0, atol=0)
