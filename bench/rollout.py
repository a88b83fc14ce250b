"""Decode speed of the rollout engine alone against the memory-bandwidth bound, measured side by side in one run.

Every decode step of a batch reads all of the model's weights (and the batch's KV cache) once, so a step cannot
take less than ``bytes read / memory bandwidth``. This bench runs vLLM (megalign's ``VLLMEngine``) on SmolLM2-135M
and, in the same run and in the same layout, measures the machine's memory bandwidth with ``torch`` copies:

- layouts: one rank on one core (one rank's share of the main job), one rank on every core, and two ranks at
  once on one core each (the main job's layout: both ranks decode together and share the memory bus);
- workloads: the main job's batch (32 sequences a rank, 48 new tokens) and GSM8K length (32 x 256);
- each workload is generated twice, with 1 new token (the prefill) and with ``L`` (``ignore_eos``: exactly ``L``
  decode steps), so decode time = ``t(L) - t(1)`` over ``L - 1`` steps.

Memory bound per decode step = (weight bytes + the KV cache read at the mean context) / bandwidth, the bandwidth
being the bytes a ``torch`` copy moves per second (read + written), with every rank of the layout copying at once.
On a CPU core a batch of 32 also waits on arithmetic: the roofline per step is the larger of that and the batch's
FLOPs (:func:`decode_flops`) over the matmul peak each rank measures at once (a 1024^3 product in the dtype).
Printed: decode tokens/s, both bounds' tokens/s and the fractions reached (issue 43's target: >= 50 % of the
memory bound once compiled).

    python bench/rollout.py [--dtype bfloat16|float32] [--compiled] [--layouts 1x1,1x2,2x1] [--lengths 48,256]

``--engine megatron`` measures Megatron-Core's inference engine instead (``rollout.backend=megatron``, the engine
of a machine without vLLM), in this process on one device (a GPU when there is one), random weights of each
``--models`` shape, eager and (``--cuda-graphs``) with the engine's decode steps of fixed shape captured as CUDA graphs
(:mod:`alignment.rollout.engines.static_decode`; uncaptured on a CPU), the greedy tokens of the two compared. Its batch is
the main job's on one device (8 prompts x 8 samples) and the bandwidth is a device-to-device copy's; ``--profile``
adds the GPU's kernel time over wall time:

    python bench/rollout.py --engine megatron [--models smollm2-135m,tinyllama-1.1b,llama-8b] [--batch 64]
        [--lengths 48,256] [--cuda-graphs] [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BATCH = 32  # the main job's sequences per rank: 8 prompts x 8 samples over 2 ranks
PROMPT_TOKENS = 64
LAYOUTS = {"1x1": (1, 1), "1x2": (1, 2), "2x1": (2, 1)}  # name -> (ranks, cores per rank)


def worker(args) -> None:
    """One rank: its bandwidth, then each length's prefill-only and full generation, timed; JSON to stdout."""
    import torch

    from alignment.models.flops import measured_matmul_peak
    from alignment.models.hf_assets import prepare_hf_dir
    from alignment.rollout.engines.vllm_engine import VLLMEngine
    from vllm import SamplingParams

    torch.set_num_threads(args.cores)
    barrier = Path(args.barrier)

    def together(tag: str) -> None:  # every rank starts each measurement at once (files as a barrier)
        (barrier / f"{tag}.{args.rank}").touch()
        while len(list(barrier.glob(f"{tag}.*"))) < args.ranks:
            time.sleep(0.005)

    hf_dir = prepare_hf_dir("smollm2")
    lengths = [int(x) for x in args.lengths.split(",")]
    # the main job's max_model_len: its compile cache (alignment/rollout/engines/compile_cache.py) is this engine's
    engine = VLLMEngine(str(hf_dir), max_model_len=max(512, PROMPT_TOKENS + max(lengths) + 8), kv_cache_gib=1.0,
                        dtype=args.dtype, enforce_eager=not args.compiled, seed=args.rank)
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    out = {"rank": args.rank, "config": config, "times": {}, "engine": engine.compile_note}
    together("bw")
    out["bandwidth"] = device_copy_bandwidth(torch.device("cpu"), gib=0.5, repeats=5)
    together("peak")
    out["peak"] = measured_matmul_peak("cpu", getattr(torch, args.dtype), n=1024)
    vocab = config["vocab_size"]
    prompts = [[(17 * i + 31 * j) % (vocab - 100) + 50 for j in range(PROMPT_TOKENS)] for i in range(BATCH)]
    warm = SamplingParams(max_tokens=4, ignore_eos=True, temperature=1.0)
    engine.llm.generate([{"prompt_token_ids": p} for p in prompts], warm, use_tqdm=False)
    for length in lengths:
        for n in (1, length):
            engine.llm.reset_prefix_cache()  # the prefill is measured each time
            params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=1.0)
            together(f"gen{length}-{n}")
            t0 = time.perf_counter()
            res = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            out["times"][f"{length}:{n}"] = time.perf_counter() - t0
            assert all(len(r.outputs[0].token_ids) == n for r in res)
    print("RESULT " + json.dumps(out), flush=True)


