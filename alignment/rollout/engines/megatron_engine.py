"""Rollouts from Megatron-Core's own inference engine on the policy's own shards.

No second copy of the weights and no weight sync: the engine runs the trainer's ``GPTModel``
(``megatron.core.inference``: ``GPTInferenceWrapper`` + ``TextGenerationController`` +
``StaticInferenceEngine``, its KV cache in a ``StaticInferenceContext``), so every sample comes
from the weights being trained (NeMo-RL's and Megatron-LM's RL offer the same). It also runs
where vLLM cannot be installed. On CPU it needs one shim more than training
(``torch.cuda.Event`` timing, :mod:`parallel.cpu_compat`).

Three behaviours of megatron-core 0.16.1 are corrected here:

- its returned logprobs are ``log_softmax(logits)`` at temperature 1, in the logits' dtype
  (the temperature only scales a copy for sampling): the wrapper returns fp32 logits already
  divided by the temperature and the controller samples at temperature 1, so samples and
  logprobs are of ``softmax(logits / T)``, the distribution the trainer differentiates
  (vLLM's ``processed_logprobs``, verl's convention);
- ``StaticInferenceEngine.generate`` re-seeds the global torch RNG (seed 1234 unless given)
  on every call, which would repeat the same samples at every step: the engine is built with
  the re-seed turned off;
- a sequence that stops at the termination token comes back without it (and without its
  logprob), where vLLM returns it as the last response token, the one whose logprob teaches the
  policy to stop: the controller here counts the EOS into the response before it marks the
  sequence done (and stops at any of several EOS ids); a batch stops decoding once every
  sequence has its EOS or ``max_tokens``.

The KV cache (``[max_model_len, max_batch_size, kv_heads, head_dim]`` keys and values per layer,
megatron-core allocates it at the first generation) is freed by :meth:`MegatronEngine.sleep`, so
in a colocated job it does not sit beside the training phase's activations; the next generation
allocates it again.

Tensor parallelism: every rank of a TP group runs the same prompts through its shard
(megatron-core gathers the vocabulary-parallel logits), and samples with the same seed, so the
ranks draw the same tokens (:attr:`MegatronEngine.generates_per_replica`).

Expert parallelism (a mixture-of-experts policy, TP = 1): each rank of an expert-parallel group
generates its own prompts, but every forward of its MoE layers exchanges tokens with the group's other
ranks, so they must run their forwards together although their prompts, batches and stopping points
differ. Before each forward a rank says over the group whether it has one to run (one all-reduce, as
Megatron-LM's dynamic engine agrees on a step); a rank whose generation is over runs Megatron's
one-token ``dummy_forward`` while another still has one, and leaves ``generate`` when none has.

MoE routing (``record_routing``): every forward's top-k experts per token are kept per row and
position (:class:`alignment.rollout.engines.routed_experts.GenerationRouting`) and returned as
``Sample.routed_experts`` for routing replay R3.

A vision-language model (:class:`alignment.models.vlm_model.VisionLanguageModel`) takes prompts with images
(:class:`alignment.rollout.engines.image_prompts.ImagePrompt`): every forward gets its M-RoPE positions and the image
features of its context window (:class:`alignment.rollout.engines.generation_images.GenerationImages`), and each sample keeps
its prompt's images for the trainer.

Not yet here: pipeline and context parallel generation, expert parallelism with TP > 1 (megatron-core
0.16.1 then switches the model's sequence parallelism off outside the MoE layers), and sequence
parallelism (refused outside MoE models); ``rollout.backend=megatron`` asks for PP = CP = 1, and
TP = 1 with EP > 1.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from alignment.data.samples import OnDone, Sample, SamplingConfig

from alignment.rollout.base import step_seed
from alignment.rollout.engines.decode_loop import DecodeLoop, race_sample
from alignment.rollout.engines.generation_images import GenerationImages
from alignment.rollout.engines.image_prompts import ImagePrompt, images_of
from alignment.rollout.engines.routed_experts import GenerationRouting
from alignment.rollout.engines.static_decode import StaticDecoder, unsupported
from parallel.cpu_compat import host_streams


class _IdsTokenizer:
    """What the controller needs of a tokenizer, for prompts given as token ids. Its ``eod`` is
    -1, a token that never comes: the EOS-keeping controller stops at the engine's EOS ids."""

    def __init__(self, tokenizer, vocab_size: int):
        self.hf, self.eod, self.bos, self.vocab_size = tokenizer, -1, None, vocab_size

    def tokenize(self, prompt: list[int]) -> list[int]:
        return list(prompt)

    def detokenize(self, ids, **_) -> str:
        ids = ids.tolist() if torch.is_tensor(ids) else list(ids)
        return self.hf.decode(ids, skip_special_tokens=True) if self.hf is not None else ""

    def offsets(self, ids, text) -> list[int]:
        return list(range(len(ids)))


