"""A reward server over HTTP (``reward.functions: [{name: http, url: ..., batch_size: 64, timeout_s: 30,
max_retries: 3, on_error: stop}]``), as OpenRLHF's ``--remote_rm_url`` and slime's ``--rm-url``: the
responses are posted in batches of ``batch_size`` as JSON and the server answers one score each.

Request (``POST url``, ``Content-Type: application/json``)::

    {"prompts": [str | [messages]], "completions": [str], "completion_ids": [[int]],
     "columns": {"answer": [...], ...}}

Answer: ``{"scores": [float | null, ...]}`` (``"rewards"`` is read too, or a bare list), one per
completion; null: the server does not score that sample (TRL's None).

Authentication: ``kwargs: {api_key_env: MY_KEY}`` sends ``Authorization: Bearer <$MY_KEY>``;
``kwargs: {headers: {X-Api-Key: ..., ...}}`` sends any headers (a value may be read from the environment in
YAML: ``${oc.env:MY_KEY}``). Both are checked at start: the variable set, the headers strings.

A request that fails (no connection, no answer within ``timeout_s``, a 5xx status, an answer that is
not JSON or has the wrong number of scores) is retried ``max_retries`` times with exponential backoff
(0.5 s, 1 s, 2 s, ...). A 4xx status is not retried: the request itself is wrong. A sample never
silently scores 0: when the retries are spent the batch's samples are marked failed
(``Sample.info["reward_failed"]``, score None); with ``on_error=stop`` the error is also recorded
(:data:`FAILURES`) and the RL loop, which asks every rank after each collection, saves a checkpoint
and stops with the URL and the error (:class:`RewardServerError`); with ``on_error=skip`` the failed
samples' groups leave the update (:func:`alignment.trainers.rewarding.drop_failed_groups`) and are
counted.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from alignment.data.tasks import Problem
from alignment.data.samples import Sample

__all__ = ["RewardServerError", "FAILURES", "take_failures", "SETTINGS", "ON_ERROR", "check_settings", "post_scores",
           "probe", "http_scores"]

#: an ``http`` entry's settings and their defaults
SETTINGS = {"url": "", "batch_size": 64, "timeout_s": 30.0, "max_retries": 3, "on_error": "stop", "headers": {},
            "api_key_env": ""}
ON_ERROR = ("stop", "skip")
BACKOFF_S = 0.5
CONCURRENT_REQUESTS = 8


class RewardServerError(RuntimeError):
    """A reward server that failed after its retries; the message names the URL and the error."""


#: this process's reward-server errors with ``on_error=stop`` since the loop last looked
#: (:func:`take_failures`); appended from the request threads
FAILURES: list[str] = []


def take_failures() -> list[str]:
    """The errors recorded since the last call, emptied."""
    out = list(FAILURES)
    del FAILURES[: len(out)]
    return out


def check_settings(name: str, settings: dict) -> None:
    """An ``http`` entry's settings: a ``http(s)://`` url, positive sizes, a known ``on_error``.

    Raises:
        ValueError: naming the setting and what is valid.
    """
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ValueError(f"reward.functions[{name}] has {unknown}; an http reward takes {', '.join(SETTINGS)}")
    s = {**SETTINGS, **settings}
    if not str(s["url"]).startswith(("http://", "https://")):
        raise ValueError(f"reward.functions[{name}].url={s['url']!r}: give the reward server's http(s):// URL")
    if int(s["batch_size"]) < 1 or float(s["timeout_s"]) <= 0 or int(s["max_retries"]) < 0:
        raise ValueError(f"reward.functions[{name}]: batch_size={s['batch_size']} must be >= 1, timeout_s="
                         f"{s['timeout_s']} > 0 and max_retries={s['max_retries']} >= 0")
    if s["on_error"] not in ON_ERROR:
        raise ValueError(f"reward.functions[{name}].on_error={s['on_error']!r}: valid values are {', '.join(ON_ERROR)}"
                         " (stop: checkpoint and stop the run; skip: leave the failed groups out of the update)")
    headers = s["headers"]
    if not isinstance(headers, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
        raise ValueError(f"reward.functions[{name}].kwargs.headers={headers!r}: give a mapping of header names to "
                         "strings, e.g. {X-Api-Key: ${oc.env:MY_KEY}}")
    if s["api_key_env"] and not os.environ.get(str(s["api_key_env"])):
        raise ValueError(f"reward.functions[{name}].kwargs.api_key_env={s['api_key_env']}: that environment variable "
                         "is not set (its value is sent as Authorization: Bearer <key>); export it before the run")


def request_headers(settings: dict) -> dict[str, str]:
    """The headers a request carries: JSON, the entry's ``headers``, and ``Authorization: Bearer`` the value of
    ``api_key_env`` when it names a variable."""
    headers = {"Content-Type": "application/json", **dict(settings.get("headers") or {})}
    if settings.get("api_key_env"):
        headers["Authorization"] = f"Bearer {os.environ.get(str(settings['api_key_env']), '')}"
    return headers


def _post(url: str, payload: dict, timeout: float, headers: dict | None = None):
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                     headers=headers or {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - the user's own server
        return json.loads(response.read().decode("utf-8"))


def _scores(answer, n: int) -> list:
    values = answer.get("scores", answer.get("rewards")) if isinstance(answer, dict) else answer
    if not isinstance(values, list) or len(values) != n:
        got = f"{len(values)} scores" if isinstance(values, list) else f"{str(answer)[:80]!r}"
        raise ValueError(f"answered {got} for {n} completions (expected {{\"scores\": [{n} numbers or null]}})")
    return values


def post_scores(url: str, payload: dict, n: int, timeout: float, max_retries: int, headers: dict | None = None) -> list:
    """The ``n`` scores the server at ``url`` gives ``payload``, with up to ``max_retries`` retries
    (exponential backoff from :data:`BACKOFF_S`).

    Raises:
        RewardServerError: the last error after the retries, or at once on a 4xx status.
    """
    error = ""
    for attempt in range(max_retries + 1):
        if attempt:
            time.sleep(BACKOFF_S * 2 ** (attempt - 1))
        try:
            return _scores(_post(url, payload, timeout, headers), n)
        except urllib.error.HTTPError as e:
            error = f"HTTP {e.code} {e.reason}"
            if 400 <= e.code < 500:
                break
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
            reason = getattr(e, "reason", e)
            error = f"no answer within {timeout:g} s" if isinstance(reason, TimeoutError) or "timed out" in str(
                reason) else f"{type(reason).__name__}: {reason}"
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            error = f"an answer that is not JSON ({e})"
        except ValueError as e:
            error = str(e)
    tries = attempt + 1
    raise RewardServerError(f"reward server {url} failed after {tries} tr{'y' if tries == 1 else 'ies'}: {error}")


def probe(url: str, timeout: float, headers: dict | None = None) -> None:
    """One empty batch to the server (checked once before training starts), with the entry's ``headers``.

    Raises:
        RewardServerError: the server cannot be reached, refuses the request (a 401 without the right key) or
            does not answer ``{"scores": []}``.
    """
    post_scores(url, {"prompts": [], "completions": [], "completion_ids": [], "columns": {}}, 0, timeout, 0, headers)


def http_scores(name: str, problems: Sequence[Problem], samples: Sequence[Sample], columns: Sequence[dict],
                settings: dict) -> list:
    """Scores of ``samples`` from the entry's server, in batches posted side by side (at most
    :data:`CONCURRENT_REQUESTS` at once). ``columns[i]``: sample ``i``'s data columns. A batch that
    failed after its retries scores None and its samples are marked (``info["reward_failed"] =
    name``); with ``on_error=stop`` its error goes to :data:`FAILURES`."""
    s = {**SETTINGS, **settings}
    size = int(s["batch_size"])

    def payload(lo: int, hi: int) -> dict:
        keys = sorted({k for c in columns[lo:hi] for k in c})
        return {"prompts": [list(problems[i].messages) if problems[i].messages is not None else problems[i].question
                            for i in range(lo, hi)],
                "completions": [samples[i].text for i in range(lo, hi)],
                "completion_ids": [list(samples[i].response_ids) for i in range(lo, hi)],
                "columns": {k: [columns[i].get(k) for i in range(lo, hi)] for k in keys}}

    def one(lo: int):
        hi = min(lo + size, len(samples))
        try:
            return post_scores(s["url"], payload(lo, hi), hi - lo, float(s["timeout_s"]), int(s["max_retries"]),
                               request_headers(s))
        except RewardServerError as e:
            if s["on_error"] == "stop":
                FAILURES.append(f"reward.functions[{name}]: {e}")
            for i in range(lo, hi):
                samples[i].info["reward_failed"] = name
            return [None] * (hi - lo)

    starts = range(0, len(samples), size)
    with ThreadPoolExecutor(max_workers=min(CONCURRENT_REQUESTS, max(1, len(starts)))) as pool:
        return [v for part in pool.map(one, starts) for v in part]
