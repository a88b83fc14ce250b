"""Images in the data: decoding them (Pillow, in a thread pool, while the data is read, never on the
training hot path), turning them into the model's patches with the family's own image processor, the
placeholder tokens they take in the text, and how a batch of rows carries them.

A batch with images holds, beside its ``[N, ...]`` row tensors, ``image_counts`` ``[N]`` (images per
row) and the images of all rows in row order: ``image_grid_thw`` ``[images, 3]`` (each image's
(t, h, w) patch grid) and ``pixel_values`` ``[patches, C*T*p*p]`` (``t*h*w`` patch rows per image), as
the HF image processor (``Qwen2VLImageProcessor``) returns them for a list of images.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

# keys whose first dimension counts images or patches, not rows
IMAGE_KEYS = ("pixel_values", "image_grid_thw")


@dataclass(frozen=True)
class ImageInputs:
    """The images of one row, processed: ``pixel_values`` ``[patches, C*T*p*p]`` and
    ``image_grid_thw`` ``[images, 3]``, in the order their placeholders appear; ``decoded_images``: the
    decoded images (``PIL.Image``) they were made from, for an engine that processes images itself
    (vLLM's ``multi_modal_data``), empty when not kept."""

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    decoded_images: tuple = field(default=(), compare=False, repr=False)

    @property
    def count(self) -> int:
        return self.image_grid_thw.shape[0]


def load_images(paths: list[str], where: list[str], workers: int = 4) -> list:
    """Decode image files with Pillow in a pool of ``workers`` threads (Pillow's decoders release the
    GIL), as RGB ``PIL.Image`` objects in the order given. ``where[i]`` names the record of
    ``paths[i]`` for errors.

    Raises:
        FileNotFoundError: a missing file, naming it and its record.
        ValueError: a file Pillow cannot decode, naming it, its record and Pillow's reason.
    """
    from PIL import Image, UnidentifiedImageError

    def one(i: int):
        path = paths[i]
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{where[i]}: image {path} does not exist")
        try:
            with Image.open(path) as im:
                return im.convert("RGB")
        except (UnidentifiedImageError, OSError, ValueError) as e:
            raise ValueError(f"{where[i]}: image {path} cannot be decoded ({type(e).__name__}: {e}); give a PNG, JPEG "
                             "or another format Pillow reads") from None

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(one, range(len(paths))))


def resolve(path: str, base: Path) -> str:
    """An image path of a record: absolute as given, else relative to the data file's folder ``base``."""
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else base / p)


class ImageProcessor:
    """A vision-language model's image processing: the family's own HF image processor (read from
    the model directory with ``AutoImageProcessor``), and how many placeholder tokens an image takes.

    Args:
        hf_dir: the model directory (its ``preprocessor_config.json`` / ``processor_config.json``).
        image_token_id: the placeholder token (HF config ``image_token_id``).
    Raises:
        ValueError: the directory has no image processor config.
    """

    def __init__(self, hf_dir, image_token_id: int):
        from transformers import AutoImageProcessor

        try:
            self.processor = AutoImageProcessor.from_pretrained(str(hf_dir))
        except (OSError, ValueError) as e:
            raise ValueError(f"model.path={hf_dir}: no image processor config (preprocessor_config.json) for this "
                             f"vision-language model ({e})") from None
        self.image_token_id = image_token_id
        self.merge = int(getattr(self.processor, "merge_size", 1))

    def encode(self, images: list) -> ImageInputs:
        """The patches of ``images`` (PIL images) for the model (the images kept beside them)."""
        out = self.processor(images=images, return_tensors="pt")
        return ImageInputs(out["pixel_values"], out["image_grid_thw"].long(), tuple(images))

    def encode_files(self, files: list[tuple[str, ...]], where: list[str]) -> list[ImageInputs | None]:
        """Each entry's image files (``files[i]``, paths to open; ``where[i]`` names its record for
        errors) decoded in one thread pool (:func:`load_images`) and encoded; None for an entry without.

        Raises:
            FileNotFoundError, ValueError: as :func:`load_images`.
        """
        flat = [(f, w) for fs, w in zip(files, where) for f in fs]
        pics = iter(load_images([f for f, _ in flat], [w for _, w in flat]))
        return [self.encode([next(pics) for _ in fs]) if fs else None for fs in files]

    def tokens(self, inputs: ImageInputs) -> list[int]:
        """Placeholder tokens each image of ``inputs`` takes (``t*h*w / merge**2``)."""
        return [int(g.prod()) // self.merge ** 2 for g in inputs.image_grid_thw]

    def expand(self, ids: list[int], inputs: ImageInputs, where: str) -> list[int]:
        """``ids`` with its one placeholder per image (as chat templates render an image part)
        repeated to the image's token count. Raises ValueError, naming ``where``, when the
        placeholders and the images differ in number."""
        counts = self.tokens(inputs)
        spots = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(spots) != len(counts):
            raise ValueError(f"{where}: the prompt renders {len(spots)} image placeholders for {len(counts)} images "
                             "(one image part in the messages per entry of 'images')")
        out, last = [], 0
        for spot, n in zip(spots, counts):
            out += ids[last:spot] + [self.image_token_id] * n
            last = spot + 1
        return out + ids[last:]


def attach_images(batch: dict[str, torch.Tensor], images: list[ImageInputs | None]) -> dict[str, torch.Tensor]:
    """Give ``batch`` (``N`` rows) its rows' images (``images[i]``: row ``i``'s, None for a text
    row): ``image_counts`` ``[N]``, ``image_grid_thw`` and ``pixel_values`` concatenated in row order.
    A batch whose rows have no images is returned unchanged."""
    present = [im for im in images if im is not None and im.count]
    if not present:
        return batch
    batch["image_counts"] = torch.tensor([0 if im is None else im.count for im in images])
    batch["image_grid_thw"] = torch.cat([im.image_grid_thw for im in present])
    batch["pixel_values"] = torch.cat([im.pixel_values for im in present])
    return batch


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
