"""An LLM as judge (``reward.functions: [{name: judge, url: http://host:8000/v1, template: ...,
parse: number}]``, or ``model: /path/to/hf_dir`` without a url): each response is put into
``template`` and sent to the judge, and the score is read from its reply. The judge is an
OpenAI-compatible chat endpoint (``vllm serve``, TGI, a hosted API) reached with the ``openai``
client, or a model run by vLLM inside the job (:mod:`alignment.rewards.judge_models`).

Two modes:

* ``pointwise`` (default): one reply per response. ``template`` holds ``{prompt}`` (the question, or
  the chat's last user message), ``{completion}`` (required) and ``{reference}`` (the reference
  answer, "" without one); default :data:`TEMPLATE`. ``parse``: ``number``: the last number of the
  reply, clipped to ``score_range`` (``[0, 10]``) and scaled to [0, 1]; ``verdict``: the first of
  ``verdicts``' words the reply holds (whole words, any case; default ``{"correct": 1.0,
  "incorrect": 0.0}``, ``incorrect`` looked for first).
* ``pairwise``: the responses to one prompt (a group, sampled together) are compared two by two, as
  in online AI feedback (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback",
  Sec. 3) and MT-Bench's pairwise judge (Zheng et al. 2023, Sec. 3.1: both orders, to cancel the
  judge's position bias). ``template`` holds ``{completion_a}`` and ``{completion_b}`` (default
  :data:`PAIR_TEMPLATE`); ``pair_verdicts`` maps the reply's marks to how much A is preferred
  (default ``[[A]]`` 1, ``[[B]]`` 0, ``[[C]]`` 0.5: the first mark in the reply counts). With
  ``swap`` (default) each pair is judged in both orders. A response's score is the mean preference
  it won over its group's other responses, in [0, 1]: with two samples per prompt, online DPO's
  best and worst are exactly the judge's chosen and rejected.

A reply without a score scores None (the function does not apply; ``reward/<name>/scored`` logs the
fraction scored). Other settings: ``model`` (an endpoint's model name, default its first; without
``url`` the judge's HF directory), ``api_key_env`` (default ``OPENAI_API_KEY``, ``EMPTY`` when
unset), ``max_tokens`` (64), ``timeout_s`` (60), ``max_retries`` (3: the client's own, with
backoff), ``concurrency`` (8 requests at once), ``on_error`` (``stop`` | ``skip``, as a reward
server's: :mod:`alignment.rewards.remote`); for a judge in the job ``max_model_len`` (2048),
``kv_cache_gib`` (0.5, CPU), ``gpu_memory_utilization`` (0.2, GPU) and ``dtype`` (``float32``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from itertools import combinations
from pathlib import Path

from alignment.data.tasks import Problem
from alignment.models.hf_assets import is_hub_id
from alignment.rewards.judge_models import Endpoint, backend
from alignment.rewards.remote import FAILURES, ON_ERROR
from alignment.data.samples import Sample

__all__ = ["TEMPLATE", "PAIR_TEMPLATE", "SETTINGS", "check_settings", "render", "parse_score", "parse_preference",
           "judge_scores", "compare", "probe_judge"]

TEMPLATE = ("You are grading an answer.\nQuestion: {prompt}\nReference answer: {reference}\nAnswer to grade: "
            "{completion}\nIs the answer correct? Reply with one word: correct or incorrect.")
PAIR_TEMPLATE = ("Which answer to the question is better?\nQuestion: {prompt}\nReference answer: {reference}\n"
                 "[Answer A]\n{completion_a}\n[Answer B]\n{completion_b}\n"
                 "Reply [[A]] if answer A is better, [[B]] if answer B is better, [[C]] for a tie.")
SETTINGS = {"url": "", "model": "", "mode": "pointwise", "template": "", "parse": "verdict", "score_range": [0, 10],
            "verdicts": {"incorrect": 0.0, "correct": 1.0}, "pair_verdicts": {"[[A]]": 1.0, "[[B]]": 0.0, "[[C]]": 0.5},
            "swap": True, "api_key_env": "OPENAI_API_KEY", "max_tokens": 64, "timeout_s": 60.0, "max_retries": 3,
            "concurrency": 8, "on_error": "stop", "max_model_len": 2048, "kv_cache_gib": 0.5,
            "gpu_memory_utilization": 0.2, "dtype": "float32"}
MODES = ("pointwise", "pairwise")
PARSERS = ("number", "verdict")
_FIELDS_OF = {"pointwise": ({"completion"}, {"prompt", "completion", "reference"}),
              "pairwise": ({"completion_a", "completion_b"}, {"prompt", "completion_a", "completion_b", "reference"})}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_FIELDS = re.compile(r"{(\w*)}")


def settings_of(settings: dict) -> dict:
    """``settings`` over :data:`SETTINGS`, with the mode's default template."""
    s = {**SETTINGS, **settings}
    s["template"] = s["template"] or (PAIR_TEMPLATE if s["mode"] == "pairwise" else TEMPLATE)
    return s


