"""Plan a parallel layout: every valid (TP, PP, CP, DP, and EP for mixture-of-experts models) for
a model on a cluster, its memory per GPU, and the one to use; for a model's shape, or for a job.

    megalign plan --config-name recipes/grpo-qwen3-1.7b-gsm8k-1n8g model.path=/models/Qwen3-1.7B

    python tools/plan_layout.py --model llama-3.1-8b --nodes 2 --gpus-per-node 8 --gpu-memory-gib 80
    python tools/plan_layout.py --model qwen3-30b-a3b --nodes 2 --gpus-per-node 8 --distributed-optimizer
    python tools/plan_layout.py --model smollm2 --nodes 1 --gpus-per-node 2 --gpu-memory-gib 24 \\
        --dtype float32 --micro-batch-size 8 --seq-length 512 --rollout-tp 1 --kv-cache-tokens 32768

``--model``: the name of a shipped architecture config (``tools/model_configs/*.json``), an HF
directory or its ``config.json``, a ``.gguf`` file, or ``smollm2``. The estimate is
:mod:`parallel.memory` (weights, fp32 gradient buffer, Adam state with and without the
distributed optimizer, activations of the micro-batches in flight, the loss's logits, a
colocated vLLM engine's weights and KV cache) for the largest pipeline stage; the layouts
come from :mod:`parallel.plan`, and the recommendation follows :data:`parallel.plan.RULE`.
Runs on any machine (no GPU, no process group).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from alignment.algorithms import registry  # noqa: E402
from alignment.models.families import family_of, get_bridge, model_dims  # noqa: E402
from alignment.models.hf_assets import smollm2_gguf_path  # noqa: E402
from parallel.layout import ParallelLayout  # noqa: E402
from launchers.memory_plan import JobMemory, job_memory, step_shape  # noqa: E402,F401 - the job's plan, here too
from parallel.memory import DTYPE_BYTES, GiB, RolloutPlan  # noqa: E402
from parallel.plan import RULE, plan, recommend  # noqa: E402


CONFIG_DIR = Path(__file__).resolve().parent / "model_configs"
COLUMNS = ("weights", "grads", "optimizer_plain", "optimizer_distributed", "activations", "logits",
           "rollout_weights", "kv_cache")
HEADERS = ("weights", "grads", "adam", "adam/DPxCP", "activ.", "logits", "vLLM w", "KV cache")


def shipped_models() -> list[str]:
    """Names of the architecture configs in ``tools/model_configs/``."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def load_model_config(model: str):
    """The HF config of ``--model`` (attribute access, as a family's ``dims`` reads it).

    Raises ValueError naming ``--model`` and what it accepts, for an unknown name, a missing
    path or an architecture megalign does not train (:func:`alignment.models.families.family_of`).
    """
    accepted = (f"a shipped config ({', '.join(shipped_models())}), an HF directory, its config.json, "
                f"a .gguf file, or smollm2")
    path = Path(model).expanduser()
    if (CONFIG_DIR / f"{model.lower()}.json").is_file():
        cfg = SimpleNamespace(**json.loads((CONFIG_DIR / f"{model.lower()}.json").read_text()))
    elif model.lower() == "smollm2" or path.suffix.lower() == ".gguf":
        from transformers import AutoConfig


        gguf = smollm2_gguf_path() if model.lower() == "smollm2" else path
        if not gguf.is_file():
            raise ValueError(f"--model {model}: no such file; expected {accepted}")
        cfg = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)  # reads the metadata only
    elif path.is_dir() and (path / "config.json").is_file():
        cfg = SimpleNamespace(**json.loads((path / "config.json").read_text()))
    elif path.is_file() and path.suffix == ".json":
        cfg = SimpleNamespace(**json.loads(path.read_text()))
    else:
        raise ValueError(f"--model {model}: not found; expected {accepted}")

    try:
        family_of(cfg)
    except ValueError as e:
        raise ValueError(f"--model {model}: {e}") from e
    return cfg


JOB_OPTIONS = ("--config-name", "-cn", "--config-dir", "-cd")


