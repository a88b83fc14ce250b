"""Chat message contents with images: the content parts of a message (TRL's / OpenAI's text and image
parts), where a record's images go in its messages (:func:`place_images`: verl's ``<image>`` placeholders,
or TRL's rule), the image files a record's prompt shows (paths, or image bytes kept in the data written to
files once: :func:`image_path`), and a content's text. Shared by the SFT / preference records
(:mod:`alignment.data.chat_data`) and the RL prompt files (:mod:`alignment.data.prompt_data`).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import tempfile

from alignment.cache import cache_root

#: verl's image placeholder in a message's text (RLHFDataset splits the text at it into image and text parts)
IMAGE_PLACEHOLDER = "<image>"
_PLACEHOLDER = re.compile(re.escape(IMAGE_PLACEHOLDER))


def record_image_list(r: dict) -> list:
    """A record's images as the data gives them: the ``images`` column (TRL's and verl's; a list, or one), or
    TRL's single ``image`` column; empty without either."""
    listed = r.get("images")
    if listed is None and r.get("image") is not None:
        listed = [r["image"]]
    if listed is None:
        return []
    return list(listed) if isinstance(listed, (list, tuple)) else [listed]


def place_images(where: str, msgs: tuple[dict, ...], count: int) -> tuple[dict, ...]:
    """The messages with a part for each of the record's ``count`` images, when they have none yet: verl's
    ``<image>`` placeholders in the text of user messages become image parts where they stand
    (``RLHFDataset._build_messages``); without a placeholder, the images go before the first user message's
    text, as TRL's ``prepare_multimodal_messages`` puts them. Messages with image parts already are returned
    as they are (:func:`record_images` matches parts and files).

    Raises:
        ValueError: naming ``where``, when the placeholders and the images differ in number.
    """
    if not count or has_image_parts(msgs):
        return msgs
    marks = sum(len(_PLACEHOLDER.findall(m["content"])) for m in msgs
                if m["role"] == "user" and isinstance(m["content"], str))
    out = []
    if marks:
        if marks != count:
            raise ValueError(f"{where}: {marks} {IMAGE_PLACEHOLDER} placeholders in the prompt and {count} images; give "
                             f"one {IMAGE_PLACEHOLDER} per image, in order")
        for m in msgs:
            if m["role"] != "user" or not isinstance(m["content"], str) or IMAGE_PLACEHOLDER not in m["content"]:
                out.append(m)
                continue
            parts = []
            for i, piece in enumerate(m["content"].split(IMAGE_PLACEHOLDER)):
                if i:
                    parts.append({"type": "image"})
                if piece:
                    parts.append({"type": "text", "text": piece})
            out.append({**m, "content": parts})
        return tuple(out)
    first = next((i for i, m in enumerate(msgs) if m["role"] == "user"), None)
    if first is None:
        raise ValueError(f"{where}: {count} images but no user message to show them in")
    for i, m in enumerate(msgs):
        if i == first:
            text = m["content"] if isinstance(m["content"], str) else None
            parts = [{"type": "image"} for _ in range(count)]
            parts += [{"type": "text", "text": text}] if text is not None else list(m["content"])
            m = {**m, "content": parts}
        out.append(m)
    return tuple(out)


def image_path(where: str, entry) -> str:
    """The file of one image entry of a record: a path as given; the bytes of an image kept in the data (a
    Parquet ``{"bytes": ..., "path": ...}`` struct, as ``datasets`` writes an ``Image`` column, or a decoded
    ``PIL.Image``) written once to ``$MEGALIGN_CACHE/images/<sha256>`` (atomically) and that file's path.

    Raises:
        ValueError: naming ``where``, for an entry that is none of these.
    """
    if isinstance(entry, str):
        return entry
    data = None
    if isinstance(entry, dict):
        if entry.get("bytes"):
            data = bytes(entry["bytes"])
        elif isinstance(entry.get("path"), str) and entry["path"]:
            return entry["path"]
    elif hasattr(entry, "save") and hasattr(entry, "size"):  # a PIL image
        buf = io.BytesIO()
        entry.save(buf, format="PNG")
        data = buf.getvalue()
    if data is None:
        raise ValueError(f"{where}: an image is a file path, {{bytes, path}} (a datasets Image column) or an image, "
                         f"not {type(entry).__name__} {str(entry)[:60]!r}")
    folder = cache_root() / "images"
    target = folder / hashlib.sha256(data).hexdigest()
    if not target.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)  # atomic: a reader never sees half an image
    return str(target)


def image_key(entry) -> str:
    """What identifies an image entry for de-duplication: its path, or the sha256 of its bytes."""
    if isinstance(entry, dict) and entry.get("bytes"):
        return hashlib.sha256(bytes(entry["bytes"])).hexdigest()
    if isinstance(entry, dict):
        return str(entry.get("path"))
    if hasattr(entry, "tobytes"):
        return hashlib.sha256(entry.tobytes()).hexdigest()
    return str(entry)


def content_parts(where: str, content: list) -> list[dict]:
    """A message's content parts (TRL's / OpenAI's ``[{"type": "text", "text": ...}, {"type": "image"}]``;
    an image part may name its file: ``{"type": "image", "image": "a.png"}``), checked and copied.
    Raises ValueError, naming ``where``, for a part that is neither a text nor an image part."""
    out = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind == "image":
            out.append({"type": "image", **({"image": part["image"]} if isinstance(part.get("image"), str) else {})})
        else:
            raise ValueError(f"{where}: a content part is {{'type': 'text', 'text': ...}} or {{'type': 'image'}}, "
                             f"not {part!r}")
    return out


def record_images(where: str, r: dict, msgs: tuple[dict, ...]) -> tuple[str, ...]:
    """The image files of a record's prompt, in the order of its image parts: the parts' own
    ``image`` names, else the record's images (:func:`record_image_list`: TRL's and verl's ``images``
    column, TRL's ``image``; paths, or bytes kept in the data: :func:`image_path`), one per part.
    Raises ValueError when the image parts and the images differ in number."""
    parts = [p for m in msgs if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image"]
    listed = record_image_list(r)
    named = [p["image"] for p in parts if "image" in p]
    if named and len(named) == len(parts) and not listed:
        return tuple(named)
    if len(listed) != len(parts) or named:
        raise ValueError(f"{where}: {len(parts)} image parts in the messages and {len(listed)} files in 'images'; give "
                         "one file per {'type': 'image'} part, in order (or name each in its part)")
    return tuple(image_path(where, x) for x in listed)


def content_text(content) -> str:
    """The text of a message's content: the string itself, or its text parts joined (image parts left out)."""
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in content if p["type"] == "text")


def has_image_parts(messages) -> bool:
    """Whether any message's content holds an image part."""
    return any(isinstance(m["content"], list) and any(p["type"] == "image" for p in m["content"]) for m in messages)
