"""Chat message contents with images: the content parts of a message (TRL's / OpenAI's text and image
parts), the image files a record's prompt shows, and a content's text. Shared by the SFT / preference
records (:mod:`alignment.data.chat_data`) and the RL prompt files (:mod:`alignment.data.prompt_data`).
"""

from __future__ import annotations


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
    ``image`` names, else the record's ``images`` list (TRL's and verl's column), one per part.
    Raises ValueError when the image parts and the files differ in number."""
    parts = [p for m in msgs if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image"]
    listed = r.get("images") or []
    if isinstance(listed, str):
        listed = [listed]
    named = [p["image"] for p in parts if "image" in p]
    if named and len(named) == len(parts) and not listed:
        return tuple(named)
    if len(listed) != len(parts) or named:
        raise ValueError(f"{where}: {len(parts)} image parts in the messages and {len(listed)} files in 'images'; give "
                         "one file per {'type': 'image'} part, in order (or name each in its part)")
    if not all(isinstance(x, str) for x in listed):
        raise ValueError(f"{where}: 'images' is a list of file paths (relative to the data file's folder)")
    return tuple(listed)


def content_text(content) -> str:
    """The text of a message's content: the string itself, or its text parts joined (image parts left out)."""
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in content if p["type"] == "text")


def has_image_parts(messages) -> bool:
    """Whether any message's content holds an image part."""
    return any(isinstance(m["content"], list) and any(p["type"] == "image" for p in m["content"]) for m in messages)
