"""Rollouts from Megatron-Core's own inference engine on the policy's own shards.

No second copy of the weights and no weight sync: the engine runs the trainer's ``GPTModel``
(``megatron.core.inference``: ``GPTInferenceWrapper`` + ``TextGenerationController`` +
``StaticInferenceEngine``, its KV cache in a ``StaticInferenceContext``), so every sample comes
from the weights being trained (NeMo-RL's and Megatron-LM's RL offer the same). It also runs
where vLLM cannot be installed. On CPU it needs one shim more than training
(``torch.cuda.Event`` timing, :mod:`parallel.cpu_compat`).

Two behaviours of megatron-core 0.16.1 are corrected here:

- its returned logprobs are ``log_softmax(logits)`` at temperature 1, in the logits' dtype
  (the temperature only scales a copy for sampling): the wrapper returns fp32 logits already
  divided by the temperature and the controller samples at temperature 1, so samples and
  logprobs are of ``softmax(logits / T)``, the distribution the trainer differentiates
  (vLLM's ``processed_logprobs``, verl's convention);
- ``StaticInferenceEngine.generate`` re-seeds the global torch RNG (seed 1234 unless given)
  on every call, which would repeat the same samples at every step: the engine is built with
  the re-seed turned off.
- a sequence that stops at the termination token comes back without it (and without its
  logprob), where vLLM returns it as the last response token, the one whose logprob teaches the
  policy to stop: generation runs with no termination token and each response is cut after
  its first EOS here (a batch decodes until its longest member is done either way).

Not yet here: tensor/pipeline parallel generation (every rank of a model replica would have
to generate the same prompts), sleep/wake of the KV cache.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from alignment.rollout.base import Sample, SamplingConfig


class _IdsTokenizer:
    """What the controller needs of a tokenizer, for prompts given as token ids. Its ``eod`` is
    -1, a token that never comes: the controller stops at ``eod`` (see the module docstring)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.hf, self.eod, self.bos, self.vocab_size = tokenizer, -1, None, vocab_size

    def tokenize(self, prompt: list[int]) -> list[int]:
        return list(prompt)

    def detokenize(self, ids, **_) -> str:
        ids = ids.tolist() if torch.is_tensor(ids) else list(ids)
        return self.hf.decode(ids, skip_special_tokens=True) if self.hf is not None else ""

    def offsets(self, ids, text) -> list[int]:
        return list(range(len(ids)))


def _temperature_wrapper(model, config, context, vocab_size: int):
    """A ``GPTInferenceWrapper`` whose last-stage logits are fp32, divided by ``.temperature``,
    and ``-inf`` on Megatron's padding columns (ids >= ``vocab_size``), so that neither sampling
    nor the logprobs' normaliser sees tokens the model does not have."""
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper

    class TemperatureScaled(GPTInferenceWrapper):
        temperature = 1.0

        def _forward(self, inference_input):
            out = super()._forward(inference_input)
            if not getattr(self.model, "post_process", True):
                return out  # an earlier pipeline stage: hidden states
            logits = out.float() / self.temperature
            logits[..., vocab_size:] = float("-inf")
            return logits

    return TemperatureScaled(model, config, context)


