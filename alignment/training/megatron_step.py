"""Shared Megatron machinery for every trainer: DDP + optimizer setup, one
forward(-backward) pass over micro-batches through ``get_forward_backward_func``
(so pipeline parallelism uses the same code), and vocabulary-parallel logprobs.

Loss convention: a loss function returns its micro-batch's share of the GLOBAL
loss, i.e. already divided by the global normaliser (token count over all
micro-batches and data-parallel ranks). Megatron is configured with
``calculate_per_token_loss=True`` and ``finalize_model_grads(num_tokens=None)`` so it
sums micro-batch losses and data-parallel gradients without averaging them again.
Then the gradient equals the gradient of the global loss, for any micro-batch split
and any data-parallel size (tested in ``tests/dist/grpo_invariance_worker.py``).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from alignment.models.vlm import multimodal_inputs
from alignment.training.output_positions import OutputPositions, output_on
from alignment.training.router_stats import track_routing
from parallel.lora import FrozenBase, adapters_disabled
from parallel.packing import alignment as packing_alignment
from parallel.packing import model_inputs
from parallel.state import comm_device
from parallel.vocab_logprobs import vocab_parallel_log_softmax, vocab_parallel_logprobs


@dataclass
class OptimConfig:
    """Adam settings for ``get_megatron_optimizer`` (``lr`` per step, ``clip_grad`` max global grad norm)."""

    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False  # shard optimizer state over data-parallel ranks (ZeRO-1)


def _finalize_grads_summed(model, num_tokens=None, **kwargs):
    from megatron.core.distributed import finalize_model_grads

    return finalize_model_grads(model, num_tokens=None, **kwargs)


def setup_training(model: torch.nn.Module, optim: OptimConfig):
    """Wrap a GPTModel shard in Megatron DDP and build its optimizer.

    Returns ``(ddp_model, optimizer)``. Uses ``get_megatron_optimizer`` (Adam; apex or
    TE fused kernels on GPU, ``torch.optim.AdamW`` otherwise).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = model.config
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                      use_distributed_optimizer=optim.use_distributed_optimizer),
        module=model,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=optim.lr, weight_decay=optim.weight_decay,
                        adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
                        clip_grad=optim.clip_grad, bf16=config.bf16, params_dtype=config.params_dtype,
                        use_distributed_optimizer=optim.use_distributed_optimizer),
        [ddp],
    )
    use_fused_cpu_adam(optimizer)
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = _finalize_grads_summed

    track_routing(ddp)  # MoE models: expert load per step (alignment.training.router_stats)
    return ddp, optimizer


