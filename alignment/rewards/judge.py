"""An LLM as judge (``reward.functions: [{name: judge, function: judge, kwargs: {url: http://host:8000/v1,
model: NAME, template: ..., parse: number}}]``): each response is put into ``template`` and sent to an
OpenAI-compatible chat endpoint (``vllm serve``, TGI, a hosted API) through the ``openai`` client; the
score is read from the judge's reply.

* ``template``: the judge's user message, with ``{prompt}`` (the question, or the chat's last user
  message), ``{completion}`` (required) and ``{reference}`` (the reference answer) filled in;
  default :data:`TEMPLATE`.
* ``parse``: ``number``: the last number of the reply, clipped to ``score_range`` (``[0, 10]``) and
  scaled to [0, 1]; ``verdict``: the first of ``verdicts``' words the reply holds (whole words, any
  case; default ``{"correct": 1.0, "incorrect": 0.0}``, ``incorrect`` looked for first). A reply with
  no score scores None (the function does not apply) and is counted (``judge/unparsed``).
* ``model`` (the served model's name; default the endpoint's first model), ``api_key_env`` (the
  environment variable holding the key; default ``OPENAI_API_KEY``, ``EMPTY`` when unset),
  ``max_tokens`` (64), ``timeout_s`` (60), ``max_retries`` (3: the client's own, with backoff),
  ``concurrency`` (8 requests at once), ``on_error`` (``stop`` | ``skip``, as a reward server's:
  :mod:`alignment.rewards.remote`).

Not yet: a judge model run by vLLM inside the job, and a pairwise mode for online DPO.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from alignment.data.tasks import Problem
from alignment.rewards.remote import FAILURES, ON_ERROR
from alignment.rollout.base import Sample

__all__ = ["TEMPLATE", "SETTINGS", "check_settings", "render", "parse_score", "judge_scores"]

TEMPLATE = ("You are grading an answer.\nQuestion: {prompt}\nReference answer: {reference}\nAnswer to grade: "
            "{completion}\nIs the answer correct? Reply with one word: correct or incorrect.")
SETTINGS = {"url": "", "model": "", "template": TEMPLATE, "parse": "verdict", "score_range": [0, 10],
            "verdicts": {"incorrect": 0.0, "correct": 1.0}, "api_key_env": "OPENAI_API_KEY", "max_tokens": 64,
            "timeout_s": 60.0, "max_retries": 3, "concurrency": 8, "on_error": "stop"}
PARSERS = ("number", "verdict")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_FIELDS = re.compile(r"{(\w*)}")


def check_settings(name: str, settings: dict) -> None:
    """A judge entry's settings: a URL, a template with ``{completion}`` and only known fields, a
    known parser with a usable range or verdicts.

    Raises:
        ValueError: naming the setting and the fix.
    """
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ValueError(f"reward.functions[{name}].kwargs has {unknown}; a judge takes {', '.join(SETTINGS)}")
    s = {**SETTINGS, **settings}
    if not str(s["url"]).startswith(("http://", "https://")):
        raise ValueError(f"reward.functions[{name}].url={s['url']!r}: give the judge's OpenAI-compatible "
                         "endpoint, e.g. http://localhost:8000/v1 (vllm serve MODEL)")
    fields = set(_FIELDS.findall(s["template"]))
    if "completion" not in fields:
        raise ValueError(f"reward.functions[{name}].template has no {{completion}}: the judge would never see "
                         "the answer; write it into the template")
    if fields - {"prompt", "completion", "reference"}:
        raise ValueError(f"reward.functions[{name}].template names {sorted(fields - {'prompt', 'completion', 'reference'})}"
                         "; it may use {prompt}, {completion} and {reference}")
    if s["parse"] not in PARSERS:
        raise ValueError(f"reward.functions[{name}].parse={s['parse']!r}: valid values are {', '.join(PARSERS)}")
    low, high = (list(s["score_range"]) + [None, None])[:2]
    if s["parse"] == "number" and not (isinstance(low, (int, float)) and isinstance(high, (int, float)) and low < high):
        raise ValueError(f"reward.functions[{name}].kwargs.score_range={s['score_range']}: give [low, high], low < high")
    if s["parse"] == "verdict" and not (s["verdicts"] and all(isinstance(v, (int, float)) for v in s["verdicts"].values())):
        raise ValueError(f"reward.functions[{name}].kwargs.verdicts={s['verdicts']}: map words to scores, e.g. "
                         "{correct: 1.0, incorrect: 0.0}")
    if s["on_error"] not in ON_ERROR:
        raise ValueError(f"reward.functions[{name}].on_error={s['on_error']!r}: valid values are "
                         f"{', '.join(ON_ERROR)}")


def render(template: str, problem: Problem, completion: str) -> str:
    """``template`` with ``{prompt}``, ``{completion}`` and ``{reference}`` filled in (other braces
    left as they are)."""
    values = {"prompt": problem.question, "completion": completion, "reference": problem.answer}
    return _FIELDS.sub(lambda m: values.get(m.group(1), m.group(0)), template)


def parse_score(reply: str, settings: dict) -> float | None:
    """The score of the judge's ``reply`` in [0, 1] (see the module docstring); None: none found."""
    s = {**SETTINGS, **settings}
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


def _client(s: dict):
    import os

    from openai import OpenAI

    return OpenAI(base_url=s["url"], api_key=os.environ.get(s["api_key_env"]) or "EMPTY",
                  timeout=float(s["timeout_s"]), max_retries=int(s["max_retries"]))


def judge_scores(name: str, problems: Sequence[Problem], samples: Sequence[Sample], settings: dict) -> list:
    """The judge's score of each sample (None: no score in the reply, or the request failed: then the
    sample is marked ``info["reward_failed"]`` and, with ``on_error=stop``, the error recorded in
    :data:`alignment.rewards.remote.FAILURES`); ``info["judge_unparsed"]`` marks replies without a score."""
    s = {**SETTINGS, **settings}
    client = _client(s)
    model = s["model"] or client.models.list().data[0].id
    failed: list[str] = []

    def one(i: int):
        try:
            reply = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": render(s["template"], problems[i], samples[i].text)}],
                temperature=0.0, max_tokens=int(s["max_tokens"]))
        except Exception as e:  # noqa: BLE001 - the client's errors after its own retries
            samples[i].info["reward_failed"] = name
            failed.append(f"reward.functions[{name}]: judge {s['url']} failed after {int(s['max_retries']) + 1} tries: "
                          f"{type(e).__name__}: {e}")
            return None
        score = parse_score(reply.choices[0].message.content or "", s)
        if score is None:
            samples[i].info["judge_unparsed"] = True
        return score

    with ThreadPoolExecutor(max_workers=max(1, int(s["concurrency"]))) as pool:
        out = list(pool.map(one, range(len(samples))))
    if failed and s["on_error"] == "stop":
        FAILURES.append(failed[0])
    return [v if v is None or math.isfinite(v) else None for v in out]


def probe_judge(settings: dict) -> None:
    """The judge's endpoint answers ``GET /models`` and serves ``model`` when one is named (checked once
    before training starts).

    Raises:
        openai.APIError and its kin: the endpoint does not answer.
        ValueError: it does not serve the model named.
    """
    s = {**SETTINGS, **settings, "max_retries": 0}
    served = [m.id for m in _client(s).models.list().data]
    if s["model"] and s["model"] not in served:
        raise ValueError(f"it serves {served}, not model={s['model']!r}")
    if not served:
        raise ValueError("it serves no model")
