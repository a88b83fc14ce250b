"""From a right-padded micro-batch ``[rows, seq]`` to what one rank's model shard eats, and
back: sequence packing (``thd``, Megatron's ``PackedSeqParams``), the context-parallel
zig-zag split, and the alignment padding both need.

- Unpacked (``sbhd``): rows keep their own slot, trimmed to the longest real sequence and
  padded to the alignment.
- Packed (``thd``): the real tokens of all rows laid end to end in one row, each sequence
  padded to the alignment, ``cu_seqlens`` marking the boundaries (attention is
  block-diagonal: no sequence sees another; positions restart per sequence).
- Alignment: ``2 * cp`` when ``context_parallel_size = cp > 1`` (two zig-zag chunks per rank),
  times ``tp`` with sequence parallelism (the sequence is split over TP too).

:class:`ModelInputs` remembers where every local token came from; :meth:`ModelInputs.restore`
gathers per-token outputs (logprobs, values) over the CP group and puts them back in
``[rows, seq]`` form, so every loss works on whole padded sequences whatever the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel.context_parallel import gather_from_context_parallel, zigzag_index


def alignment(cp_size: int, tp_size: int, sequence_parallel: bool) -> int:
    """Multiple each (packed) sequence or (unpacked) row length is padded to."""
    return (2 * cp_size if cp_size > 1 else 1) * (tp_size if sequence_parallel else 1)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclass
class ModelInputs:
    """One micro-batch as this rank's model shard sees it.

    ``input_ids``, ``position_ids``, ``target_ids``: ``[b, s_local]`` (``b = 1`` packed);
    ``target_ids[.., t]`` is the token after ``input_ids[.., t]`` in its sequence (for the
    vocabulary-parallel cross entropy). ``index``: ``[cp, b, s_local]`` flat position
    ``row * seq + col`` in the padded micro-batch of every CP rank's token, ``-1`` for
    alignment padding. ``packed_seq_params`` is None for unpacked input.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    target_ids: torch.Tensor
    index: torch.Tensor
    shape: tuple[int, int]
    packed_seq_params: object = None
    cp_group: object = None

    def to(self, device) -> "ModelInputs":
        """The same inputs on ``device`` (the model's; a no-op on CPU)."""
        if self.input_ids.device == torch.device(device):
            return self
        p = self.packed_seq_params
        if p is not None:
            from dataclasses import replace

            p = replace(p, **{k: getattr(p, k).to(device) for k in
                              ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")})
        return ModelInputs(self.input_ids.to(device), self.position_ids.to(device), self.target_ids.to(device),
                           self.index.to(device), self.shape, p, self.cp_group)

    @property
    def seq_length(self) -> int:
        """Global (all CP ranks) tokens per row: what Megatron's schedule calls ``seq_length``."""
        return self.index.shape[0] * self.index.shape[2]

    def stream_index(self) -> torch.Tensor:
        """``[1, T]``: the flat ``row * seq + col`` position of every token of the whole packed stream
        (all CP ranks' tokens in stream order, ``T = cu_seqlens_q_padded[-1]``; ``-1`` for alignment
        padding), the order in which Megatron's ``thd`` rotary takes a table of one angle per token
        (``_apply_rotary_pos_emb_thd`` cuts each CP rank's zig-zag share out of it itself).
        Raises ValueError for unpacked inputs (their rows are ``index`` itself)."""
        if self.packed_seq_params is None:
            raise ValueError("stream_index: the inputs are not packed (thd); use index")
        if self.index.shape[0] == 1:
            return self.index[0]
        cu = self.packed_seq_params.cu_seqlens_q_padded.cpu()
        cols = zigzag_index((cu[1:] - cu[:-1]).tolist(), self.index.shape[0])  # [cp, T / cp]
        stream = torch.full((int(cu[-1]),), -1, dtype=self.index.dtype, device=self.index.device)
        stream[cols.reshape(-1).to(stream.device)] = self.index[:, 0, :].reshape(-1)
        return stream.unsqueeze(0)

    def restore(self, local: torch.Tensor) -> torch.Tensor:
        """Per-token output ``[b, s_local, ...]`` of this rank -> ``[rows, seq, ...]`` of the
        padded micro-batch (all CP ranks' tokens; alignment padding dropped, unfilled slots 0).
        Collective over the CP group; differentiable."""
        full = local.unsqueeze(0) if self.index.shape[0] == 1 else gather_from_context_parallel(local, self.cp_group)
        rows, seq = self.shape
        rest = tuple(full.shape[3:])
        dump = rows * seq  # one extra slot receives the alignment padding
        idx = torch.where(self.index < 0, dump, self.index).flatten()
        flat = full.new_zeros((dump + 1, *rest)).index_put((idx,), full.reshape(-1, *rest))
        return flat[:dump].view(rows, seq, *rest)


def model_inputs(input_ids: torch.Tensor, seq_lengths: torch.Tensor, *, packed: bool, pad_id: int,
                 cp_size: int = 1, cp_rank: int = 0, cp_group=None, align: int = 1,
                 pad_to: int | None = None) -> ModelInputs:
    """This CP rank's share of a right-padded micro-batch.

    Args:
        input_ids: ``[rows, seq]`` right-padded token ids.
        seq_lengths: ``[rows]`` real tokens per row (each ``<= seq``).
        packed: lay the sequences end to end (``thd``) instead of one per row.
        pad_id: token id of padding.
        cp_size, cp_rank, cp_group: the context-parallel group (``cp_group`` for ``restore``).
        align: :func:`alignment` (a multiple of ``2 * cp_size`` when ``cp_size > 1``).
        pad_to: total global length to pad to (packed: tokens; unpacked: row length), so
            that every micro-batch has the same shape (pipeline parallelism needs it).
    Raises:
        ValueError: lengths outside ``[1, seq]``, ``align`` not a multiple of ``2 * cp_size``,
            or ``pad_to`` shorter than the data or not a multiple of ``align``.
    """
    rows, seq = input_ids.shape
    lengths = [int(n) for n in seq_lengths]
    if len(lengths) != rows or any(not 1 <= n <= seq for n in lengths):
        raise ValueError(f"seq_lengths {lengths} must give one length in [1, {seq}] per row of input_ids")
    if cp_size > 1 and align % (2 * cp_size):
        raise ValueError(f"align={align} must be a multiple of 2 x context_parallel_size = {2 * cp_size}")
    if packed:
        seg = [_round_up(n, align) for n in lengths]
        total = sum(seg)
        if pad_to is not None and pad_to != total:
            if pad_to < total or (pad_to - total) % align:
                raise ValueError(f"pad_to={pad_to}: must be >= {total} tokens and differ by a multiple of {align}")
            seg.append(pad_to - total)  # one padding sequence at the end
        stream, pos = [], []
        for i, (n, a) in enumerate(zip(lengths + [0], seg)):
            stream.append(torch.cat([torch.arange(n) + i * seq, torch.full((a - n,), -1)]))
            pos.append(torch.arange(a))
        stream, pos = torch.cat(stream).unsqueeze(0), torch.cat(pos).unsqueeze(0)  # [1, T]
    else:
        width = _round_up(max(lengths), align)
        if pad_to is not None:
            if pad_to < width or pad_to % align:
                raise ValueError(f"pad_to={pad_to}: must be >= {width} and a multiple of {align}")
            width = pad_to
        seg = [width]
        col = torch.arange(width)
        stream = torch.where(col < seq, torch.arange(rows).unsqueeze(1) * seq + col, -1)  # [rows, width]
        pos = col.expand(rows, width)
    local_cols = zigzag_index(seg, cp_size) if cp_size > 1 else torch.arange(stream.shape[1]).unsqueeze(0)
    index = stream[:, local_cols].transpose(0, 1).contiguous()  # [cp, b, s_local]
    flat_ids = input_ids.flatten()
    flat_targets = torch.roll(input_ids, shifts=-1, dims=1).flatten()
    mine = index[cp_rank]
    take = mine.clamp(min=0)
    pad = torch.full_like(mine, pad_id)
    packed_seq_params = None
    if packed:
        from megatron.core.packed_seq_params import PackedSeqParams

        real = [min(n, a) for n, a in zip(lengths + [0], seg)]
        real[-1] = real[-1] or seg[-1]  # the padding sequence counts as real (no empty sequences)
        cu_real = torch.tensor([0] + real, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        cu_pad = torch.tensor([0] + seg, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        packed_seq_params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu_real, cu_seqlens_kv=cu_real, cu_seqlens_q_padded=cu_pad,
            cu_seqlens_kv_padded=cu_pad, max_seqlen_q=max(seg), max_seqlen_kv=max(seg))
    return ModelInputs(
        input_ids=torch.where(mine >= 0, flat_ids[take], pad),
        position_ids=pos[:, local_cols[cp_rank]].expand_as(mine).contiguous(),
        target_ids=torch.where(mine >= 0, flat_targets[take], pad),
        index=index, shape=(rows, seq), packed_seq_params=packed_seq_params, cp_group=cp_group)
