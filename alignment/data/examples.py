"""A fixed-data job's examples (SFT, reward model, DPO family, process reward model), read from
``data.dataset`` and tokenized with the model's chat template into the rows the offline trainers
(:mod:`alignment.trainers.offline`) batch."""

from __future__ import annotations

from alignment.algorithms.config import (AlgorithmConfig, PreferenceConfig, ProcessRewardConfig, SFTConfig,
                                         has_section)
from alignment.data.chat_data import encode_example, image_files, load_preference_pairs, load_sft_examples
from alignment.data.config import DataConfig
from alignment.data.images import ImageInputs, ImageProcessor
from alignment.data.records import UnpairedExample
from alignment.data.step_data import encode_steps, load_records, supervised_labels


def tokenize_split(d: DataConfig, a: AlgorithmConfig, tokenizer, split: str,
                   images: ImageProcessor | None = None) -> list[list[tuple]]:
    """Per example, its rows ``(ids, prompt_len)``: one for SFT, ``[chosen, rejected]`` for pairs;
    an example with images (a vision-language model's ``images`` processor) has rows
    ``(ids, prompt_len, ImageInputs)`` (:func:`encode_with_images`); an unpaired preference example (KTO) one
    row ``(ids, prompt_len, ImageInputs | None, label)``; a plain text SFT example (TRL's language modeling)
    ``(ids, 1)``: every token after the first trained (:func:`encode_text`);
    for the PRM one ``(ids, prompt_len, step_ends, labels)`` per solution with a labelled step
    (:func:`tokenize_steps`). ``data.columns`` renames a file's columns; held out are
    ``data.heldout_files``, else ``data.heldout_fraction`` by prompt hash, else the last
    ``data.heldout_size``; training takes the first ``data.train_size`` (null: all).

    Raises:
        FileNotFoundError, ValueError: a data file missing or a record that cannot be read, named
            with its file and line (:mod:`alignment.data.chat_data`, :mod:`alignment.data.step_data`),
            an example the chat template does not render as a prompt prefix, or unpaired preference
            records for a job other than DPO with ``algorithm.loss_type=kto``.
    """
    enc = lambda msgs, resp: encode_example(tokenizer, msgs, resp, d.max_length, d.max_prompt_length)  # noqa: E731
    if has_section(a, ProcessRewardConfig):
        out = [[row] for row in tokenize_steps(d, a, tokenizer, split)]
        return out[: d.train_size] if split == "train" else out[: d.heldout_size]
    kw = {"heldout_files": d.heldout_files, "heldout_fraction": float(d.heldout_fraction or 0.0),
          "columns": dict(d.columns or {})}
    unpaired = False
    if has_section(a, SFTConfig):
        examples = load_sft_examples(split, d.heldout_size, d.dataset, **kw)
        responses = [(e.response,) for e in examples]
    else:
        examples = load_preference_pairs(split, d.heldout_size, d.dataset, **kw)
        unpaired = bool(examples) and isinstance(examples[0], UnpairedExample)
        kto = has_section(a, PreferenceConfig) and a.loss_type == "kto"
        if unpaired and not kto:
            raise ValueError(f"data.dataset={d.dataset}: unpaired preference records (prompt, completion, label) train "
                             f"with KTO (algorithm.loss_type=kto, --config-name dpo: TRL's KTOTrainer); algorithm.name="
                             f"{a.name}{' with loss_type=' + a.loss_type if has_section(a, PreferenceConfig) else ''} needs chosen / "
                             "rejected pairs")
        responses = [(e.completion,) if unpaired else (e.chosen, e.rejected) for e in examples]
    if split == "train" and d.train_size is not None:  # train_size null: every example
        examples, responses = examples[: d.train_size], responses[: d.train_size]
    decoded = decode_images(examples, images)

    def encode(e, r, pics):
        if not e.messages:  # TRL's language modeling: a text trained on whole
            return encode_text(tokenizer, r, d.max_length)
        if pics is None:
            return enc(e.messages, r)
        return encode_with_images(tokenizer, images, pics, e.messages, r, d.max_length, d.max_prompt_length, e.where)

    rows = [[encode(e, r, pics) for r in rs] for e, rs, pics in zip(examples, responses, decoded)]
    if unpaired:  # one row each, its desirability last (alignment/trainers/kto.py)
        return [[(ids, p, pics, e.label) for ids, p, *_ in example] for example, e, pics in zip(rows, examples, decoded)]
    return rows


