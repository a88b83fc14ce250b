"""Images in a batch of rows: which micro-batch keys carry them and how rows are taken with their images.

A batch with images holds, beside its ``[N, ...]`` row tensors, ``image_counts`` ``[N]`` (images per
row) and the images of all rows in row order: ``image_grid_thw`` ``[images, 3]`` (each image's
(t, h, w) patch grid) and ``pixel_values`` ``[patches, C*T*p*p]`` (``t*h*w`` patch rows per image), as
an HF image processor (``Qwen2VLImageProcessor``) returns them for a list of images.
"""

from __future__ import annotations

import torch

# keys whose first dimension counts images or patches, not rows
IMAGE_KEYS = ("pixel_values", "image_grid_thw")


def select_rows(batch: dict[str, torch.Tensor], idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """Rows ``idx`` (``[m]`` indices into the batch, in the order given) of ``batch``, with their
    images (``pixel_values`` / ``image_grid_thw`` of those rows, in the new row order) when the batch
    has ``image_counts``. Raises ValueError when ``image_counts`` and ``image_grid_thw`` disagree."""
    out = {k: v[idx] for k, v in batch.items() if k not in IMAGE_KEYS}
    if "image_counts" not in batch:
        return out
    counts, grid = batch["image_counts"].long(), batch["image_grid_thw"].long()
    if int(counts.sum()) != grid.shape[0]:
        raise ValueError(f"image_counts sum to {int(counts.sum())} images, image_grid_thw has {grid.shape[0]}")
    first_image = torch.cumsum(counts, 0) - counts
    patches = grid.prod(-1)
    first_patch = torch.cumsum(patches, 0) - patches
    images = [j for i in idx.tolist() for j in range(int(first_image[i]), int(first_image[i] + counts[i]))]
    rows = [torch.arange(int(first_patch[j]), int(first_patch[j] + patches[j])) for j in images]
    out["image_grid_thw"] = grid[images] if images else grid[:0]
    out["pixel_values"] = batch["pixel_values"][torch.cat(rows)] if rows else batch["pixel_values"][:0]
    return out
