"""The parallel layout of a run, and its validation against the model and world size.

Validation runs before any process group starts, and every error names the config
field and the values that would work (as Megatron-LM's ``validate_args`` does, but
with the fix in the message).
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel.ulysses import check_ulysses_heads


class LayoutError(ValueError):
    """A parallel layout that cannot work for this model or world size."""


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n`` in increasing order (``[]`` for ``n`` < 1)."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of the parallel dimensions (Megatron-Core names).

    ``data_parallel_size`` is what is left of the world size: ``world_size /
    (tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size)``.
    ``context_parallel_size`` splits every sequence over that many ranks; ``cp_comm_type``
    picks how attention sees the whole sequence: ``p2p`` (ring attention) or ``a2a``
    (Ulysses all-to-all), as transformer-engine names them.

    Mixture-of-experts layers have a grid of their own (Megatron's "MoE parallel folding"):
    ``expert_model_parallel_size`` ranks share out the experts, each expert split over
    ``expert_tensor_parallel_size`` ranks (default: ``tensor_model_parallel_size``), the rest
    of the world replicating them (expert data parallelism); the expert grid folds over the
    ranks of the dense grid, so EP need not divide the data-parallel size.
    """

    world_size: int = 1
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    sequence_parallel: bool = False
    context_parallel_size: int = 1
    cp_comm_type: str = "p2p"
    # model chunks per pipeline rank (interleaved schedule); only the resharder handles them yet
    virtual_pipeline_model_parallel_size: int | None = None
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None  # None: tensor_model_parallel_size (Megatron's default)

    @property
    def model_parallel_size(self) -> int:
        """Ranks of one model replica: TP x PP x CP (they share the same data)."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.model_parallel_size

    @property
    def expert_tensor_size(self) -> int:
        """Expert tensor-parallel size: ``expert_tensor_parallel_size``, else TP."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def expert_data_parallel_size(self) -> int:
        """Replicas of each expert: world / (expert TP x EP x PP)."""
        return self.world_size // (self.expert_tensor_size * self.expert_model_parallel_size
                                   * self.pipeline_model_parallel_size)