def _rollout_controller(wrapper, tokenizer, eos_token_ids: set[int]):
    """A ``TextGenerationController`` for rollouts (see the module docstring):

    - responses end with their EOS token (any of ``eos_token_ids``), counted in the response;
    - the sampled tokens' logprobs are taken from the last position's logits as each token is
      sampled (``.step_logprobs``: per step ``([rows] logprob, [rows] started)``), so generation
      runs with ``return_log_probs=False`` and the prefill computes the output layer on the last
      prompt position only (megatron-core materialises every prompt position's logits when asked
      for logprobs);
    - plain sampling (no top-k / top-p) draws ``argmax(p / e)`` with ``e ~ Exp(1)`` made from
      ``-log(uniform)`` (the exponential-race form of ``multinomial(p)``, as vLLM samples), since
      torch's CPU ``multinomial`` spends ~30 ms per 32 x 49,152 draw here;
    - with ``.loop`` set (:class:`alignment.rollout.engines.decode_loop.DecodeLoop`, the engine's fixed-shape decode
      steps), greedy and plain sampling run in that loop, sampling and stop checks inside the step (the same
      tokens and logprobs); top-p sampling keeps Megatron's loop. Either way :meth:`row_logprobs` gives each
      row's sampled-token logprobs.
    """
    from megatron.core.inference.inference_request import Status
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    class RolloutController(TextGenerationController):
        step_logprobs: list = []
        loop: DecodeLoop | None = None
        loop_logprobs: list | None = None  # the last batch's rows' logprobs, when the loop generated it

        def generate_all_output_tokens_static_batch(self, active_requests, active_streams=None):
            params = next(iter(active_requests.values())).sampling_params
            greedy = params.top_k == 1
            if self.loop is None or active_streams or not (greedy or (params.top_k == 0 and params.top_p == 0.0)):
                self.loop_logprobs = None
                return super().generate_all_output_tokens_static_batch(active_requests, active_streams)
            with torch.inference_mode():
                rows = self.loop.generate(self.inference_wrapped_model,
                                          [list(r.prompt_tokens) for r in active_requests.values()],
                                          params.num_tokens_to_generate, self.inference_wrapped_model.temperature,
                                          greedy)
            for request, (ids, _) in zip(active_requests.values(), rows):
                request.generated_tokens = torch.tensor(ids, dtype=torch.long)
                request.generated_length = len(ids)
                request.status = Status.COMPLETED
            self.loop_logprobs = [lps for _, lps in rows]
            return active_requests

        def row_logprobs(self, rows: int) -> list[list[float]]:
            """Each row's sampled-token logprobs for the batch just generated (``rows`` rows)."""
            if self.loop_logprobs is not None:
                return self.loop_logprobs[:rows]
            return _row_logprobs(self.step_logprobs, rows)

        def sample_from_logits(self, last_token_logits, sampling_params=None, vocab_size=None,
                               generation_started=None, **kwargs):
            plain = sampling_params.top_k == 0 and sampling_params.top_p == 0.0
            if plain:  # the wrapper already divided by the temperature; the controller's is 1
                tokens = race_sample(last_token_logits.float())
            else:
                tokens = super().sample_from_logits(last_token_logits, sampling_params, vocab_size,
                                                    generation_started=generation_started, **kwargs)
            logprobs = torch.log_softmax(last_token_logits.float(), dim=-1).gather(-1, tokens[:, None].long())[:, 0]
            self.step_logprobs.append((logprobs, generation_started.clone()))
            return tokens

        def update_generation_status(self, updated_prompts_tokens, generation_started, current_context_end_position,
                                     is_generation_done_tensor, generated_sequence_lengths, termination_id=None):
            # count this step's token first (the EOS too), then mark the sequences it ended
            generated_sequence_lengths += ~is_generation_done_tensor & generation_started
            latest = updated_prompts_tokens[:, current_context_end_position]
            eos = torch.tensor(sorted(eos_token_ids), device=latest.device, dtype=latest.dtype)
            done = is_generation_done_tensor | (torch.isin(latest, eos) & generation_started)
            return done, generated_sequence_lengths.int()

    return RolloutController(wrapper, tokenizer)