def is_unpaired(d: DataConfig, a: AlgorithmConfig) -> bool:
    """Whether a DPO job's data is TRL's unpaired preference records (KTO's: a label per completion)."""
    if not has_section(a, PreferenceConfig):
        return False
    kw = {"heldout_files": d.heldout_files, "heldout_fraction": float(d.heldout_fraction or 0.0),
          "columns": dict(d.columns or {})}
    examples = load_preference_pairs("train", d.heldout_size, d.dataset, **kw)
    return bool(examples) and isinstance(examples[0], UnpairedExample)


def encode_text(tokenizer, text: str, max_length: int) -> tuple[list[int], int]:
    """A plain text as one row ``(ids, 1)``: the tokenizer's tokens (with its own special tokens, a BOS where it
    adds one), closed by its end-of-sequence token, cut to ``max_length``; every token after the first is
    trained (TRL's ``SFTTrainer`` on a ``text`` dataset: the language-modeling loss, no chat template).

    Raises:
        ValueError: ``max_length`` < 2 or a text of fewer than two tokens.
    """
    ids = list(tokenizer(text)["input_ids"])
    if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
        ids.append(tokenizer.eos_token_id)
    ids = ids[:max_length]
    if len(ids) < 2:
        raise ValueError(f"data.max_length={max_length}: a text needs at least 2 tokens to train on")
    return ids, 1


def decode_images(examples: list, images: ImageProcessor | None) -> list[ImageInputs | None]:
    """Every example's images decoded (Pillow, a thread pool over all files at once) and processed by
    the model's image processor; None for an example without images.

    Raises:
        ValueError: an example with images for a model that has no image processor (a text model).
        FileNotFoundError, ValueError: a missing or undecodable image (:func:`load_images`).
    """
    with_images = [e for e in examples if e.images]
    if not with_images:
        return [None] * len(examples)
    if images is None:
        raise ValueError(f"{with_images[0].where}: the record has images, but model.path is a text model; give a "
                         "vision-language model (e.g. Qwen2.5-VL) or drop the image parts")
    return images.encode_files([tuple(image_files(e)) if e.images else () for e in examples],
                               [e.where for e in examples])


def encode_with_images(tokenizer, images: ImageProcessor, inputs: ImageInputs, messages, response: str,
                       max_length: int, max_prompt_length: int | None, where: str) -> tuple[list[int], int, ImageInputs]:
    """:func:`alignment.data.chat_data.encode_example` for a prompt with images: each image's one
    placeholder (as the chat template renders an image part) repeated to its token count
    (:meth:`ImageProcessor.expand`); the prompt is never cut (an image cannot lose tokens), the
    response is cut to fit ``max_length``.

    Returns:
        ``(ids, prompt_len, inputs)``.
    Raises:
        ValueError: naming the record, when the prompt with its image tokens does not fit
            ``data.max_prompt_length`` (default ``max_length // 2``) or leaves no room for the response.
    """
    ids, p = encode_example(tokenizer, messages, response, 10 ** 9, 10 ** 9)
    prompt = images.expand(ids[:p], inputs, where)
    limit = max_prompt_length if max_prompt_length is not None else max_length // 2
    if len(prompt) > limit or len(prompt) >= max_length:
        raise ValueError(f"{where}: the prompt takes {len(prompt)} tokens ({sum(images.tokens(inputs))} for its "
                         f"{inputs.count} images), more than data.max_prompt_length={limit} (data.max_length="
                         f"{max_length}); raise them or make the images smaller (the image processor's max_pixels)")
    return prompt + ids[p:][: max_length - len(prompt)], len(prompt), inputs


def tokenize_steps(d: DataConfig, a: AlgorithmConfig, tokenizer, split: str) -> list[tuple[list[int], int, list[int], list[int]]]:
    """The job's rows from ``data.dataset``'s ``split``: per solution ``(ids, prompt_len,
    step_ends, labels)`` with only its labelled steps' end positions and 0/1 labels (by
    ``algorithm.supervision``; :func:`alignment.data.step_data.encode_steps`, steps ending past
    ``data.max_length`` dropped; the prompt is not cut: ``data.max_prompt_length`` does not apply).
    Solutions without a labelled step within ``data.max_length`` are left out.

    Raises:
        FileNotFoundError, ValueError: as :func:`alignment.data.step_data.load_records`.
    """
    rows = []
    for record in load_records(d.dataset, split):
        labels = supervised_labels(record, a.supervision)
        if not any(y is not None for y in labels):
            continue
        try:
            ids, prompt_len, ends = encode_steps(tokenizer, record.prompt, record.completions, a.step_separator,
                                                 d.max_length)
        except ValueError:  # the prompt leaves no room for a step within data.max_length
            continue
        kept = [(e, int(y)) for e, y in zip(ends, labels) if y is not None]
        if kept:
            rows.append((ids, prompt_len, [e for e, _ in kept], [y for _, y in kept]))
    return rows
