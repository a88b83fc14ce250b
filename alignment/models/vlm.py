"""What a vision-language family adds to the table (:class:`VisionSpec`), and the model inputs
beyond token ids that its Megatron model takes per micro-batch (:func:`multimodal_inputs`).

The model itself (a Megatron ``GPTModel`` with a vision tower) is
:class:`alignment.models.vlm_model.VisionLanguageModel`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class VisionSpec:
    """A vision-language family's model parts.

    Args:
        tower: ``hf_config -> nn.Module``, the vision tower (``forward(pixel_values, grid_thw)`` whose
            ``pooler_output`` ``[image tokens, hidden]`` fills the image placeholders in order).
        positions: ``(input_ids [rows, seq], seq_lengths [rows] | None, image_grid_thw | None, dims)
            -> [3, rows, seq]``, the multimodal RoPE positions.
        rotary: ``(kv_channels, rotary_base) -> nn.Module``, the language model's rotary embedding when it is
            not Megatron's sectioned M-RoPE (``forward(position_ids [3, b, s], mrope_section)`` ->
            ``[s, b, 1, kv_channels]``, as Megatron's ``MultimodalRotaryEmbedding``); None: Megatron's.
    """

    tower: Callable[[object], torch.nn.Module]
    positions: Callable[..., torch.Tensor]
    rotary: Callable[[int, float], torch.nn.Module] | None = None


def checked_mrope_section(cfg, lm, default: tuple[int, ...]) -> tuple[int, ...]:
    """M-RoPE's section of a vision-language HF config ``cfg`` (``text_config.rope_parameters.mrope_section``,
    else ``default``), checked with the language model's dims ``lm`` (:class:`alignment.models.dims.ModelDims`).
    Raises ValueError, naming the HF field, for a section that does not cover half the head dimension or a
    vision output width other than the language model's."""
    text = cfg.get_text_config()
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    section = tuple(rope.get("mrope_section", default))
    if sum(section) * 2 != lm.head_dim:
        raise ValueError(f"{cfg.model_type}: text_config.rope_parameters.mrope_section={list(section)} must sum to "
                         f"head_dim / 2 = {lm.head_dim // 2}")
    if cfg.vision_config.out_hidden_size != lm.hidden_size:
        raise ValueError(f"{cfg.model_type}: vision_config.out_hidden_size={cfg.vision_config.out_hidden_size} must "
                         f"equal the language model's hidden_size={lm.hidden_size}")
    return section


def has_images(mb: dict) -> bool:
    """True when micro-batch ``mb`` carries images (a non-empty ``image_grid_thw``)."""
    grid = mb.get("image_grid_thw")
    return grid is not None and grid.numel() > 0


def prompt_tokens(mb: dict) -> torch.Tensor:
    """``[b, s]`` bool: the prompt positions of micro-batch ``mb``'s rows (before each row's
    ``seq_lengths - response_lengths``; every real token when the rows have no ``response_lengths``)."""
    ids = mb["input_ids"]
    lengths = mb.get("seq_lengths")
    if lengths is None:
        return torch.ones_like(ids, dtype=torch.bool)
    prompt = lengths - mb["response_lengths"] if "response_lengths" in mb else lengths
    return torch.arange(ids.shape[1], device=ids.device)[None, :] < prompt.to(ids.device)[:, None]


def multimodal_inputs(model: torch.nn.Module, mb: dict, inputs, cp_rank: int = 0) -> dict:
    """The keyword inputs a vision-language model's shard takes for micro-batch ``mb`` beyond its
    token ids: M-RoPE ``position_ids`` ``[3, b, s_local]`` for this rank's tokens (``inputs``: the
    micro-batch's :class:`parallel.packing.ModelInputs`, whose ``index[cp_rank]`` ``[b, s_local]`` is the
    flat ``row * seq + col`` position of every local token in the padded micro-batch, -1 for alignment
    padding; packed inputs: ``[3, 1, T]`` for the whole packed stream of every CP rank, in the order of
    :meth:`parallel.packing.ModelInputs.stream_index`, of which Megatron's ``thd`` rotary takes each rank's
    share), the images, ``image_mask`` ``[b, s_local]``: the placeholders in each row's prompt, which the
    images fill, and ``image_index`` ``[b, s_local]``: each of them's rank among the micro-batch's placeholders
    (the feature row it takes; -1 elsewhere), so a context-parallel rank fills its own share. A response's
    tokens count as text for both, whatever they are (a sampled
    placeholder token shows no image: the rollout engine, as transformers' ``generate``, feeds images
    at the prompt only). ``{}`` for a text model.
    Raises ValueError for inputs without that index (shared-prompt trees), or prompt placeholders in a
    micro-batch that carries no images (a batch that lost its rows' images)."""
    from alignment.models.vlm_model import VisionLanguageModel
    from parallel.names import unwrap

    vlm = unwrap(model)
    if not isinstance(vlm, VisionLanguageModel):
        return {}
    if not hasattr(inputs, "index"):
        raise ValueError("shared-prompt packing (trainer.shared_prompt_packing) has no M-RoPE positions for a "
                         "vision-language model; set it to false")
    index = inputs.index[cp_rank]
    grid = mb.get("image_grid_thw") if has_images(mb) else None
    in_prompt = prompt_tokens({k: v.cpu() for k, v in mb.items() if k in ("input_ids", "seq_lengths",
                                                                           "response_lengths")})
    ids = torch.where(in_prompt, mb["input_ids"].cpu(), -1)  # responses as text
    if grid is None and bool((ids == vlm.dims.image_token_id).any()):
        raise ValueError(f"{int((ids == vlm.dims.image_token_id).sum())} image placeholder tokens in the prompts of a "
                         "micro-batch that carries no images (pixel_values / image_grid_thw): the rows lost their images")
    positions = vlm.spec.positions(ids, mb.get("seq_lengths"), None if grid is None else grid.cpu(),
                                   vlm.dims)  # [3, rows, seq]
    # packed (thd): the whole stream's positions, whose zig-zag share Megatron's thd rotary takes per CP rank itself;
    # padded rows: this rank's own
    where = (inputs.stream_index() if inputs.packed_seq_params is not None else index).cpu()
    at = where.reshape(-1)
    taken = positions.reshape(3, -1)[:, at.clamp(min=0)] * (at >= 0)
    out = {"position_ids": taken.view(3, *where.shape).to(index.device)}
    flat = index.cpu().reshape(-1)
    real = flat >= 0
    if grid is not None:
        placeholders = (ids == vlm.dims.image_token_id).reshape(-1)  # [rows * seq], the whole micro-batch's
        mask = placeholders[flat.clamp(min=0)] & real
        rank = (placeholders.cumsum(0) - 1)[flat.clamp(min=0)]  # each local token's placeholder rank
        out.update(pixel_values=mb["pixel_values"], image_grid_thw=grid, image_mask=mask.view(index.shape).to(index.device),
                   image_index=torch.where(mask, rank, -1).view(index.shape).to(index.device))
    return out