class ExpertLockstep:
    """Forwards run together over an expert-parallel ``group`` (see the module docstring): each rank
    calls :meth:`before_forward` before a real forward and :meth:`drain` when its generation is over."""

    def __init__(self, group, device):
        self.group, self.device = group, device

    def _others_busy(self, mine: int) -> bool:
        flag = torch.tensor([float(mine)], device=self.device)
        torch.distributed.all_reduce(flag, group=self.group)
        return flag.item() > mine

    def any_refused(self, mine: bool) -> bool:
        """Whether any rank of the group refuses its request (``mine``: this one does), so that all raise."""
        flag = torch.tensor([float(mine)], device=self.device)
        torch.distributed.all_reduce(flag, group=self.group)
        return flag.item() > 0

    def before_forward(self) -> None:
        """This rank runs a forward now (its peers run theirs, or a dummy one)."""
        self._others_busy(1)

    def drain(self, dummy_forward) -> None:
        """Run ``dummy_forward()`` for as long as another rank of the group still has forwards."""
        while self._others_busy(0):
            dummy_forward()


def _temperature_wrapper(model, config, context, vocab_size: int):
    """A ``GPTInferenceWrapper`` whose last-stage logits are fp32, divided by ``.temperature``,
    and ``-inf`` on Megatron's padding columns (ids >= ``vocab_size``), so that neither sampling
    nor the logprobs' normaliser sees tokens the model does not have. ``.lockstep``
    (:class:`ExpertLockstep`) and ``.routing`` (:class:`GenerationRouting`), when set, see every forward;
    ``.images`` (:class:`GenerationImages`, a vision-language model's batch) gives every forward its
    M-RoPE positions and images; ``.static`` (:class:`StaticDecoder`), when set, runs the one-token decode
    steps (captured as CUDA graphs on a GPU) and Megatron's forward the prefills."""
    from contextlib import nullcontext

    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper

    class TemperatureScaled(GPTInferenceWrapper):
        temperature = 1.0
        lockstep: ExpertLockstep | None = None
        routing: GenerationRouting | None = None
        images: GenerationImages | None = None
        static: StaticDecoder | None = None

        def get_batch_for_context_window(self, inference_input, context_start_position, context_end_position):
            out = super().get_batch_for_context_window(inference_input, context_start_position, context_end_position)
            if self.images is not None:  # a vision-language model: M-RoPE positions and the window's images
                out.update(self.images.window(context_start_position, context_end_position))
            return out

        def _forward(self, inference_input):
            if self.lockstep is not None:
                self.lockstep.before_forward()
            recording = self.routing.forward(inference_input["tokens"]) if self.routing else nullcontext()
            with recording:
                tokens = inference_input["tokens"]
                if self.static is not None and tokens.size(1) == 1 and self.inference_context.sequence_len_offset:
                    out = self.static.decode(tokens, self.inference_context)
                elif self.images is None:
                    out = super()._forward(inference_input)
                    if self.static is not None:
                        self.static.prefilled()
                else:
                    extra = {k: inference_input[k] for k in ("image_mask", "image_features") if k in inference_input}
                    out = self.model(inference_input["tokens"], inference_input["position_ids"],
                                     inference_input["attention_mask"], inference_context=self.inference_context,
                                     runtime_gather_output=True, **extra)
            if not getattr(self.model, "post_process", True):
                return out  # an earlier pipeline stage: hidden states
            logits = out.float() / self.temperature
            logits[..., vocab_size:] = float("-inf")
            return logits

    return TemperatureScaled(model, config, context)