def use_fused_cpu_adam(optimizer) -> int:
    """Switch the ``torch.optim.Adam``/``AdamW`` that Megatron falls back to (no apex or
    transformer-engine) onto torch's fused kernel for its fp32 parameter groups held on the CPU
    (the masters in bf16), also after a checkpoint load (whose saved ``param_groups`` would switch
    it back). Same update as the
    for-loop implementation up to fp32 rounding; measured here for 67 M fp32 parameters on one
    core: 0.04 s per step against 0.16 s (0.39 s inside the 2-process main job, where the loop's
    temporaries compete for memory bandwidth). ``optimizer``: what ``get_megatron_optimizer``
    returns (chained or not), or a torch optimizer. Returns how many parameter groups were
    switched; optimizers with state already built (by the for-loop path) are left alone."""
    inner = [getattr(o, "optimizer", o) for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    switched = 0
    for torch_opt in inner:
        if not isinstance(torch_opt, torch.optim.Adam) or any(s for s in torch_opt.state.values()):
            continue  # apex/TE Adam, or state already built by the for-loop path

        def fuse(opt, *_) -> int:
            n = 0
            for group in opt.param_groups:
                if all(p.device.type == "cpu" and p.dtype == torch.float32 for p in group["params"]):
                    group["fused"], group["foreach"] = True, False
                    n += 1
            return n

        switched += fuse(torch_opt)
        torch_opt.register_load_state_dict_post_hook(fuse)
    return switched


def main_param_writer(optimizer) -> Callable[[torch.nn.Parameter, torch.Tensor], None]:
    """A function ``write(param, value)`` that sets the fp32 master copy the optimizer keeps of a
    bf16/fp16 model parameter: ``value`` is the parameter's full value on this rank (its TP shard,
    shape ``param.shape``, any dtype; converted to fp32), and the distributed optimizer's master
    receives only its data-parallel slice of it. Parameters without a master (fp32 models, where
    the parameter is the master) are ignored.

    Why: Megatron's mixed-precision optimizers (``Float16OptimizerWithFloat16Params``,
    ``DistributedOptimizer``) create the masters by upcasting the bf16 parameters, so an fp32
    checkpoint loaded into a bf16 model starts its masters on the bf16 grid. Then an update smaller
    than half a bf16 step (lr 5e-6 moves a weight ~1e-5; bf16's step at 0.05 is 2.4e-4) never changes
    the bf16 weight the forward pass uses. Seeded from the fp32 checkpoint, masters sit inside their
    bf16 cells and a small update flips a fraction of weights proportional to its size, so the bf16
    model follows the fp32 trajectory on average (measured: docs/results.md, bf16). The
    slices are the ones Megatron's own ``_copy_model_params_to_main_params`` copies (megatron-core
    0.16.1, ``optimizer.py`` / ``distrib_optimizer.py``), fed with the checkpoint instead of the
    rounded parameter.

    Raises:
        ValueError: from ``write``, when ``value``'s shape is not ``param``'s.
    """
    targets: dict[torch.nn.Parameter, tuple[torch.Tensor, int, int]] = {}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(opt, "shard_fp32_from_float16_groups"):  # DistributedOptimizer: a slice per DP rank
            for model_group, main_group in zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups):
                for param, main in zip(model_group, main_group):
                    r = opt._get_model_param_range_map(param)["param"]
                    targets[param] = (main, r.start, r.end)
        elif hasattr(opt, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params
            for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                for param, main in zip(model_group, main_group):
                    targets[param] = (main, 0, main.numel())

    @torch.no_grad()
    def write(param: torch.nn.Parameter, value: torch.Tensor) -> None:
        if param not in targets:
            return
        main, start, end = targets[param]
        if value.shape != param.shape:
            raise ValueError(f"master weight: value {tuple(value.shape)} for a parameter of shape {tuple(param.shape)}")
        main.data.view(-1).copy_(value.reshape(-1)[start:end])

    return write


def _model_inputs(microbatches: list[dict], packing: bool, pad_id: int, sequence_parallel: bool,
                  share_prompts: bool = False, positions: str | None = None) -> list:
    """Every micro-batch as this rank's shard eats it (:func:`parallel.packing.model_inputs`, or
    prompt trees with ``share_prompts``: :func:`parallel.prompt_tree.shared_prompt_inputs`, scoring
    ``mb[positions]``); with pipeline parallelism all padded to one length (the stages exchange
    fixed shapes)."""
    from megatron.core import parallel_state as ps

    from parallel.prompt_tree import shared_prompt_inputs  # imports Megatron

    cp, tp = ps.get_context_parallel_world_size(), ps.get_tensor_model_parallel_world_size()
    kw = dict(packed=packing, pad_id=pad_id, cp_size=cp, cp_rank=ps.get_context_parallel_rank(),
              cp_group=ps.get_context_parallel_group() if cp > 1 else None)

    def build(mb, pad_to=None):
        ids = mb["input_ids"]
        lengths = mb.get("seq_lengths")
        if lengths is None:  # no lengths: every row counts as full (correct, only slower)
            lengths = torch.full((ids.shape[0],), ids.shape[1])
        if share_prompts:
            return shared_prompt_inputs(ids, lengths, lengths - mb["response_lengths"], pad_id=pad_id, pad_to=pad_to,
                                        score_mask=mb[positions] if positions else None)
        return model_inputs(ids, lengths, align=packing_alignment(cp, tp, sequence_parallel), pad_to=pad_to, **kw)

    inputs = [build(mb) for mb in microbatches]
    if ps.get_pipeline_model_parallel_world_size() > 1:
        longest = max(x.seq_length for x in inputs)
        inputs = [x if x.seq_length == longest else build(mb, longest) for x, mb in zip(inputs, microbatches)]
    return inputs


def forward_backward(
    model: torch.nn.Module,
    microbatches: list[dict[str, torch.Tensor]],
    loss_fn: Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], tuple[torch.Tensor, dict]],
    *,
    outputs: Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]],
    forward_only: bool,
    packing: bool = False,
    pad_id: int = 0,
    positions: str | None = None,
    share_prompts: bool = False,
    routing=None,
) -> list[dict]:
    """Run all micro-batches through Megatron's schedule (1F1B under PP).

    The model sees each micro-batch packed (``packing=True``: ``thd``, no padding between
    sequences) or padded, and split over the context-parallel group (:mod:`parallel.packing`).
    ``outputs`` turns this rank's model output into per-token tensors; they are gathered over
    CP and put back in ``[mbs, seq]`` form before ``loss_fn`` sees them, so a loss never
    depends on the layout (every CP rank computes the same loss; the gather's backward keeps
    each rank's share, and Megatron sums gradients over DP x CP).

    Args:
        model: a Megatron shard (DDP-wrapped or not), or a :class:`parallel.lora.FrozenBase` (a LoRA
            job's reference: its model run with the adapters off; forward only).
        microbatches: each has ``input_ids`` ``[mbs, seq]`` (right-padded),
            ``seq_lengths`` ``[mbs]`` (real tokens per row; all of ``seq`` if absent) and
            whatever ``loss_fn`` reads.
        loss_fn: ``(microbatch, outputs [mbs, seq] each) -> (loss, metrics)``, ``loss``
            already divided by the global normaliser.
        outputs: ``(model output [b, s_local, ...], target_ids [b, s_local]) -> {name: [b, s_local]}``,
            e.g. :class:`LogprobOutputs` or :func:`value_outputs`.
        positions: a micro-batch key (``[mbs, seq]``, e.g. ``"response_mask"``) marking the
            positions whose outputs ``loss_fn`` reads: the output layer runs on those only
            (:mod:`alignment.training.output_positions`) and ``outputs`` are 0 elsewhere.
            Ignored with sequence parallelism. ``None``: every position.
        share_prompts: the rows of a micro-batch that share a prompt (their first
            ``seq_lengths - response_lengths`` tokens; the micro-batch needs ``response_lengths``
            ``[mbs]``) run as one prompt tree, the prompt computed once
            (:mod:`parallel.prompt_tree`, ``trainer.shared_prompt_packing``); same outputs and
            gradients as ``packing``. Not with context or sequence parallelism.
        routing: a :class:`alignment.training.routing_replay.RoutingPass` (MoE models): the routers record
            their choices, or replay / compare the micro-batches' ``routed_experts``; None: they choose.
    Returns:
        the metrics dicts of every micro-batch on the last pipeline stage; ``[]`` elsewhere.
    Raises:
        ValueError: ``share_prompts`` with context parallelism or sequence parallelism.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func


    if isinstance(model, FrozenBase):  # a LoRA job's reference: the policy with its adapters off
        if not forward_only:
            raise ValueError("a FrozenBase reference model runs forward only")
        with adapters_disabled(model.model):
            return forward_backward(model.model, microbatches, loss_fn, outputs=outputs, forward_only=True,
                                    packing=packing, pad_id=pad_id, positions=positions, share_prompts=share_prompts,
                                    routing=routing)
    if share_prompts and (ps.get_context_parallel_world_size() > 1 or model.config.sequence_parallel):
        raise ValueError("share_prompts (trainer.shared_prompt_packing) needs context_parallel_size=1 and "
                         "sequence_parallel=false: a prompt tree's attention mask spans the whole tree")

    with moe_aux_loss_scale(model.config, len(microbatches), forward_only):
        return _forward_backward(get_forward_backward_func(), model, microbatches, loss_fn, outputs=outputs,
                                 forward_only=forward_only, packing=packing, pad_id=pad_id, positions=positions,
                                 share_prompts=share_prompts, routing=routing)


@contextmanager
def moe_aux_loss_scale(config, num_microbatches: int, forward_only: bool):
    """During one training ``forward_backward``, divide the MoE load-balancing loss coefficient by
    micro-batches x data-parallel size, so that its gradient is ``moe_aux_loss_coeff`` x the mean
    per-micro-batch switch loss over the global batch, whatever the split (as Megatron-LM without
    per-token loss: 1 / num_microbatches, DP gradients averaged).

    Why: megalign sums micro-batch losses and DP gradients (``calculate_per_token_loss``); Megatron
    would then weight every micro-batch's aux loss by 1 and, per token, by its token count
    (expecting ``finalize_model_grads`` to divide by the total, which megalign does not), so the
    routers are built without that per-token factor (:func:`alignment.models.gpt.build_gpt_model`)
    and the mean is taken here. The logged loss (Megatron's tracker) is unaffected: it divides by
    the coefficient in use."""
    coeff = getattr(config, "moe_aux_loss_coeff", 0.0)
    if forward_only or not getattr(config, "num_moe_experts", None) or not coeff:
        yield
        return
    from megatron.core import parallel_state as ps

    config.moe_aux_loss_coeff = coeff / (num_microbatches * ps.get_data_parallel_world_size())
    try:
        yield
    finally:
        config.moe_aux_loss_coeff = coeff


def _selected_positions(mb: dict, inp, key: str | None, sequence_parallel: bool):
    """:class:`OutputPositions` of ``mb[key]`` on this rank's tokens, or None (no key, or
    sequence parallelism over more than one rank)."""
    from megatron.core import parallel_state as ps


    if key is None or (sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1):
        return None
    index = inp.index[ps.get_context_parallel_rank()]  # [b, s_local] flat positions in the padded micro-batch
    mask = mb[key].reshape(-1)[index.clamp(min=0)]
    return OutputPositions.from_mask(torch.where(index >= 0, mask, torch.zeros_like(mask)))


def _forward_backward(schedule, model, microbatches, loss_fn, *, outputs, forward_only, packing, pad_id,
                      positions=None, share_prompts=False, routing=None):
    from megatron.core import parallel_state as ps

    from parallel.prompt_tree import tree_rotary  # imports Megatron

    device = next(model.parameters()).device
    sequence_parallel = bool(model.config.sequence_parallel)
    inputs = [x.to(device) for x in _model_inputs(microbatches, packing, pad_id, sequence_parallel, share_prompts,
                                                  positions)]

    def loss_func(mb, inp, sel, output):
        if share_prompts or sel is None:  # prompt trees: the output layer ran on their scoring positions
            local = outputs(output, inp.target_ids)
        else:
            local = {k: sel.put(v) for k, v in outputs(output, sel.take(inp.target_ids)).items()}
        loss, metrics = loss_fn(mb, {k: inp.restore(v) for k, v in local.items()})
        return loss, torch.tensor(1, dtype=torch.int), metrics

    def forward_step(data_iterator, m):
        mb, inp = next(data_iterator)
        mb = {k: v.to(device) for k, v in mb.items()}  # the loss reads them next to the outputs
        if share_prompts:
            sel = OutputPositions(inp.score_index, (1, inp.seq_length))
            rotary = tree_rotary(m, inp.position_ids)
        else:
            sel = _selected_positions(mb, inp, positions, sequence_parallel)
            rotary = nullcontext()
        routed = routing.micro_batch(mb, inp, sequence_parallel) if routing is not None else nullcontext()
        extra = multimodal_inputs(m, mb, inp, ps.get_context_parallel_rank())  # {} for a text model
        position_ids = extra.pop("position_ids", inp.position_ids)
        with output_on(m, sel), rotary, routed:
            out = m(inp.input_ids, position_ids, attention_mask=None, packed_seq_params=inp.packed_seq_params, **extra)
        return out, partial(loss_func, mb, inp, sel)

    return schedule(
        forward_step_func=forward_step,
        data_iterator=iter(list(zip(microbatches, inputs))),
        model=[model],
        num_microbatches=len(microbatches),
        seq_length=inputs[0].seq_length,
        micro_batch_size=inputs[0].input_ids.shape[0],
        forward_only=forward_only,
    )


@dataclass
class LogprobOutputs:
    """Per-token ``logprobs`` (and ``entropy``, nats, no gradient, when ``entropy``) of
    ``softmax(logits / temperature)`` from vocabulary-parallel logits; position ``t`` is the
    log-probability of the token after ``t`` in its sequence. Positions with no next token
    (a row's last real token, padding) hold meaningless values: losses mask them.

    Computed in fp32 a chunk of tokens at a time (:func:`parallel.vocab_logprobs.vocab_parallel_logprobs`):
    the logits stay in the model's dtype and no full-vocabulary fp32 copy is made."""

    vocab_size: int
    temperature: float = 1.0
    entropy: bool = False

    def __call__(self, logits: torch.Tensor, target_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        from megatron.core import parallel_state as ps

        logprobs, entropy = vocab_parallel_logprobs(logits, target_ids, self.vocab_size, self.temperature,
                                                    group=ps.get_tensor_model_parallel_group())
        return {"logprobs": logprobs, "entropy": entropy} if self.entropy else {"logprobs": logprobs}


@dataclass
class VocabOutputs:
    """:class:`LogprobOutputs`' ``logprobs`` and ``entropy`` (no gradient), plus ``vocab_logprobs``
    ``[b, s, V]``: the whole distribution ``log_softmax(logits / temperature)`` at every position, in
    fp32, the same on every tensor-parallel rank (:func:`parallel.vocab_logprobs.vocab_parallel_log_softmax`),
    for losses that compare two models' distributions (on-policy distillation's JSD and forward KL).
    It makes ``[tokens, V]`` fp32 tensors: use it with ``positions`` (the response only)."""

    vocab_size: int
    temperature: float = 1.0

    def __call__(self, logits: torch.Tensor, target_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        from megatron.core import parallel_state as ps

        full = vocab_parallel_log_softmax(logits, self.vocab_size, self.temperature,
                                          group=ps.get_tensor_model_parallel_group())
        index = target_ids.clamp(0, self.vocab_size - 1).unsqueeze(-1)  # padding positions: any real token
        with torch.no_grad():
            entropy = -(full.exp() * full).sum(-1)
        return {"logprobs": full.gather(-1, index).squeeze(-1), "entropy": entropy, "vocab_logprobs": full}


def value_outputs(values: torch.Tensor, target_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{"values": [b, s]}`` float32 from a scalar head's ``[b, s, 1]``."""
    return {"values": values.squeeze(-1).float()}


def is_output_rank() -> bool:
    """True on the one rank per model replica whose gathered outputs count for metrics:
    last pipeline stage, tensor-parallel rank 0, context-parallel rank 0."""
    from megatron.core import parallel_state as ps

    return (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0)


def all_reduce_max(values: list[float], group=None) -> list[float]:
    """Element-wise maximum of ``values`` over the ranks of ``group`` (default: all); collective."""
    t = torch.tensor(values, dtype=torch.float64, device=comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def all_reduce_sum(values: list[float], group=None) -> list[float]:
    """Element-wise sum of ``values`` over the ranks of ``group`` (default: all ranks), in
    float64 so that token counts and metric sums stay exact; collective."""
    t = torch.tensor(values, dtype=torch.float64, device=comm_device())
    dist.all_reduce(t, group=group)
    return t.tolist()


def global_sums(outputs: list[dict], keys: list[str] | None = None) -> dict[str, float]:
    """Sum metric tensors over micro-batches and over all ranks, counting each model replica
    once (:func:`is_output_rank`); collective."""
    if keys is None:
        keys = sorted(outputs[0]) if outputs else []
        obj = [keys]
        dist.broadcast_object_list(obj, src=dist.get_world_size() - 1)  # the last rank is a last stage
        keys = obj[0]
    mine = is_output_rank()
    local = torch.tensor([sum(float(o[k]) for o in outputs) if mine else 0.0 for k in keys], dtype=torch.float64,
                         device=comm_device())
    dist.all_reduce(local)
    return dict(zip(keys, local.tolist()))