def validate_layout(
    layout: ParallelLayout,
    *,
    num_layers: int,
    num_attention_heads: int,
    num_query_groups: int,
    prefix: str = "parallel.",
    num_experts: int = 0,
    moe_ffn_hidden_size: int = 0,
) -> None:
    """Check that ``layout`` can run the model on ``layout.world_size`` processes
    (``num_experts`` / ``moe_ffn_hidden_size``: a mixture-of-experts model's; 0 for a dense one).

    Raises:
        LayoutError: naming the field (e.g. ``parallel.tensor_model_parallel_size``),
            the constraint broken and the valid values for this model and world size.
    """
    tp, pp, ws = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size, layout.world_size
    cp = layout.context_parallel_size
    for field, value in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                         ("context_parallel_size", cp)):
        if not isinstance(value, int) or value < 1:
            raise LayoutError(f"{prefix}{field}={value!r}: must be a positive integer")
    valid_tp = [d for d in divisors(num_query_groups) if num_attention_heads % d == 0 and ws % d == 0]
    if num_attention_heads % tp or num_query_groups % tp:
        raise LayoutError(
            f"{prefix}tensor_model_parallel_size={tp} must divide the model's {num_attention_heads} attention "
            f"heads and {num_query_groups} KV heads (query groups); valid values with world size {ws}: {valid_tp}")
    if ws % tp:
        raise LayoutError(
            f"{prefix}tensor_model_parallel_size={tp} does not divide the world size {ws} "
            f"(number of processes); valid values: {valid_tp}")
    if num_layers % pp:
        valid_pp = [d for d in divisors(num_layers) if ws % (tp * d) == 0]
        raise LayoutError(
            f"{prefix}pipeline_model_parallel_size={pp} must divide the model's {num_layers} layers; "
            f"valid values with tensor_model_parallel_size={tp} and world size {ws}: {valid_pp}")
    if ws % (tp * pp):
        valid_pp = [d for d in divisors(num_layers) if ws % (tp * d) == 0]
        raise LayoutError(
            f"world size {ws} is not divisible by tensor_model_parallel_size x pipeline_model_parallel_size "
            f"= {tp} x {pp}; set {prefix}pipeline_model_parallel_size to one of {valid_pp} "
            f"or launch a multiple of {tp * pp} processes")
    if ws % (tp * pp * cp):
        valid_cp = [d for d in divisors(ws) if ws % (tp * pp * d) == 0]
        raise LayoutError(
            f"world size {ws} is not divisible by tensor x pipeline x context parallel sizes = {tp} x {pp} x {cp}; "
            f"set {prefix}context_parallel_size to one of {valid_cp} or launch a multiple of {tp * pp * cp} processes")
    if layout.cp_comm_type not in ("p2p", "a2a"):
        raise LayoutError(f"{prefix}cp_comm_type={layout.cp_comm_type!r}: valid values are p2p (ring attention) "
                          f"and a2a (Ulysses)")
    if cp > 1 and layout.cp_comm_type == "a2a":

        why = check_ulysses_heads(num_attention_heads // tp, num_query_groups // tp, cp)
        if why:
            ok = [d for d in divisors(ws // (tp * pp))
                  if d > 1 and check_ulysses_heads(num_attention_heads // tp, num_query_groups // tp, d) is None]
            raise LayoutError(f"{prefix}context_parallel_size={cp} with {prefix}cp_comm_type=a2a (Ulysses): {why}; "
                              f"valid Ulysses sizes here: {ok}, or use {prefix}cp_comm_type=p2p (ring attention)")
    if layout.sequence_parallel and tp == 1:
        raise LayoutError(f"{prefix}sequence_parallel=true needs tensor_model_parallel_size > 1 "
                          f"(it splits the sequence over the TP group); set it to false or raise TP")
    _validate_experts(layout, num_experts, moe_ffn_hidden_size, prefix)


def validate_model_layout(layout: ParallelLayout, dims, prefix: str = "parallel.") -> None:
    """:func:`validate_layout` for a model's dims (an object with
    :class:`alignment.models.dims.ModelDims`' attributes). Raises LayoutError."""
    validate_layout(layout, num_layers=dims.num_layers, num_attention_heads=dims.num_attention_heads,
                    num_query_groups=dims.num_query_groups, prefix=prefix, num_experts=dims.num_experts,
                    moe_ffn_hidden_size=dims.moe_ffn_hidden_size)


def _validate_experts(layout: ParallelLayout, num_experts: int, moe_ffn: int, prefix: str) -> None:
    """Expert parallelism: Megatron's expert grid (expert TP x EP x PP) must divide the world,
    EP the experts, expert TP the expert width; MoE with TP needs sequence parallelism."""
    ep, etp, ws = layout.expert_model_parallel_size, layout.expert_tensor_parallel_size, layout.world_size
    tp, pp = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size
    for field, value in (("expert_model_parallel_size", ep), ("expert_tensor_parallel_size", etp)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise LayoutError(f"{prefix}{field}={value!r}: must be a positive integer")
    if not num_experts:
        if ep > 1 or (etp is not None and etp != tp):
            raise LayoutError(f"{prefix}expert_model_parallel_size={ep} / expert_tensor_parallel_size={etp}: this "
                              f"model has no experts (dense); leave them at 1 / null")
        return
    etp = layout.expert_tensor_size
    valid_ep = [d for d in divisors(num_experts) if ws % (etp * d * pp) == 0]
    if num_experts % ep:
        raise LayoutError(f"{prefix}expert_model_parallel_size={ep} must divide the model's {num_experts} experts; "
                          f"valid values with world size {ws}: {valid_ep}")
    if moe_ffn and moe_ffn % etp:
        raise LayoutError(f"{prefix}expert_tensor_parallel_size={etp} must divide the expert MLP size {moe_ffn}")
    if ws % (etp * ep * pp):
        raise LayoutError(f"world size {ws} is not divisible by expert tensor x expert x pipeline parallel sizes = "
                          f"{etp} x {ep} x {pp} (Megatron's expert grid); set {prefix}expert_model_parallel_size "
                          f"to one of {valid_ep} or launch a multiple of {etp * ep * pp} processes")
    if tp > 1 and not layout.sequence_parallel:
        raise LayoutError(f"{prefix}tensor_model_parallel_size={tp} with a mixture-of-experts model needs "
                          f"{prefix}sequence_parallel=true (Megatron's MoE layer refuses to train with TP "
                          f"without it)")
