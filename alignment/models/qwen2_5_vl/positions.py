"""Multimodal RoPE positions (M-RoPE) of Qwen2-VL / Qwen2.5-VL sequences.

Every token gets three positions (time, height, width). Text tokens have the same value in all
three, counting up by one. An image's ``t x h x w`` merged patches (``h = grid_h / merge``,
``w = grid_w / merge``; ``t = 1`` for a still image) take ``(start, start + i, start + j)`` for
the patch in merged row ``i``, column ``j``, where ``start`` is the position the next text
token would have had; the text after the image continues from ``start + max(h, w)``.

Source: Wang et al. 2024, "Qwen2-VL" (arXiv:2409.12191), section 2.1 (M-RoPE); transformers
``Qwen2_5_VLModel.get_rope_index`` (images; megalign has no video input).
"""

from __future__ import annotations

import torch


def mrope_position_ids(input_ids: torch.Tensor, seq_lengths: torch.Tensor | None, image_grid_thw: torch.Tensor | None,
                       dims) -> torch.Tensor:
    """M-RoPE positions of a right-padded batch.

    Args:
        input_ids: ``[rows, seq]`` token ids; each image is ``t*h*w / merge**2`` consecutive
            ``dims.image_token_id`` placeholders.
        seq_lengths: ``[rows]`` real tokens per row (None: every row is full).
        image_grid_thw: ``[images, 3]`` the (t, h, w) patch grid of every image, in the order the
            images appear (row by row); None or empty when no row has images.
        dims: the model's :class:`alignment.models.dims.ModelDims` (``image_token_id``,
            ``vision.spatial_merge_size``).
    Returns:
        ``[3, rows, seq]`` int64 positions (time, height, width). Padding positions continue the
        text count (they are never read: padding is masked out of every loss).
    Raises:
        ValueError: the placeholders of an image are fewer than its grid needs, a grid does not
            divide by the merge size, or there are more grids than images (or fewer).
    """
    rows, seq = input_ids.shape
    merge = dims.vision.spatial_merge_size
    grids = [tuple(int(x) for x in g) for g in (image_grid_thw if image_grid_thw is not None else [])]
    out = torch.empty(3, rows, seq, dtype=torch.long)
    next_image = 0
    for r in range(rows):  # a loop over images, not tokens: text positions are the index minus a running shift
        n = seq if seq_lengths is None else int(seq_lengths[r])
        spots = (input_ids[r, :n] == dims.image_token_id).nonzero().flatten().tolist()
        shift = torch.zeros(seq + 1, dtype=torch.long)  # += (tokens - positions) of each image, at its end
        images, used = [], 0
        while used < len(spots):
            i = spots[used]
            if next_image >= len(grids):
                raise ValueError(f"row {r}: image placeholder at token {i} but only {len(grids)} image grids "
                                 "(image_grid_thw) for the batch")
            t, gh, gw = grids[next_image]
            if gh % merge or gw % merge:
                raise ValueError(f"image {next_image}: grid {grids[next_image]} does not divide by the merge size {merge}")
            h, w = gh // merge, gw // merge
            count = t * h * w
            if used + count > len(spots) or spots[used + count - 1] != i + count - 1:
                raise ValueError(f"row {r}: image {next_image} with grid {grids[next_image]} needs {count} "
                                 f"placeholder tokens from token {i}, the row has fewer (truncated?)")
            images.append((i, t, h, w))
            shift[i + count] += count - max(h, w)
            used, next_image = used + count, next_image + 1
        shift = shift.cumsum(0)[:seq]
        pos = torch.arange(seq) - shift  # text (and padding: it continues the text count)
        out[:, r] = pos.expand(3, -1)
        for i, t, h, w in images:
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
            out[:, r, i:i + t * h * w] = torch.stack([tt, hh, ww]).reshape(3, -1) + pos[i]
    if next_image != len(grids):
        raise ValueError(f"{len(grids)} image grids (image_grid_thw) for {next_image} images in the batch")
    return out