def decode_flops(config: dict, dtype: str, context: float) -> float:
    """FLOPs of one decoded token at ``context`` cached tokens: 2 per weight it multiplies (every layer and the
    output layer) and 4 per head dimension, head and cached token for attention's two products."""
    weights, _ = weight_bytes(config, dtype)
    h, heads, layers = config["hidden_size"], config["num_attention_heads"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or h // heads
    return 2 * weights / (2 if dtype in ("bfloat16", "float16") else 4) + 4 * layers * heads * head_dim * context


def weight_bytes(config: dict, dtype: str) -> tuple[float, float]:
    """(the weights' bytes, the KV cache's bytes per cached token) of a Llama-shaped HF ``config``."""
    h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv_heads, vocab = config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]
    head_dim = config.get("head_dim") or h // heads
    per_layer = h * head_dim * (heads + 2 * kv_heads) + heads * head_dim * h + 3 * h * inter + 2 * h
    size = 2 if dtype in ("bfloat16", "float16") else 4
    # every step reads each layer, the final norm and the output layer (the embedding rows it looks up are few)
    return (layers * per_layer + h + vocab * h) * size, 2 * layers * kv_heads * head_dim * size


#: ``--engine megatron`` shapes (HF Llama config fields; random weights)
SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                         tie_word_embeddings=True, rms_norm_eps=1e-5),
    # TinyLlama-1.1B (bench/train_mfu.py's model)
    "tinyllama-1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                           num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5),
    # Llama-3.1-8B
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
                     rope_theta=500000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, rms_norm_eps=1e-5),
}


def device_copy_bandwidth(device, gib: float = 1.0, repeats: int = 10) -> float:
    """Bytes moved per second (read + written) by the fastest of ``repeats`` copies of ``gib`` GiB on ``device``."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    src = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best


def kernel_busy_fraction(generate, device) -> tuple[float, int] | None:
    """(GPU kernel time / wall time, kernels launched) of one ``generate()`` under ``torch.profiler`` (None off
    CUDA): how much of a decode the device spends computing rather than waiting for the host to launch the next
    kernel."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        generate()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    return sum(e.self_device_time_total for e in events) / 1e6 / wall, sum(e.count for e in events)