def job_argv(argv: list[str]) -> list[str]:
    """``megalign plan --config-name JOB [--config-dir DIR] [overrides] [plan flags]``: the plan flags a job
    implies (its model, cluster, dtype, micro-batch, sequence length, distributed optimizer, LoRA rank and
    colocated engine), then the flags given, which win. The job is composed as ``megalign train`` composes it
    (:func:`alignment.compose.compose_job`); a null ``rollout.max_model_len`` plans for the model's positions.

    Raises:
        ConfigError, hydra's errors: as composing the job does.
    """
    from alignment.compose import compose_job, split_job_args
    from alignment.models.hf_assets import is_hub_id, resolve_model

    flags, rest, items = [], [], list(argv)
    while items:
        a = items.pop(0)
        if a.startswith("--") and a.split("=", 1)[0] not in JOB_OPTIONS:
            flags.append(a)
            if "=" not in a and items and not items[0].startswith("-") and "=" not in items[0]:
                flags.append(items.pop(0))
        else:
            rest.append(a)
    name, config_dir, overrides = split_job_args(rest)
    cfg = compose_job(name, overrides, config_dir).cfg
    offline, r, t = not registry.of(cfg).online, cfg.rollout, cfg.trainer
    model = str(cfg.model.path)
    if is_hub_id(model):  # a shipped config name, an HF dir, a config.json, .gguf or smollm2 are read as they are
        model = str(resolve_model(model, cfg.model.revision))
    hf = load_model_config(model)
    rows, seq = step_shape(cfg, hf)
    gpus = cfg.cluster.gpus_per_node or 1
    out = ["--model", model, "--nodes", str(cfg.cluster.nodes), "--gpus-per-node", str(gpus),
           "--dtype", cfg.model.dtype, "--seq-length", str(seq), "--micro-batch-size", str(rows),
           "--lora-rank", str(cfg.model.lora.rank),
           "--distributed-optimizer" if t.use_distributed_optimizer else "--no-distributed-optimizer"]
    if cfg.cluster.gpu_memory_gib:
        out += ["--gpu-memory-gib", str(cfg.cluster.gpu_memory_gib)]
    if not offline and r.backend == "vllm" and r.placement == "colocated":
        per_gpu = max(1, r.prompts_per_step * r.group_size // (cfg.cluster.nodes * gpus))
        out += ["--rollout-tp", str(r.tensor_parallel_size), "--kv-cache-tokens", str(seq * per_gpu)]
    print(f"{name}: {cfg.algorithm.name} on {cfg.model.path}; planned with {' '.join(out[2:])}"
          + ("" if offline or r.max_model_len else f" (rollout.max_model_len=null: the model's {seq} positions, an "
             "upper bound)"), flush=True)
    return out + flags


def parse_args(argv=None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a.split("=", 1)[0] in JOB_OPTIONS for a in argv):
        try:
            argv = job_argv(argv)
        except Exception as e:  # noqa: BLE001 - the job's bad input: one line, as megalign train prints it
            print(f"megalign plan: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
    ap = argparse.ArgumentParser(description="List the valid parallel layouts with their memory per GPU and "
                                             "recommend one (no GPU needed); or a job's: --config-name JOB "
                                             "[--config-dir DIR] [overrides]")
    ap.add_argument("--model", required=True, help="shipped config name, HF dir, config.json, .gguf or smollm2")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory of one GPU, GiB")
    ap.add_argument("--headroom", type=float, default=0.1,
                    help="fraction of each GPU kept free for what the estimate leaves out (CUDA context, NCCL, "
                         "fragmentation); default 0.1")
    ap.add_argument("--dtype", default="bfloat16", help="weights and activations: bfloat16 (default) or float32")
    ap.add_argument("--micro-batch-size", type=int, default=1, help="sequences per forward (trainer.micro_batch_size)")
    ap.add_argument("--seq-length", type=int, default=4096, help="tokens per sequence, padded")
    ap.add_argument("--num-microbatches", type=int, default=None,
                    help="micro-batches per step and DP rank; default: enough to fill the pipeline")
    ap.add_argument("--distributed-optimizer", action=argparse.BooleanOptionalAction, default=False,
                    help="shard Adam over DP x CP (trainer.use_distributed_optimizer); both are shown either way")
    ap.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True,
                    help="sequence parallelism whenever TP > 1 (default on)")
    ap.add_argument("--cp-comm-type", default="p2p", help="p2p (ring attention, default) or a2a (Ulysses)")
    ap.add_argument("--virtual-pp", type=int, default=None, help="model chunks per pipeline rank (interleaved)")
    ap.add_argument("--rollout-tp", type=int, default=0,
                    help="TP size of a colocated vLLM engine (rollout.tensor_parallel_size); 0: no engine")
    ap.add_argument("--kv-cache-tokens", type=int, default=0,
                    help="tokens in each vLLM engine's KV cache, e.g. max_model_len x concurrent sequences")
    ap.add_argument("--lora-rank", type=int, default=0,
                    help="model.lora.rank: frozen base, adapters on every attention, MLP and expert linear; "
                         "0: full fine-tuning")
    args = ap.parse_args(argv)
    _check(ap, args)
    return args


def _check(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """``ap.error`` (exit 2, usage + message) naming the flag and the fix."""

    for flag, value in (("--nodes", a.nodes), ("--gpus-per-node", a.gpus_per_node),
                        ("--micro-batch-size", a.micro_batch_size), ("--seq-length", a.seq_length)):
        if value < 1:
            ap.error(f"{flag} {value}: must be a positive integer")
    if a.lora_rank < 0:
        ap.error(f"--lora-rank {a.lora_rank}: must be >= 0 (0: full fine-tuning, e.g. 16)")
    if a.gpu_memory_gib <= 0:
        ap.error(f"--gpu-memory-gib {a.gpu_memory_gib}: must be > 0 (e.g. 80 for an H100 80GB)")
    if not 0 <= a.headroom < 1:
        ap.error(f"--headroom {a.headroom}: must be a fraction in [0, 1), e.g. 0.1")
    if a.dtype not in DTYPE_BYTES:
        ap.error(f"--dtype {a.dtype}: valid values are {', '.join(DTYPE_BYTES)}")
    if a.num_microbatches is not None and a.num_microbatches < 1:
        ap.error(f"--num-microbatches {a.num_microbatches}: must be >= 1, or leave it out")
    if a.cp_comm_type not in ("p2p", "a2a"):
        ap.error(f"--cp-comm-type {a.cp_comm_type}: valid values are p2p (ring attention) and a2a (Ulysses)")
    if a.virtual_pp is not None and a.virtual_pp < 2:
        ap.error(f"--virtual-pp {a.virtual_pp}: must be >= 2 (chunks per pipeline rank), or leave it out")
    if a.rollout_tp < 0 or (a.rollout_tp and a.gpus_per_node % a.rollout_tp):
        valid = [d for d in range(1, a.gpus_per_node + 1) if a.gpus_per_node % d == 0]
        ap.error(f"--rollout-tp {a.rollout_tp}: must divide --gpus-per-node {a.gpus_per_node} (one engine within a "
                 f"node); valid: {valid}, or 0 for no engine")
    if a.kv_cache_tokens < 0 or (a.kv_cache_tokens and not a.rollout_tp):
        ap.error(f"--kv-cache-tokens {a.kv_cache_tokens}: must be >= 0, and needs --rollout-tp (the engine's TP size)")
    try:
        a.hf_config = load_model_config(a.model)
    except (ValueError, FileNotFoundError) as e:
        ap.error(str(e))
    if a.rollout_tp:

        try:
            get_bridge(a.hf_config).check_tp_sizes(1, a.rollout_tp)
        except ValueError as e:
            ap.error(str(e).replace("rollout.tensor_parallel_size", "--rollout-tp"))


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def _describe(lay) -> str:
    """``TP=.. PP=.. CP=.. DP=..`` (+ ``EP=.. (expert TP 1)`` for a mixture-of-experts layout)."""
    text = (f"TP={lay.tensor_model_parallel_size} PP={lay.pipeline_model_parallel_size} "
            f"CP={lay.context_parallel_size} DP={lay.data_parallel_size}")
    if lay.expert_tensor_parallel_size:
        text += f" EP={lay.expert_model_parallel_size} (expert TP {lay.expert_tensor_parallel_size})"
    return text


def render(candidates, refused, best, args, usable: float) -> str:
    """The table (``rich`` when installed, else plain text), the refused layouts and the recommendation."""
    keep = [i for i, k in enumerate(COLUMNS) if args.rollout_tp or k not in ("rollout_weights", "kv_cache")]
    moe = any(c.layout.expert_tensor_parallel_size for c in candidates)
    head = ("TP", "PP", "CP", "DP", *(("EP",) if moe else ()), *(HEADERS[i] for i in keep), "total", "fits")
    rows = []
    for c in candidates:
        lay, m = c.layout, c.memory.as_dict()
        mark = "<- recommended" if c is best else ("yes" if c.fits else "no")
        rows.append((str(lay.tensor_model_parallel_size), str(lay.pipeline_model_parallel_size),
                     str(lay.context_parallel_size), str(lay.data_parallel_size),
                     *((str(lay.expert_model_parallel_size),) if moe else ()),
                     *(_gib(m[COLUMNS[i]]) for i in keep), _gib(c.memory.total), mark))
    title = (f"{args.model}: {args.nodes} x {args.gpus_per_node} GPUs x {args.gpu_memory_gib:g} GiB, {args.dtype}, "
             f"micro-batch {args.micro_batch_size} x {args.seq_length} tokens, distributed optimizer "
             f"{'on' if args.distributed_optimizer else 'off'}; GiB per GPU (largest pipeline stage), "
             f"usable {usable / 2**30:.1f} GiB ({args.headroom:.0%} headroom)")
    try:
        from io import StringIO

        from rich.console import Console
        from rich.table import Table

        table = Table()
        for h in head:
            table.add_column(h, justify="right")
        for r in rows:
            table.add_row(*r)
        buf = StringIO()
        Console(file=buf, width=200, color_system=None).print(table)
        text = title + "\n" + buf.getvalue()
    except ImportError:
        widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(head)]
        lines = [title, "  ".join(h.rjust(w) for h, w in zip(head, widths))]
        lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
        text = "\n".join(lines) + "\n"
    if refused:
        text += "refused:\n" + "".join(f"  TP={r.tp} PP={r.pp} CP={r.cp}{f' EP={r.ep}' if r.ep > 1 else ''}: "
                                        f"{r.reason}\n" for r in refused)
    return text


def main(argv=None):
    """Print the plan; return ``(candidates, refused, recommended)`` (see :func:`parallel.plan.plan`)."""
    args = parse_args(argv)
    dims = model_dims(args.hf_config)
    rollout = (RolloutPlan(args.rollout_tp, args.kv_cache_tokens, args.dtype) if args.rollout_tp else None)
    kw = dict(nodes=args.nodes, gpus_per_node=args.gpus_per_node, gpu_memory_bytes=int(args.gpu_memory_gib * GiB),
              headroom=args.headroom, dtype=args.dtype, micro_batch_size=args.micro_batch_size,
              seq_length=args.seq_length, num_microbatches=args.num_microbatches, rollout=rollout,
              sequence_parallel=args.sequence_parallel, cp_comm_type=args.cp_comm_type,
              virtual_pipeline_size=args.virtual_pp, lora_rank=args.lora_rank)
    candidates, refused = plan(dims, distributed_optimizer=args.distributed_optimizer, **kw)
    best = recommend(candidates)
    usable = (1 - args.headroom) * args.gpu_memory_gib * GiB
    print(render(candidates, refused, best, args, usable), end="")
    if best is None:
        smallest = min((c.memory.total for c in candidates), default=0)
        print(f"no layout fits: the smallest needs {smallest / GiB:.1f} GiB per GPU of {usable / GiB:.1f} usable; "
              "try --distributed-optimizer, a smaller --micro-batch-size or --seq-length, or more --nodes")
    else:
        lay = best.layout
        print(f"recommended: {_describe(lay)}{' (sequence parallel)' if lay.sequence_parallel else ''}, "
              f"{best.memory.total / GiB:.1f} GiB per GPU\nrule: {RULE}")
    if not args.distributed_optimizer:
        alt = recommend(plan(dims, distributed_optimizer=True, **kw)[0])
        if alt is not None and (best is None or alt.layout.data_parallel_size > best.layout.data_parallel_size):
            print(f"with --distributed-optimizer: {_describe(alt.layout)}, {alt.memory.total / GiB:.1f} GiB per GPU")
    return candidates, refused, best


if __name__ == "__main__":
    main()