def check_settings(name: str, settings: dict) -> None:
    """A judge entry's settings: a URL or a local HF directory, a template with the mode's completion
    fields and only known fields, a known parser with a usable range or verdicts.

    Raises:
        ValueError: naming the setting and the fix.
    """
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ValueError(f"reward.functions[{name}].kwargs has {unknown}; a judge takes {', '.join(SETTINGS)}")
    s = settings_of(settings)
    if s["mode"] not in MODES:
        raise ValueError(f"reward.functions[{name}].mode={s['mode']!r}: valid values are {', '.join(MODES)}")
    if s["url"] and not str(s["url"]).startswith(("http://", "https://")):
        raise ValueError(f"reward.functions[{name}].url={s['url']!r}: give the judge's OpenAI-compatible "
                         "endpoint, e.g. http://localhost:8000/v1 (vllm serve MODEL)")
    if not s["url"] and not (Path(str(s["model"])) / "config.json").is_file() and not is_hub_id(str(s["model"])):
        raise ValueError(f"reward.functions[{name}]: give the judge's url (an OpenAI-compatible endpoint, e.g. "
                         "http://localhost:8000/v1) or model: an HF model directory or Hub id to run in the job"
                         + (f" ({s['model']} has no config.json)" if s["model"] else ""))
    fields = set(_FIELDS.findall(s["template"]))
    needed, allowed = _FIELDS_OF[s["mode"]]
    if needed - fields:
        raise ValueError(f"reward.functions[{name}].template has no {', '.join('{' + f + '}' for f in sorted(needed - fields))}"
                         ": the judge would never see the answer; write it into the template")
    if fields - allowed:
        raise ValueError(f"reward.functions[{name}].template names {sorted(fields - allowed)}; a {s['mode']} "
                         f"template may use {', '.join('{' + f + '}' for f in sorted(allowed))}")
    if s["parse"] not in PARSERS:
        raise ValueError(f"reward.functions[{name}].parse={s['parse']!r}: valid values are {', '.join(PARSERS)}")
    low, high = (list(s["score_range"]) + [None, None])[:2]
    if s["parse"] == "number" and not (isinstance(low, (int, float)) and isinstance(high, (int, float)) and low < high):
        raise ValueError(f"reward.functions[{name}].kwargs.score_range={s['score_range']}: give [low, high], low < high")
    for key in ("verdicts", "pair_verdicts"):
        if not (s[key] and all(isinstance(v, (int, float)) for v in s[key].values())):
            raise ValueError(f"reward.functions[{name}].kwargs.{key}={s[key]}: map words to scores, e.g. "
                             f"{SETTINGS[key]}")
    if s["on_error"] not in ON_ERROR:
        raise ValueError(f"reward.functions[{name}].on_error={s['on_error']!r}: valid values are "
                         f"{', '.join(ON_ERROR)}")


def render(template: str, problem: Problem, completion: str = "", completion_b: str | None = None) -> str:
    """``template`` with ``{prompt}``, ``{reference}`` and ``{completion}`` (or, for a pair,
    ``{completion_a}`` = ``completion`` and ``{completion_b}``) filled in; other braces are left as
    they are."""
    values = {"prompt": problem.question, "reference": problem.answer or "", "completion": completion,
              "completion_a": completion, "completion_b": completion_b}
    return _FIELDS.sub(lambda m: m.group(0) if values.get(m.group(1)) is None else values[m.group(1)], template)


def parse_score(reply: str, settings: dict) -> float | None:
    """The score of the judge's pointwise ``reply`` in [0, 1] (see the module docstring); None: none found."""
    s = settings_of(settings)
    if s["parse"] == "number":
        found = _NUMBER.findall(reply)
        if not found:
            return None
        low, high = float(s["score_range"][0]), float(s["score_range"][1])
        return (min(max(float(found[-1]), low), high) - low) / (high - low)
    words = set(re.findall(r"[a-z]+", reply.lower()))
    for word, score in s["verdicts"].items():  # in order: "incorrect" before "correct"
        if word.lower() in words:
            return float(score)
    return None


_BARE = re.compile(r"^(?:answer\s*)?\[{0,2}([ABC])\]{0,2}(?:\s+is\s+(?:the\s+)?better(?:\s+one)?)?[.!]?$", re.I)


