"""Prompts that show images: the token ids an engine generates from, with the images their
placeholders stand for (vLLM's ``TokensPrompt`` with ``multi_modal_data``).

An :class:`ImagePrompt` is a ``list[int]`` (so every step that deals, measures or extends prompts
treats it as one) carrying :class:`alignment.data.images.ImageInputs`. Its image placeholders are
already expanded to each image's token count, so its length is what the engine's context holds.
Megatron's engine (``rollout.backend=megatron``) runs the vision tower on the processed images; vLLM
(``rollout.backend=vllm``) takes the decoded images (``ImageInputs.decoded_images``) and processes them with
the same HF image processor. The samples keep them (``Sample.images``), so the trainer's forward sees the
same images.
"""

from __future__ import annotations

from collections.abc import Sequence

from alignment.data.images import ImageInputs, ImageProcessor

__all__ = ["ImagePrompt", "image_prompts", "images_of"]


class ImagePrompt(list):
    """Token ids (``list[int]``, image placeholders expanded) and ``images``, the
    :class:`alignment.data.images.ImageInputs` of its placeholders in order."""

    def __init__(self, ids, images: ImageInputs):
        super().__init__(ids)
        self.images = images

    def __reduce__(self):  # pickled whole (gathered over ranks)
        return ImagePrompt, (list(self), self.images)


def images_of(prompt) -> ImageInputs | None:
    """The images a prompt shows (an :class:`ImagePrompt`'s), None for plain token ids."""
    return prompt.images if isinstance(prompt, ImagePrompt) else None


def image_prompts(processor: ImageProcessor | None, problems: Sequence, prompts: list[list[int]]) -> list[list[int]]:
    """``prompts`` (chat-template token ids, one placeholder per image part) of ``problems`` whose
    ``images`` (files) are decoded in one thread pool, encoded by ``processor`` (the model's own
    image processor) and expanded into :class:`ImagePrompt` s; the prompts of problems without images
    are returned as they are.

    Raises:
        ValueError: a problem with images and no ``processor`` (a text model), or placeholders and
            images that differ in number (naming the problem's question).
        FileNotFoundError: a missing image file (naming it).
    """
    if not any(getattr(p, "images", ()) for p in problems):
        return prompts
    where = [f"prompt {p.question[:60]!r}" for p in problems]
    if processor is None:
        raise ValueError(f"{where[0]} shows images, but the model is a text model; give a vision-language model "
                         "(model.path) or drop the image parts")
    inputs = processor.encode_files([tuple(p.images) for p in problems], where)
    return [ImagePrompt(processor.expand(list(ids), im, w), im) if im is not None else ids
            for ids, im, w in zip(prompts, inputs, where)]