class MegatronEngine:
    """``rollout.backend=megatron``: generation with Megatron-Core's inference engine on the
    trainer's own model (TP = PP = 1 for now).

    Args:
        model: the policy's ``GPTModel`` (unwrapped from DDP) on this rank.
        tokenizer: the HF tokenizer (decodes ``Sample.text``), or None.
        eos_token_id: generation stops at this token (kept as the last response token, as vLLM
            returns it).
        vocab_size: the tokenizer's vocabulary size (the HF config's; Megatron pads the model's).
        max_model_len: longest prompt + response, tokens (the KV cache's length).
        max_batch_size: most sequences generated at once (the KV cache's batch).
    """

    def __init__(self, model, tokenizer, *, eos_token_id: int, vocab_size: int, max_model_len: int = 1024,
                 max_batch_size: int = 64):
        from megatron.core.inference.contexts import StaticInferenceContext
        from megatron.core.inference.engines.static_engine import StaticInferenceEngine
        from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig
        from megatron.core.inference.text_generation_controllers.text_generation_controller import (
            TextGenerationController,
        )

        self.model, self.tokenizer, self.eos_token_id = model, tokenizer, eos_token_id
        self.max_model_len, self.max_batch_size = max_model_len, max_batch_size
        config = InferenceWrapperConfig(hidden_size=model.config.hidden_size, params_dtype=model.config.params_dtype,
                                        inference_batch_times_seqlen_threshold=-1, padded_vocab_size=model.vocab_size,
                                        inference_max_requests=max_batch_size, inference_max_seq_length=max_model_len)
        self.wrapper = _temperature_wrapper(model, config, StaticInferenceContext(max_batch_size, max_model_len),
                                            vocab_size)
        controller = TextGenerationController(self.wrapper, _IdsTokenizer(tokenizer, vocab_size))
        self.engine = StaticInferenceEngine(controller, max_batch_size=max_batch_size, legacy=True)
        self.engine.random_seed = None  # see the module docstring: no global re-seed per call

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Sample]]:
        """``sampling.n`` samples for each prompt (token ids), with the sampled tokens' logprobs
        (nats, of ``softmax(logits / temperature)``; temperature 0 is greedy, logprobs at T=1).

        Raises:
            ValueError: a prompt plus ``sampling.max_tokens`` longer than ``max_model_len``, or
                ``sampling.top_p`` outside ``(0, 1]``.
        """
        from megatron.core.inference.sampling_params import SamplingParams

        if not 0 < sampling.top_p <= 1:
            raise ValueError(f"top_p={sampling.top_p}: must be in (0, 1]")
        longest = max((len(p) for p in prompts), default=0) + sampling.max_tokens
        if longest > self.max_model_len:
            raise ValueError(f"a prompt of {longest - sampling.max_tokens} tokens + max_tokens={sampling.max_tokens} "
                             f"exceeds max_model_len={self.max_model_len}")
        if not prompts:
            return []
        greedy = sampling.temperature == 0
        self.wrapper.temperature = 1.0 if greedy else sampling.temperature
        params = SamplingParams(temperature=1.0, top_k=1 if greedy else 0,
                                top_p=0.0 if greedy or sampling.top_p == 1 else sampling.top_p,
                                num_tokens_to_generate=sampling.max_tokens, return_log_probs=True,
                                termination_id=-1)  # never: responses are cut after their first EOS below
        rows = [list(p) for p in prompts for _ in range(sampling.n)]
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                requests = []
                for start in range(0, len(rows), self.max_batch_size):
                    requests += self.engine.generate(prompts=rows[start:start + self.max_batch_size],
                                                     sampling_params=params)
        finally:
            self.model.train(was_training)
        out = []
        for i, prompt in enumerate(prompts):
            samples = []
            for r in requests[i * sampling.n:(i + 1) * sampling.n]:
                ids = [int(t) for t in (r.generated_tokens.tolist() if torch.is_tensor(r.generated_tokens)
                                        else r.generated_tokens)]
                finished = self.eos_token_id in ids
                if finished:
                    ids = ids[:ids.index(self.eos_token_id) + 1]
                logprobs = [float(x) for x in (r.generated_log_probs or [])][:len(ids)]
                text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""
                samples.append(Sample(list(prompt), ids, logprobs, text, finished))
            out.append(samples)
        return out

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Nothing to load: the engine runs the trainer's parameters."""

    def load_resharded(self, buckets) -> dict:
        """Nothing to load (see :meth:`update_weights`); returns ``{"load_s", "names"}`` as
        :meth:`alignment.rollout.vllm_engine.VLLMEngine.load_resharded` does."""
        t0 = time.perf_counter()
        return {"load_s": time.perf_counter() - t0, "names": []}

    def close(self) -> None:
        """Drop the engine and its KV cache."""
        self.engine = self.wrapper = None