def _row_logprobs(steps: list[tuple[torch.Tensor, torch.Tensor]], rows: int) -> list[list[float]]:
    """Each row's sampled-token logprobs from the controller's ``step_logprobs``: a row's response
    starts at the first step at which it has ``started`` (after its own prompt)."""
    if not steps:
        return [[] for _ in range(rows)]
    lps = torch.stack([lp for lp, _ in steps], dim=1)[:rows]  # [rows, steps]
    started = torch.stack([st for _, st in steps], dim=1)[:rows]
    return [lps[i][started[i]].tolist() for i in range(rows)]


class MegatronEngine:
    """``rollout.backend=megatron``: generation with Megatron-Core's inference engine on the
    trainer's own model (tensor parallel or whole; PP = 1 for now). Implements
    :class:`alignment.rollout.base.RolloutEngine`.

    Args:
        model: the policy's ``GPTModel`` (unwrapped from DDP) on this rank.
        tokenizer: the HF tokenizer (decodes ``Sample.text``), or None.
        eos_token_id: generation stops at this token, or at any of a list of them (the HF
            ``generation_config``'s ``eos_token_id`` may be a list); kept as the last response
            token, as vLLM returns it.
        vocab_size: the tokenizer's vocabulary size (the HF config's; Megatron pads the model's).
        max_model_len: longest prompt + response, tokens (the KV cache's length).
        max_batch_size: most sequences generated at once (the KV cache's batch).
        seed: the engine's own sampling stream (one per model replica: the ranks of a TP group
            must draw the same tokens): it samples from a saved torch RNG state, so the trainer's
            global RNG is left as it was.
        record_routing: a mixture-of-experts model's samples carry ``routed_experts`` (R3).
        cuda_graphs: decode steps of fixed shape captured as CUDA graphs
            (:class:`alignment.rollout.engines.static_decode.StaticDecoder`), greedy and plain sampling in the engine's
            own loop with the sampling and stop checks inside the graph
            (:class:`alignment.rollout.engines.decode_loop.DecodeLoop`); None: on a GPU. On a CPU, True runs the same
            fixed-shape steps and loop without capture. A model the step does not cover (mixture-of-experts,
            vision-language, ...: :func:`alignment.rollout.engines.static_decode.unsupported`) decodes eagerly.
    """

    def __init__(self, model, tokenizer, *, eos_token_id: int | list[int], vocab_size: int, max_model_len: int = 1024,
                 max_batch_size: int = 64, seed: int = 0, record_routing: bool = False,
                 cuda_graphs: bool | None = None):
        from megatron.core.inference.contexts import StaticInferenceContext
        from megatron.core.inference.engines import static_engine
        from megatron.core.inference.engines.static_engine import StaticInferenceEngine
        from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig

        self.shares_trainer_weights = True
        self.generates_per_replica = True
        self.seed, self._rng_state, self._base_seed = seed, None, seed
        self.model, self.tokenizer = model, tokenizer
        self.eos_token_ids = {eos_token_id} if isinstance(eos_token_id, int) else {int(e) for e in eos_token_id}
        self.max_model_len, self.max_batch_size = max_model_len, max_batch_size
        config = InferenceWrapperConfig(hidden_size=model.config.hidden_size, params_dtype=model.config.params_dtype,
                                        inference_batch_times_seqlen_threshold=-1, padded_vocab_size=model.vocab_size,
                                        inference_max_requests=max_batch_size, inference_max_seq_length=max_model_len)
        self.context = StaticInferenceContext(max_batch_size, max_model_len)
        self.wrapper = _temperature_wrapper(model, config, self.context, vocab_size)
        self.controller = _rollout_controller(self.wrapper, _IdsTokenizer(tokenizer, vocab_size), self.eos_token_ids)
        self.engine = StaticInferenceEngine(self.controller, max_batch_size=max_batch_size, legacy=True)
        self.engine.random_seed = None  # see the module docstring: no global re-seed per call
        self.routing = self.wrapper.routing = GenerationRouting.of(model) if record_routing else None
        self.wrapper.lockstep = self._lockstep(model)
        from alignment.models.vlm_model import VisionLanguageModel  # imports Megatron

        self.vision = model if isinstance(model, VisionLanguageModel) else None  # feeds images, M-RoPE
        cuda = torch.cuda.is_available()
        if (cuda if cuda_graphs is None else cuda_graphs) and not record_routing and unsupported(model) is None:
            self.wrapper.static = StaticDecoder(model, graphs=cuda)
            self.controller.loop = DecodeLoop(self.wrapper.static, self.eos_token_ids, vocab_size)
        self.static = self.wrapper.static
        if static_engine.HAVE_TQDM:  # its "static requests" bar per call: the job's step bar is enough
            from functools import partial

            from tqdm import tqdm

            static_engine.tqdm = partial(tqdm, disable=True)

    @staticmethod
    def _lockstep(model) -> ExpertLockstep | None:
        """An :class:`ExpertLockstep` over the expert-parallel group of a model split over one."""
        if getattr(model.config, "expert_model_parallel_size", 1) <= 1:
            return None
        from megatron.core import parallel_state as ps

        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        return ExpertLockstep(ps.get_expert_model_parallel_group(), device)

    def reseed(self, step: int) -> None:
        """Sample from step ``step`` on with the stream :func:`alignment.rollout.base.step_seed` draws
        from the engine seed and the step (see :meth:`alignment.rollout.engines.vllm_engine.VLLMEngine.reseed`)."""
        self.seed, self._rng_state = step_seed(self._base_seed, step), None

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, on_done: OnDone | None = None
                 ) -> list[list[Sample]]:
        """``sampling.n`` samples for each prompt (token ids), with the sampled tokens' logprobs
        (nats, of ``softmax(logits / temperature)``; temperature 0 is greedy, logprobs at T=1).
        ``on_done(i, samples)``: as each batch of ``max_batch_size`` rows ends, for the prompts whose
        samples are all done.

        Raises:
            ValueError: a prompt plus ``sampling.max_tokens`` longer than ``max_model_len``,
                ``sampling.top_p`` outside ``(0, 1]``, or stop strings (``sampling.stop``: not
                supported here; multi-turn environments with stop strings need ``rollout.backend=vllm``).
        """
        from megatron.core.inference.sampling_params import SamplingParams

        problem = None
        longest = max((len(p) for p in prompts), default=0) + sampling.max_tokens
        if sampling.stop:
            problem = (f"stop strings {sampling.stop} are not supported by rollout.backend=megatron; "
                       "use rollout.backend=vllm (or an environment that ends turns at EOS)")
        elif not 0 < sampling.top_p <= 1:
            problem = f"top_p={sampling.top_p}: must be in (0, 1]"
        elif longest > self.max_model_len:
            problem = (f"a prompt of {longest - sampling.max_tokens} tokens + max_tokens={sampling.max_tokens} "
                       f"exceeds max_model_len={self.max_model_len}")
        if self.wrapper.lockstep is not None and self.wrapper.lockstep.any_refused(problem is not None):
            # every rank of the expert group raises, none waits for a peer's forwards
            problem = problem or "another rank of the expert-parallel group refused its prompts (see its error)"
        if problem is not None:
            raise ValueError(problem)
        if not prompts and self.wrapper.lockstep is None:
            return []
        greedy = sampling.temperature == 0
        self.wrapper.temperature = 1.0 if greedy else sampling.temperature
        params = SamplingParams(temperature=1.0, top_k=1 if greedy else 0,
                                top_p=0.0 if greedy or sampling.top_p == 1 else sampling.top_p,
                                num_tokens_to_generate=sampling.max_tokens, return_log_probs=False,
                                termination_id=-1)  # unused: the controller stops at self.eos_token_ids
        rows = [p for p in prompts for _ in range(sampling.n)]  # an ImagePrompt's rows: one object
        was_training = self.model.training
        self.model.eval()
        cuda = torch.cuda.is_available()
        if not cuda:
            host_streams()  # vLLM's CPU worker, imported since, rebinds torch.cuda.Event and Stream
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []):
                if self._rng_state is None:
                    torch.manual_seed(self.seed)
                else:
                    torch.set_rng_state(self._rng_state[0])
                    if cuda:
                        torch.cuda.set_rng_state(self._rng_state[1])
                requests, logprobs, routed, out = [], [], [], []
                for start in range(0, len(rows), self.max_batch_size):
                    self.controller.step_logprobs = []
                    chunk = rows[start:start + self.max_batch_size]
                    if self.routing is not None:
                        self.routing.start(len(chunk), max(map(len, chunk)) + sampling.max_tokens)
                    if self.vision is not None:
                        self.wrapper.images = GenerationImages(self.vision, chunk, sampling.max_tokens)
                    batch = self.engine.generate(prompts=[list(p) for p in chunk], sampling_params=params)
                    requests += batch
                    logprobs += self.controller.row_logprobs(len(batch))
                    routed += self.routing.rows_recorded() if self.routing is not None else [None] * len(batch)
                    while len(requests) >= (len(out) + 1) * sampling.n:  # prompts whose rows are all done
                        i = len(out)
                        mine = slice(i * sampling.n, (i + 1) * sampling.n)
                        out.append([self._sample(prompts[i], r, lps, experts) for r, lps, experts
                                    in zip(requests[mine], logprobs[mine], routed[mine])])
                        if on_done is not None:
                            on_done(i, out[i])
                if self.wrapper.lockstep is not None:  # forwards with the expert-parallel peers still generating
                    self.wrapper.lockstep.drain(self.wrapper.dummy_forward)
                self._rng_state = (torch.get_rng_state(), torch.cuda.get_rng_state() if cuda else None)
        finally:
            self.model.train(was_training)
            self.wrapper.images = None
        return out

    def _sample(self, prompt: list[int], request, lps: list[float], experts: torch.Tensor | None) -> Sample:
        """One generated row as a :class:`Sample`: cut after its first end-of-sequence token;
        ``experts``: the row's recorded routing (``[positions, layers, k]``), or None."""
        ids = [int(t) for t in (request.generated_tokens.tolist() if torch.is_tensor(request.generated_tokens)
                                else request.generated_tokens)]
        end = next((k for k, t in enumerate(ids) if t in self.eos_token_ids), None)
        finished = end is not None
        if finished:
            ids = ids[:end + 1]
        text = self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""
        routed = None if experts is None else experts[:len(prompt) + len(ids)].clone()
        if routed is not None and ids:
            routed[-1] = -1  # sampled, never fed back: no forward routed it
        return Sample(prompt if isinstance(prompt, ImagePrompt) else list(prompt), ids, lps[:len(ids)], text, finished,
                      routed_experts=routed, images=images_of(prompt))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Nothing to load: the engine runs the trainer's parameters."""

    def load_resharded(self, buckets) -> dict:
        """Nothing to load (see :meth:`update_weights`); returns ``{"load_s", "names"}`` as
        :meth:`alignment.rollout.engines.vllm_engine.VLLMEngine.load_resharded` does."""
        t0 = time.perf_counter()
        return {"load_s": time.perf_counter() - t0, "names": []}

    def kv_cache_bytes(self) -> int:
        """Bytes the KV cache holds now (0 before the first generation and after :meth:`sleep`)."""
        return sum(t.numel() * t.element_size() for kv in self.context.key_value_memory_dict.values() for t in kv)

    def sleep(self) -> None:
        """Free the KV cache (megatron-core allocates it again at the next generation) and the decode
        graphs that point into it."""
        self.context.key_value_memory_dict.clear()
        if self.static is not None:
            self.static.reset()

    def wake(self) -> None:
        """Nothing to restore: the weights are the trainer's, the KV cache comes back on use."""

    def close(self) -> None:
        """Drop the engine and its KV cache."""
        self.sleep()
        self.engine = self.wrapper = None
