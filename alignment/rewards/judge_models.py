"""Where a judge's replies come from (:mod:`alignment.rewards.judge`): an OpenAI-compatible endpoint
spoken to with the ``openai`` client, or a model run by vLLM inside the job.

* :class:`Endpoint`: ``url`` (``vllm serve``, TGI, a hosted API), up to ``concurrency`` requests at
  once, the client's own retries with backoff.
* :class:`LocalJudge`: ``model`` an HF directory (any family vLLM runs) and no ``url``. Each process
  builds one frozen engine per judge model, the first time it judges, and keeps it for the run
  (:func:`close_local` shuts them down); between judging phases the engine is put to sleep
  (:meth:`alignment.rollout.engines.vllm_engine.VLLMEngine.sleep`, which frees nothing yet: its weights and
  KV cache stay resident). Messages are rendered with the judge's own chat template and generated
  greedily in one batch.

Both answer :meth:`replies`: one reply (or the exception that replaced it) per message list.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from alignment.data.chat_data import encode_prompt
from alignment.models.hf_assets import prepare_hf_dir
from alignment.data.samples import SamplingConfig
from alignment.rollout.engines.vllm_engine import VLLMEngine

__all__ = ["Endpoint", "LocalJudge", "backend", "close_local"]

_LOCAL: dict[tuple, "LocalJudge"] = {}


class Endpoint:
    """An OpenAI-compatible chat endpoint (``s``: the judge's settings: ``url``, ``model`` (default: the
    endpoint's first), ``api_key_env``, ``timeout_s``, ``max_retries``, ``concurrency``, ``max_tokens``)."""

    def __init__(self, s: dict):
        from openai import OpenAI

        self.s = s
        self.client = OpenAI(base_url=s["url"], api_key=os.environ.get(s["api_key_env"]) or "EMPTY",
                             timeout=float(s["timeout_s"]), max_retries=int(s["max_retries"]))
        self.where = s["url"]

    def replies(self, conversations: list[list[dict]]) -> list:
        """One reply per chat (a list of ``{role, content}`` messages), asked at temperature 0 with
        ``max_tokens``; a request that fails after the client's retries gives its exception instead
        (never raised)."""
        try:
            model = self.s["model"] or self.client.models.list().data[0].id
        except Exception as e:  # noqa: BLE001 - every request would fail alike
            return [e] * len(conversations)

        def one(messages):
            try:
                out = self.client.chat.completions.create(model=model, messages=messages, temperature=0.0,
                                                          max_tokens=int(self.s["max_tokens"]))
                return out.choices[0].message.content or ""
            except Exception as e:  # noqa: BLE001 - the client's errors after its own retries
                return e

        with ThreadPoolExecutor(max_workers=max(1, int(self.s["concurrency"]))) as pool:
            return list(pool.map(one, conversations))

    def probe(self) -> None:
        """Raises ``openai`` errors when the endpoint does not answer ``GET /models``, ValueError when it
        does not serve ``model``."""
        served = [m.id for m in self.client.models.list().data]
        if self.s["model"] and self.s["model"] not in served:
            raise ValueError(f"it serves {served}, not model={self.s['model']!r}")
        if not served:
            raise ValueError("it serves no model")


class LocalJudge:
    """A judge model in this process: a :class:`alignment.rollout.engines.vllm_engine.VLLMEngine` on the HF
    directory ``s["model"]`` with ``max_model_len``, ``kv_cache_gib`` (CPU), ``gpu_memory_utilization``
    (GPU) and ``dtype`` from the settings; its weights never change."""

    def __init__(self, s: dict):
        from transformers import AutoTokenizer

        self.s, self.where = s, s["model"]
        model = str(prepare_hf_dir(s["model"], field="reward.functions[judge].model"))  # a Hub id: its snapshot
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.engine = VLLMEngine(model, max_model_len=int(s["max_model_len"]), kv_cache_gib=float(s["kv_cache_gib"]),
                                 gpu_memory_utilization=float(s["gpu_memory_utilization"]), dtype=s["dtype"], seed=0)
        self.engine.sleep()

    def replies(self, conversations: list[list[dict]]) -> list:
        """One greedy reply per chat, all generated in one batch; a chat longer than ``max_model_len -
        max_tokens`` tokens gives a ValueError (naming the fix) instead (never raised)."""
        room = int(self.s["max_model_len"]) - int(self.s["max_tokens"])
        ids = [encode_prompt(self.tokenizer, m) for m in conversations]
        out: list = [ValueError(f"the judge's prompt has {len(x)} tokens; the judge allows {room} "
                                "(raise its max_model_len, or shorten the template)") if len(x) > room else None
                     for x in ids]
        todo = [i for i, x in enumerate(out) if x is None]
        if todo:
            self.engine.wake()
            try:
                groups = self.engine.generate([ids[i] for i in todo], SamplingConfig(
                    n=1, temperature=0.0, max_tokens=int(self.s["max_tokens"])))
            finally:
                self.engine.sleep()
            for i, group in zip(todo, groups):
                out[i] = group[0].text
        return out


def backend(s: dict):
    """The judge's reply source for settings ``s``: :class:`Endpoint` with a ``url``, else this process's
    :class:`LocalJudge` on ``model`` (built once)."""
    if s["url"]:
        return Endpoint(s)
    key = (str(Path(s["model"]).resolve()), s["max_model_len"], s["kv_cache_gib"], s["dtype"])
    if key not in _LOCAL:
        _LOCAL[key] = LocalJudge(s)
    judge = _LOCAL[key]
    judge.s = s
    return judge


def close_local() -> None:
    """Shut down this process's judge engines (before its process groups are destroyed)."""
    while _LOCAL:
        _LOCAL.popitem()[1].engine.close()