def parse_preference(reply: str, settings: dict) -> float | None:
    """How much the pairwise ``reply`` prefers answer A, from ``pair_verdicts``: the mark found first
    in the reply (as written, any case); else, with the default marks, a line that is only the letter
    (``A``, ``[B]``, ``Answer A``, ``A is better.``: what small judges write instead); None: neither."""
    s = settings_of(settings)
    marks, text = s["pair_verdicts"], reply.lower()
    found = [(text.find(m.lower()), m) for m in marks if m.lower() in text]
    if found:
        return float(marks[min(found)[1]])
    if marks == SETTINGS["pair_verdicts"]:
        for line in reversed(reply.strip().splitlines()):
            bare = _BARE.match(line.strip())
            if bare and (bare.group(1) in "ABC"):
                return float(marks[f"[[{bare.group(1)}]]"])
    return None


def groups_of(samples: Sequence[Sample]) -> list[list[int]]:
    """Indices of the responses to one prompt: runs of consecutive samples with equal prompt ids (a
    rollout's groups are contiguous)."""
    out: list[list[int]] = []
    for i, s in enumerate(samples):
        if out and samples[out[-1][0]].prompt_ids == s.prompt_ids:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def judge_scores(name: str, problems: Sequence[Problem], samples: Sequence[Sample], settings: dict) -> list:
    """The judge's score of each sample in [0, 1] (see the module docstring). None: no score in the
    reply (``info["judge_unparsed"]``), a pairwise sample alone in its group, or a failed request: then
    the sample is marked ``info["reward_failed"]`` and, with ``on_error=stop``, the error recorded in
    :data:`alignment.rewards.remote.FAILURES`."""
    s = settings_of(settings)
    judge = backend(s)
    if s["mode"] == "pointwise":
        asks = [((i,), render(s["template"], problems[i], samples[i].text)) for i in range(len(samples))]
    else:
        pairs = [p for g in groups_of(samples) for i, j in combinations(g, 2) for p in ((i, j), (j, i))[: 1 + bool(s["swap"])]]
        asks = [((a, b), render(s["template"], problems[a], samples[a].text, samples[b].text)) for a, b in pairs]
    replies = judge.replies([[{"role": "user", "content": text}] for _, text in asks])
    won: list[list[float]] = [[] for _ in samples]
    failed: list[str] = []
    for (who, _), reply in zip(asks, replies):
        if isinstance(reply, Exception):
            for i in who:
                samples[i].info["reward_failed"] = name
            tries = f" after {int(s['max_retries']) + 1} tries" if isinstance(judge, Endpoint) else ""
            failed.append(f"reward.functions[{name}]: judge {judge.where} failed{tries}: {type(reply).__name__}: {reply}")
            continue
        value = parse_score(reply, s) if len(who) == 1 else parse_preference(reply, s)
        if value is None or not math.isfinite(value):
            for i in who:
                samples[i].info["judge_unparsed"] = True
            continue
        won[who[0]].append(value)
        if len(who) == 2:
            won[who[1]].append(1.0 - value)
    if failed and s["on_error"] == "stop":
        FAILURES.append(failed[0])
    return [None if not w or samples[i].info.get("reward_failed") == name else sum(w) / len(w)
            for i, w in enumerate(won)]


def compare(settings: dict, problems: Sequence[Problem], a: Sequence[str], b: Sequence[str]) -> list:
    """For each problem, how much the judge prefers answer ``a[i]`` to ``b[i]`` (in [0, 1]; both orders
    with ``swap``; None: no verdict), for win rates (``tools/evaluate.py --judge``).

    Raises:
        ValueError: lists of different lengths.
        RuntimeError: every request failed (naming the judge and the error).
    """
    if not len(problems) == len(a) == len(b):
        raise ValueError(f"{len(problems)} problems, {len(a)} and {len(b)} answers: need one pair per problem")
    samples = [Sample([k], [], [], text, True) for k in range(len(problems)) for text in (a[k], b[k])]
    before = len(FAILURES)
    scores = judge_scores("judge", [p for p in problems for _ in (0, 1)], samples,
                          {**settings, "mode": "pairwise", "on_error": "stop"})
    if all(v is None for v in scores) and len(FAILURES) > before:
        raise RuntimeError(FAILURES.pop())
    return scores[0::2]


def probe_judge(settings: dict) -> None:
    """A judge's endpoint answers ``GET /models`` and serves ``model`` when one is named (checked once
    before training starts); a judge run in the job is checked by :func:`check_settings`.

    Raises:
        openai.APIError and its kin: the endpoint does not answer.
        ValueError: it does not serve the model named.
    """
    s = settings_of({**settings, "max_retries": 0})
    if s["url"]:
        Endpoint(s).probe()
