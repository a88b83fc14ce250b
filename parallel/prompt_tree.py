"""Shared-prompt packing: the responses to one prompt as ONE packed sequence
``[prompt, r_1, ..., r_G]`` (a prompt tree) in which every response sees the prompt and itself only.

Why: GRPO samples ``G`` responses per prompt, and ordinary packing repeats the prompt ``G``
times. On the main job (prompts of ~75 tokens, responses of ~15, ``G = 8``) ~72 % of the
tokens of the training and reference passes are prompt copies. Prompt tokens never attend to a
response (causal attention), so their hidden states are the same in every copy; computing them
once and letting each response attend to that one copy gives the same logprobs, and the same
gradients (the ``G`` copies' gradients arrive summed), in exact arithmetic. This is the
"shared prefix" of tree attention (e.g. SGLang's RadixAttention for inference, Medusa's tree
masks); here it is applied to training and scoring passes.

The layout of one tree, for a prompt of ``P`` tokens:

- positions ``0 .. P-1`` for the prompt and ``P .. P+len(r_i)-1`` for every response;
  megatron-core 0.16.1 applies per-token rotary frequencies to packed input when their count
  equals the packed length (``_apply_rotary_pos_emb_thd``, "exact mapping with offsets"), so
  :func:`tree_rotary` makes the rotary embedding return ``freqs[position_ids]``;
- an attention mask ``[T, T]`` (query ``t`` may attend key ``u`` when ``u`` is in the prompt or
  in ``t``'s response, at a position ``<= t``'s), carried per packed sequence by
  :class:`PromptTreeSeqParams` to :class:`parallel.attention.ContextParallelAttention`;
- the output of row ``i``'s column ``c`` (the prediction of its token ``c + 1``) is read at the
  tree position of its token ``c``: the shared prompt's for ``c < P`` (so the prompt's last
  position scores the first token of all ``G`` responses, each with its own target), the
  response's own copy otherwise. The output layer runs on those positions only
  (``score_index``, repeats allowed), each with its row's target.

A micro-batch becomes one tree per distinct prompt, packed end to end (``thd``, one
``cu_seqlens`` entry per tree). Not with context parallelism (a tree's mask spans the whole
tree) or sequence parallelism (the output layer's input would be split over TP).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from megatron.core.packed_seq_params import PackedSeqParams


@dataclass
class TreeSegments:
    """The same attention as the tree masks, as causal segments for a varlen FlashAttention call
    (GPU): a tree's prompt with its first response is one causal segment over its own keys; each
    further response is a segment whose queries are its own tokens and whose keys are the
    prompt's followed by its own, causal aligned bottom-right (query ``i`` of ``n`` sees the
    ``P`` prompt keys and its response's keys ``0 .. i``). Queries are the packed tokens in order.

    ``key_index``: ``[K]`` packed position of every segment's keys, segment after segment;
    ``cu_seqlens_q``/``cu_seqlens_kv``: ``[S + 1]`` int32 segment bounds in the queries and in
    ``key_index``; ``max_seqlen_q``/``max_seqlen_kv``: the longest segment of each."""

    key_index: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    max_seqlen_q: int
    max_seqlen_kv: int

    def to(self, device) -> "TreeSegments":
        """The same segments with their tensors on ``device``."""
        return replace(self, key_index=self.key_index.to(device), cu_seqlens_q=self.cu_seqlens_q.to(device),
                       cu_seqlens_kv=self.cu_seqlens_kv.to(device))


@dataclass
class PromptTreeSeqParams(PackedSeqParams):
    """Megatron's ``PackedSeqParams`` for packed prompt trees, plus one attention mask per packed
    sequence (``tree_masks[k]``: ``[n_k, n_k]`` bool, True where a query may attend a key, for the
    ``n_k`` tokens between ``cu_seqlens_q[k]`` and ``cu_seqlens_q[k + 1]``) and the same as
    :class:`TreeSegments`."""

    tree_masks: list[torch.Tensor] | None = None
    tree_segments: TreeSegments | None = None


@dataclass
class SharedPromptInputs:
    """One micro-batch as prompt trees.

    ``input_ids``, ``position_ids``: ``[1, T]``; ``packed_seq_params``: :class:`PromptTreeSeqParams`;
    ``score_index``: ``[n]`` tree position whose hidden state scores each selected ``(row, column)``
    (the output layer's input, repeats allowed); ``target_ids``: ``[1, n]`` the token each one
    predicts; ``flat_index``: ``[n]`` its ``row * seq + column`` in the padded micro-batch
    ``shape = (rows, seq)``, ``rows * seq`` for a placeholder (a micro-batch with nothing to score).
    ``token_index``: ``[T]`` the ``row * seq + column`` of the token at every tree position (a shared
    prompt token: one of its rows'), ``-1`` for padding.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    packed_seq_params: PromptTreeSeqParams
    score_index: torch.Tensor
    target_ids: torch.Tensor
    flat_index: torch.Tensor
    shape: tuple[int, int]
    token_index: torch.Tensor | None = None

    @property
    def seq_length(self) -> int:
        """Packed tokens ``T`` (what Megatron's schedule calls ``seq_length``; micro-batch size 1)."""
        return self.input_ids.shape[1]

    def to(self, device) -> "SharedPromptInputs":
        """The same inputs on ``device`` (the model's; a no-op on CPU)."""
        if self.input_ids.device == torch.device(device):
            return self
        p = self.packed_seq_params
        moved = {k: getattr(p, k).to(device) for k in
                 ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")}
        p = replace(p, tree_masks=[m.to(device) for m in p.tree_masks],
                    tree_segments=p.tree_segments and p.tree_segments.to(device), **moved)
        return SharedPromptInputs(self.input_ids.to(device), self.position_ids.to(device), p,
                                  self.score_index.to(device), self.target_ids.to(device),
                                  self.flat_index.to(device), self.shape,
                                  None if self.token_index is None else self.token_index.to(device))

    def restore(self, selected: torch.Tensor) -> torch.Tensor:
        """Per-score output ``[1, n, ...]`` -> ``[rows, seq, ...]`` of the padded micro-batch
        (0 where nothing was scored); differentiable."""
        rows, seq = self.shape
        rest = tuple(selected.shape[2:])
        flat = selected.new_zeros((rows * seq + 1, *rest)).index_put((self.flat_index,),
                                                                    selected.reshape(-1, *rest))
        return flat[: rows * seq].view(rows, seq, *rest)


def _tree(prompt_len: int, response_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Positions ``[T]``, attention mask ``[T, T]`` and each response's first tree position for a
    prompt of ``prompt_len`` tokens followed by responses of ``response_lens`` tokens (0 allowed)."""
    pos = [torch.arange(prompt_len)] + [prompt_len + torch.arange(n) for n in response_lens]
    seg = [torch.full((n,), i) for i, n in enumerate([prompt_len] + response_lens)]
    pos, seg = torch.cat(pos), torch.cat(seg)
    mask = ((seg.unsqueeze(1) == seg.unsqueeze(0)) | (seg.unsqueeze(0) == 0)) & (pos.unsqueeze(0) <= pos.unsqueeze(1))
    starts = (prompt_len + torch.cumsum(torch.tensor([0] + response_lens[:-1]), 0)).tolist()
    return pos, mask, starts


def _prompt_groups(input_ids: torch.Tensor, prompt_lengths: list[int]) -> dict[tuple[int, ...], list[int]]:
    """Rows by prompt: ``{prompt token ids: [rows]}`` in order of first appearance."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompt_lengths):
        groups.setdefault(tuple(input_ids[i, :p].tolist()), []).append(i)
    return groups


def tree_tokens(input_ids: torch.Tensor, seq_lengths: torch.Tensor, prompt_lengths: torch.Tensor) -> int:
    """Tokens the model runs on for a micro-batch laid out as prompt trees (each distinct prompt
    once, every response): ``sum(seq_lengths)`` minus the repeated prompt copies. Arguments as
    :func:`shared_prompt_inputs`'s."""
    groups = _prompt_groups(input_ids, [int(p) for p in prompt_lengths])
    return int(seq_lengths.sum()) - sum(len(prompt) * (len(rows) - 1) for prompt, rows in groups.items())


def shared_prompt_inputs(input_ids: torch.Tensor, seq_lengths: torch.Tensor, prompt_lengths: torch.Tensor, *,
                         score_mask: torch.Tensor | None = None, pad_id: int = 0,
                         pad_to: int | None = None) -> SharedPromptInputs:
    """Lay a right-padded micro-batch out as prompt trees: rows whose first ``prompt_lengths``
    tokens are equal share one tree (in order of first appearance; responses in row order).

    Args:
        input_ids: ``[rows, seq]`` token ids, prompt then response, right-padded.
        seq_lengths: ``[rows]`` real tokens per row (prompt + response).
        prompt_lengths: ``[rows]`` prompt tokens per row (``1 <= prompt <= seq_length``).
        score_mask: ``[rows, seq]``, the columns whose outputs are wanted (non-zero; e.g.
            ``response_mask``); ``None``: every real column.
        pad_id: token id of padding (targets past a row's end, the padding sequence).
        pad_to: total tokens to pad to with one causal padding sequence at the end (pipeline
            parallelism needs one shape for every micro-batch).
    Raises:
        ValueError: lengths outside ``1 <= prompt <= seq_length <= seq``, or ``pad_to`` below
            the packed length.
    """
    rows, seq = input_ids.shape
    lengths, prompts = [int(n) for n in seq_lengths], [int(p) for p in prompt_lengths]
    if len(lengths) != rows or len(prompts) != rows or any(not 1 <= p <= n <= seq for p, n in zip(prompts, lengths)):
        raise ValueError(f"prompt_lengths {prompts} and seq_lengths {lengths} must give 1 <= prompt <= length <= "
                         f"{seq} for each row of input_ids")
    groups = _prompt_groups(input_ids, prompts)
    ids, pos, masks, seg_lens = [], [], [], []
    keys, q_lens = [], []  # TreeSegments: each segment's key positions and query count
    tree_pos = torch.full((rows, seq), -1)  # where each (row, column) token sits in the packed trees
    offset = 0
    for prompt, members in groups.items():
        p = len(prompt)
        resp = [lengths[i] - p for i in members]
        tree_p, mask, starts = _tree(p, resp)
        ids += [torch.tensor(prompt)] + [input_ids[i, p : lengths[i]] for i in members]
        for i, start, n in zip(members, starts, resp):
            tree_pos[i, :p] = offset + torch.arange(p)
            tree_pos[i, p : p + n] = offset + start + torch.arange(n)
        pos.append(tree_p)
        masks.append(mask)
        seg_lens.append(tree_p.numel())
        first = p + (resp[0] if resp else 0)  # the prompt and its first response: plain causal
        keys.append(offset + torch.arange(first))
        q_lens.append(first)
        for start, n in zip(starts[1:], resp[1:]):
            if n:
                keys.append(torch.cat([offset + torch.arange(p), offset + start + torch.arange(n)]))
                q_lens.append(n)
        offset += tree_p.numel()
    if pad_to is not None and pad_to != offset:
        if pad_to < offset:
            raise ValueError(f"pad_to={pad_to}: below the {offset} tokens of the micro-batch's prompt trees")
        n = pad_to - offset
        ids.append(torch.full((n,), pad_id))
        pos.append(torch.arange(n))
        masks.append(torch.ones(n, n, dtype=torch.bool).tril())
        seg_lens.append(n)
        keys.append(offset + torch.arange(n))
        q_lens.append(n)
    real = torch.arange(seq).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    wanted = real if score_mask is None else real & (score_mask != 0)
    flat_index = wanted.reshape(-1).nonzero().squeeze(1)
    score_index = tree_pos.reshape(-1)[flat_index]
    targets = torch.where(torch.arange(seq).unsqueeze(0) + 1 < torch.tensor(lengths).unsqueeze(1),
                          torch.roll(input_ids, -1, dims=1), pad_id).reshape(-1)[flat_index]
    if flat_index.numel() == 0:  # nothing to score: one placeholder keeps every layer running
        flat_index, score_index, targets = torch.tensor([rows * seq]), torch.tensor([0]), torch.tensor([pad_id])
    cu = torch.tensor([0] + seg_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    longest = max(seg_lens)
    k_lens = [len(k) for k in keys]
    segments = TreeSegments(torch.cat(keys), torch.tensor([0] + q_lens).cumsum(0, dtype=torch.int32),
                            torch.tensor([0] + k_lens).cumsum(0, dtype=torch.int32), max(q_lens), max(k_lens))
    params = PromptTreeSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                                 cu_seqlens_kv_padded=cu, max_seqlen_q=longest, max_seqlen_kv=longest,
                                 tree_masks=masks, tree_segments=segments)
    token_index = torch.full((sum(seg_lens),), -1)
    placed = tree_pos.reshape(-1) >= 0
    token_index[tree_pos.reshape(-1)[placed]] = placed.nonzero().squeeze(1)
    return SharedPromptInputs(torch.cat(ids).unsqueeze(0), torch.cat(pos).unsqueeze(0), params, score_index,
                              targets.unsqueeze(0), flat_index, (rows, seq), token_index)


@contextmanager
def tree_rotary(model: torch.nn.Module, position_ids: torch.Tensor):
    """Within the block, ``model``'s rotary embedding returns the frequencies of
    ``position_ids`` ``[1, T]`` (``[T, 1, 1, d]``), one row per packed token, instead of rows
    ``0 .. max_seqlen-1`` (every position is below its tree's length, hence below ``max_seqlen``).

    Raises:
        ValueError: ``model`` has no rotary embedding (learned absolute positions).
    """
    from megatron.core.utils import unwrap_model

    rotary = getattr(unwrap_model(model), "rotary_pos_emb", None)  # inside DDP / Float16Module
    if rotary is None:
        raise ValueError("shared-prompt packing needs rotary position embeddings (the model has none)")
    flat = position_ids.reshape(-1)

    def hook(_module, _args, freqs):
        return freqs[flat.to(freqs.device)]

    handle = rotary.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