def megatron_bench(args) -> None:
    """``--engine megatron``: this process, one device; prints the table (module docstring)."""
    import platform

    import torch
    from transformers import LlamaConfig

    from alignment.models.gpt import build_gpt_model, transformer_config
    from alignment.data.samples import SamplingConfig
    from alignment.rollout.engines.megatron_engine import MegatronEngine
    from parallel.layout import ParallelLayout
    from parallel.state import init_distributed, shutdown

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    lengths = [int(x) for x in args.lengths.split(",")]
    init_distributed(ParallelLayout(world_size=1))
    bandwidth = device_copy_bandwidth(device)
    where = torch.cuda.get_device_name(0) if cuda else f"{platform.processor() or platform.machine()}, " \
        f"{torch.get_num_threads()} threads"
    print(f"# bench/rollout.py --engine megatron, {time.strftime('%Y-%m-%d')}, {where}, torch {torch.__version__}, "
          f"{args.dtype}, random weights, {args.batch} sequences, {PROMPT_TOKENS}-token prompts, copy bandwidth "
          f"{bandwidth / 1e9:.0f} GB/s")
    print("| model | decode | new tokens | prefill s | decode s | decode ms / step | decode tokens/s | bound tokens/s "
          "| of the bound | GPU kernels busy |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    fixed = "CUDA graphs" if cuda else "fixed shape"
    modes = [("eager", False), (fixed, True)] if args.cuda_graphs else [("eager", False)]
    for name in args.models.split(","):
        shape = SHAPES[name]
        hf = LlamaConfig(**shape)
        torch.manual_seed(0)
        model = build_gpt_model(hf, transformer_config(hf, params_dtype=dtype)).eval()
        g = torch.Generator().manual_seed(1)
        prompts = torch.randint(50, shape["vocab_size"] - 50, (args.batch, PROMPT_TOKENS), generator=g).tolist()
        weights, kv_per_token = weight_bytes(shape, args.dtype)
        greedy, notes = {}, []
        for mode, graphs in modes:
            engine = MegatronEngine(model, None, eos_token_id=-1, vocab_size=shape["vocab_size"],  # -1: never stops
                                    max_model_len=PROMPT_TOKENS + max(lengths) + 8, max_batch_size=args.batch,
                                    cuda_graphs=graphs)

            def generate(n: int, temperature: float = 1.0):
                return engine.generate(prompts, SamplingConfig(n=1, temperature=temperature, max_tokens=n))

            sync()
            t0 = time.perf_counter()
            generate(max(lengths))  # warm-up: the KV cache allocated, kernels chosen, every bucket's graph captured
            sync()
            warm = time.perf_counter() - t0
            if engine.static is not None:
                notes.append(f"{mode}: warm-up ({max(lengths)} tokens, {engine.static.captures} graphs captured) "
                             f"{warm:.1f} s")
            for length in lengths:
                times = {}
                for n in (1, length):
                    sync()
                    t0 = time.perf_counter()
                    out = generate(n)
                    sync()
                    times[n] = time.perf_counter() - t0
                    assert all(len(s[0].response_ids) == n for s in out), "a sequence stopped early"
                profiled = min(length, 32)
                busy = kernel_busy_fraction(lambda: generate(profiled), device) if args.profile else None
                decode, steps = times[length] - times[1], length - 1
                tokens = args.batch * steps
                step_bytes = weights + args.batch * (PROMPT_TOKENS + length / 2) * kv_per_token
                bound = args.batch / (step_bytes / bandwidth)
                gpu = "-" if busy is None else f"{busy[0]:.0%} ({busy[1] / profiled:.0f} kernels / token)"
                print(f"| {name} | {mode} | {length} | {times[1]:.3f} | {decode:.3f} | {decode / steps * 1e3:.2f} | "
                      f"{tokens / decode:.0f} | {bound:.0f} | {tokens / decode / bound:.1%} | {gpu} |", flush=True)
            greedy[mode] = [s[0].response_ids for s in generate(32, temperature=0.0)]
            engine.close()
            engine = None
        if len(greedy) == 2:
            same = sum(a == b for a, b in zip(*greedy.values()))
            notes.append(f"greedy: {same} of {args.batch} sequences of 32 tokens equal the eager engine's")
        print(f"<!-- {name}: {'; '.join(notes)} -->", flush=True)
        model = None  # freed before the next model
        if cuda:
            torch.cuda.empty_cache()
    shutdown()


def run_layout(name: str, args) -> list[dict]:
    ranks, cores = LAYOUTS[name]
    barrier = Path(f"/tmp/megalign-bench-rollout-{os.getpid()}-{name}")
    barrier.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(ranks):
        first = rank * cores
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(cores),
               "VLLM_CPU_OMP_THREADS_BIND": f"{first}-{first + cores - 1}" if cores > 1 else str(first)}
        cmd = [sys.executable, __file__, "--worker", "--rank", str(rank), "--ranks", str(ranks), "--cores", str(cores),
               "--barrier", str(barrier), "--dtype", args.dtype, "--lengths", args.lengths,
               *(["--compiled"] if args.compiled else [])]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = []
    for p in procs:
        text, _ = p.communicate()
        lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            sys.exit(f"layout {name}: a rank failed (exit {p.returncode}):\n{text[-3000:]}")
        results.append(json.loads(lines[-1][7:]))
    for f in barrier.iterdir():
        f.unlink()
    barrier.rmdir()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--compiled", action="store_true", help="vLLM compiled (torch.compile) instead of eager")
    ap.add_argument("--layouts", default="1x1,1x2,2x1")
    ap.add_argument("--lengths", default="48,256")
    ap.add_argument("--engine", default="vllm", choices=["vllm", "megatron"])
    ap.add_argument("--models", default="smollm2-135m", help="--engine megatron: " + ",".join(SHAPES))
    ap.add_argument("--batch", type=int, default=64, help="--engine megatron: sequences at once")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="--engine megatron: also decode with fixed-shape steps (CUDA graphs on a GPU)")
    ap.add_argument("--profile", action="store_true", help="--engine megatron: GPU kernel time / wall time")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--ranks", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--cores", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--barrier", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.engine == "megatron":
        megatron_bench(args)
        return
    import platform

    print(f"# bench/rollout.py, {time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, SmolLM2-135M {args.dtype}, vLLM {'compiled' if args.compiled else 'eager'}, "
          f"{BATCH} sequences a rank, {PROMPT_TOKENS}-token prompts")
    print("| layout | new tokens | prefill s | decode s | decode tokens/s (all ranks) | bandwidth GB/s | "
          "memory bound tokens/s | of the memory bound | matmul peak GFLOP/s | roofline tokens/s | of the roofline |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.layouts.split(","):
        results = run_layout(name, args)
        ranks, cores = LAYOUTS[name]
        weights, kv_per_token = weight_bytes(results[0]["config"], args.dtype)
        bandwidth = sum(r["bandwidth"] for r in results)  # every rank copying at once
        for length in (int(x) for x in args.lengths.split(",")):
            prefill = max(r["times"][f"{length}:1"] for r in results)
            decode = max(r["times"][f"{length}:{length}"] - r["times"][f"{length}:1"] for r in results)
            steps = length - 1
            tokens = ranks * BATCH * steps
            context = PROMPT_TOKENS + length / 2  # the mean cached context over the decode
            step_bytes = ranks * (weights + BATCH * context * kv_per_token)  # every rank reads its own copy
            memory_s = step_bytes / bandwidth
            peak = min(r["peak"] for r in results)  # each rank computes its own batch with its own cores
            compute_s = BATCH * decode_flops(results[0]["config"], args.dtype, context) / peak
            bound, roofline = tokens / (steps * memory_s), tokens / (steps * max(memory_s, compute_s))
            label = f"{ranks} rank{'s' if ranks > 1 else ''} x {cores} core{'s' if cores > 1 else ''}"
            rate = tokens / decode
            print(f"| {label} | {length} | {prefill:.2f} | {decode:.2f} | {rate:.0f} | {bandwidth / 1e9:.1f} | "
                  f"{bound:.0f} | {rate / bound:.0%} | {peak / 1e9:.0f} | {roofline:.0f} | {rate / roofline:.0%} |",
                  flush=True)
        print(f"<!-- {name}: {results[0]['engine']} -->", flush=True)


if __name__ == "__main__":
    main()
