"""One checkpoint's answers to evaluation suites: its vLLM engine generates every suite (greedy, and
``samples`` sampled episodes per reasoning problem), each suite's results a JSON-able dict of
metrics and per-item records (:func:`run_suite`). Reasoning suites run through the training code
itself: the job's environment (:func:`alignment.rollout.episodes.multi_turn.episode_setup`), its episodes
(:func:`alignment.rollout.episodes.multi_turn.run_episodes`) and its grading
(:mod:`alignment.rewards.grading`).
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

from alignment.data.chat_data import encode_prompt
from alignment.data.prompts import prompt_messages
from alignment.data.tasks import Problem, score_response
from alignment.evaluation import metrics, suites
from alignment.rewards import grading
from alignment.rewards.code_runs import early_grading
from alignment.data.samples import SamplingConfig
from alignment.rollout.episodes.multi_turn import episode_setup, run_episodes


@dataclass(frozen=True)
class Settings:
    """What changes a suite's answers besides the weights: ``samples`` sampled episodes per
    reasoning problem at ``temperature`` (1: greedy only), the engine ``seed``, weights ``dtype``,
    ``limit`` (the first items of each suite; None: all), vLLM's ``tensor_parallel_size``, the
    ``regression_file``."""

    samples: int = 4
    temperature: float = 0.7
    seed: int = 0
    dtype: str = "bfloat16"
    limit: int | None = None
    tensor_parallel_size: int = 1
    regression_file: str | None = None

    def key(self, suite: suites.Suite) -> dict:
        """The settings that matter to ``suite`` (the cache key's part)."""
        out = asdict(self)
        if suite.kind != "regression":
            out.pop("regression_file")
        else:
            out["regression_file"] = suites.file_digest(self.regression_file)
        if suite.kind != "reasoning":
            out.pop("samples"), out.pop("temperature")
        return out


def _seed(settings: Settings, suite: suites.Suite) -> None:
    """Reseed the sampler before a suite's sampled episodes (the in-process vLLM engine draws from
    torch's generator), so a suite's samples do not depend on which suites ran before it."""
    import torch

    torch.manual_seed(int.from_bytes(hashlib.sha256(f"{settings.seed}:{suite.name}".encode()).digest()[:4], "little"))


def _reasoning(engine, hf_dir, suite, settings: Settings) -> dict:
    cfg = suites.suite_config(suite)
    problems = suites.problems(suite, cfg, settings.limit)
    setup = episode_setup(cfg, hf_dir, engine.tokenizer)
    max_tokens = suite.max_tokens or cfg.rollout.eval_max_tokens

    def graded(n: int, temperature: float):  # code answers start running as soon as they are generated
        sampling = SamplingConfig(n=n, temperature=temperature, max_tokens=max_tokens)
        with early_grading([grading.CORRECTNESS.runs], problems) as (pool, on_done):
            groups = run_episodes(engine.generate, setup.env, problems, setup.turns, sampling, setup.max_turns,
                                  max_tokens_per_turn=setup.max_tokens_per_turn, on_done=on_done)
            return groups, grading.grade(problems, groups, max_tokens, pool=pool)

    greedy, right = graded(1, 0.0)
    out = {"accuracy": grading.rates(grading.counts(problems, greedy, right, 1), 1)["pass@1"]}
    multi_turn = cfg.rollout.environment != "single_turn"
    if multi_turn:
        out["tool_call_rate"] = sum(g[0].info.get("tool_calls", 0) > 0 for g in greedy) / max(len(greedy), 1)
    if settings.samples > 1:
        _seed(settings, suite)
        sampled, sampled_right = graded(settings.samples, settings.temperature)
        rates = grading.rates(grading.counts(problems, sampled, sampled_right, settings.samples), settings.samples)
        rates["sampled_tool_call_rate"] = rates.pop("tool_call_rate")
        out.update(rates if multi_turn else {k: v for k, v in rates.items() if "tool" not in k})
    lengths = [g[0].generated_tokens for g in greedy]
    out["mean_length"] = sum(lengths) / max(len(lengths), 1)
    items = [{"correct": r[0], "text": g[0].text} for r, g in zip(right, greedy)]
    return {"metrics": out, "items": items}


def _greedy_chat(engine, prompts: list[list[dict]], max_tokens: int, max_model_len: int):
    """Greedy answers to chat ``prompts``; a prompt that leaves no room for ``max_tokens`` in
    ``max_model_len`` is skipped (counted in ``skipped``)."""

    ids = [encode_prompt(engine.tokenizer, m) for m in prompts]
    keep = [i for i, x in enumerate(ids) if len(x) + max_tokens <= max_model_len]
    outs = engine.generate([ids[i] for i in keep], SamplingConfig(n=1, temperature=0.0, max_tokens=max_tokens))
    return keep, [o[0] for o in outs]


def _regression_pass(item: dict, text: str) -> bool:
    if item["match"] == "contains":
        return item["answer"].lower() in text.lower()

    return score_response(Problem(item["question"], str(item["answer"]), "gsm8k"), text) == 1.0


def run_suite(engine, hf_dir, suite: suites.Suite, settings: Settings, max_model_len: int) -> dict:
    """``suite``'s results for the checkpoint ``engine`` runs: ``{"metrics": {...}, "items": [...]}``.

    Reasoning: ``accuracy`` (greedy), ``pass@1``, ``pass@k``, ``maj@k`` of ``settings.samples``
    episodes, ``mean_length`` (generated tokens), tool-call rates in multi-turn environments; items:
    each problem's greedy answer and grade. Behaviour: :func:`alignment.evaluation.metrics.behaviour`
    of the greedy answers. Preference: the greedy answers (judged later against another
    checkpoint's). Regression: ``pass_rate``; items: each ``id`` and whether it passed.
    """
    if suite.kind == "reasoning":
        return _reasoning(engine, hf_dir, suite, settings)
    if suite.kind == "regression":
        items = suites.regression_items(settings.regression_file, settings.limit)
        prompts = [prompt_messages(Problem(i["question"], "", i["task"])) if i.get("task") else
                   [{"role": "user", "content": i["question"]}] for i in items]
        keep, samples = _greedy_chat(engine, prompts, suite.max_tokens, max_model_len)
        texts = dict(zip(keep, (s.text for s in samples)))
        records = [{"id": it["id"], "passed": i in texts and _regression_pass(it, texts[i]), "text": texts.get(i)}
                   for i, it in enumerate(items)]
        return {"metrics": {"pass_rate": sum(r["passed"] for r in records) / len(records)}, "items": records}
    prompts = suites.chat_prompts(suite, settings.limit)
    keep, samples = _greedy_chat(engine, prompts, suite.max_tokens, max_model_len)
    lengths = [len(s.response_ids) for s in samples]
    found = metrics.behaviour([s.text for s in samples], lengths) if samples else {}
    records = [{"prompt": prompts[i], "text": s.text} for i, s in zip(keep, samples)]
    out = found if suite.kind == "behaviour" else {"mean_length": found.get("mean_length", 0.0)}
    return {"metrics": {**out, "skipped": len(prompts) - len(keep)}, "items": records}
