"""The records an SFT, reward-model or DPO-family job reads, in the layouts other projects write them, each
parsed into one example type:

* :class:`SFTExample` (SFT): alpaca (``instruction``, optional ``input``, ``output``, ``system``); TRL's
  conversational language modeling (``messages``, the last an assistant's: the target); TRL's
  prompt-completion, standard (``prompt`` and ``completion`` strings) or conversational (message lists);
  TRL's standard language modeling (``text``: trained on every token, no chat template).
* :class:`PreferencePair` (reward model, DPO): ShareGPT (``conversations`` + ``chosen`` / ``rejected``
  messages); TRL's preference with an explicit prompt (``prompt`` + ``chosen`` / ``rejected``, strings or
  message lists) or an implicit one (``chosen`` / ``rejected`` whole conversations or texts: the prompt is
  their common start, as TRL's ``extract_prompt`` takes it).
* :class:`UnpairedExample` (DPO with ``algorithm.loss_type=kto``, TRL's ``KTOTrainer``): TRL's unpaired
  preference (``prompt``, ``completion``, ``label``: desirable or not).

TRL's types: huggingface.co/docs/trl/dataset_formats ("Dataset formats and types"). ``data.columns``
renames a file's columns to these fields (LLaMA-Factory's ``dataset_info`` names). A record's images
(``images`` / ``image``) go at its image parts, else before its prompt's text
(:func:`alignment.data.content.place_images`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from alignment.data.content import content_parts, place_images, record_image_list, record_images

_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


@dataclass(frozen=True)
class SFTExample:
    """One instruction-following example: ``messages`` (the prompt turns) and the target ``response``;
    no messages: ``response`` is a plain text trained on whole (TRL's standard language modeling).
    ``images``: the image files of the prompt's image parts, in order, as the record gives them (relative
    to the data file's folder ``base``); ``where``: the record, for errors."""

    messages: tuple[Mapping[str, str], ...]
    response: str
    images: tuple[str, ...] = ()
    where: str = field(default="", compare=False)
    base: str = field(default="", compare=False)


@dataclass(frozen=True)
class PreferencePair:
    """A prompt (``messages``, possibly several turns) with a preferred and a dispreferred response."""

    messages: tuple[Mapping[str, str], ...]
    chosen: str
    rejected: str
    images: tuple[str, ...] = ()  # as SFTExample's
    where: str = field(default="", compare=False)
    base: str = field(default="", compare=False)


@dataclass(frozen=True)
class UnpairedExample:
    """A prompt (``messages``) with one response (``completion``) labelled desirable (``label`` True) or not:
    TRL's unpaired preference, KTO's data."""

    messages: tuple[Mapping[str, str], ...]
    completion: str
    label: bool
    images: tuple[str, ...] = ()  # as SFTExample's
    where: str = field(default="", compare=False)
    base: str = field(default="", compare=False)


#: ``data.columns``' names (LLaMA-Factory's ``dataset_info`` names, and TRL's fields) -> the record fields they
#: fill, per kind
COLUMNS = {"sft": {"prompt": "instruction", "query": "input", "response": "output", "messages": "messages",
                   "system": "system", "completion": "completion", "text": "text"},
           "preference": {"prompt": "prompt", "messages": "conversations", "chosen": "chosen", "rejected": "rejected",
                          "system": "system", "completion": "completion", "label": "label"}}


def check_columns(columns: dict, kind: str) -> None:
    """``data.columns`` for ``kind`` (``sft`` | ``preference``) names only :data:`COLUMNS`' fields.

    Raises:
        ValueError: an unknown name, naming the valid ones.
    """
    unknown = sorted(set(columns) - set(COLUMNS[kind]))
    if unknown:
        raise ValueError(f"data.columns has {unknown}; for {kind} records it maps {', '.join(COLUMNS[kind])} to your "
                         "file's column names, e.g. {prompt: question, response: answer}")


def map_columns(where: str, r: dict, columns: dict, kind: str) -> dict:
    """Record ``r`` with ``data.columns``' file columns renamed to the fields this kind reads (the
    other columns dropped when any is mapped away from its own name).

    Raises:
        ValueError: a mapped column the record lacks (naming it and the columns it has).
    """
    if not columns:
        return r
    out = dict(r)
    for name, column in columns.items():
        field_name = COLUMNS[kind][name]
        if column not in r:
            if name in ("query", "system"):  # optional in every record
                continue
            raise ValueError(f"{where}: data.columns.{name}={column!r}, but the record has no such column; its "
                             f"columns are {', '.join(r)}")
        out.pop(column, None)
        out[field_name] = r[column]
    return out


def _text(where: str, r: dict, key: str) -> str:
    value = r.get(key)
    if isinstance(value, dict):  # ShareGPT's {"from": ..., "value": ...}
        value = value.get("value")
    if not isinstance(value, str):
        raise ValueError(f"{where}: {key!r} must be a string (got {type(value).__name__})")
    return value


def messages_of(where: str, turns) -> tuple[dict, ...]:
    """A conversation (``role`` / ``content`` messages, or ShareGPT's ``from`` / ``value``) checked and
    copied; a user's content may be a list of text and image parts.

    Raises:
        ValueError: naming ``where``: not a non-empty list of messages, an unknown role, a content of the
            wrong type.
    """
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{where}: the conversation must be a non-empty list of messages")
    out = []
    for m in turns:
        if not isinstance(m, dict):
            raise ValueError(f"{where}: a message is an object with role/content (or from/value)")
        role, content = ((m.get("role"), m.get("content")) if "role" in m
                         else (_ROLES.get(m.get("from")), m.get("value")))
        if isinstance(content, list):
            content = content_parts(where, content)
        if role not in ("system", "user", "assistant") or not isinstance(content, (str, list)):
            raise ValueError(f"{where}: a message needs a role (system, user, assistant; or from: human, gpt, system) "
                             "and a content (a string, or a list of text and image parts)")
        out.append({"role": role, "content": content})
    return tuple(out)


def _plain(where: str, content) -> str:
    """The text of a message that must be text only (a response): a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if any(p["type"] != "text" for p in content):
        raise ValueError(f"{where}: a response has text parts only (images go in the prompt)")
    return "".join(p["text"] for p in content)


def _with_system(where: str, r: dict, msgs: tuple[dict, ...]) -> tuple[dict, ...]:
    system = r.get("system")
    if not system or msgs[0]["role"] == "system":
        return msgs
    return ({"role": "system", "content": _text(where, r, "system")},) + msgs


def _prompt(where: str, r: dict, value) -> tuple[dict, ...]:
    """A prompt (a string: one user message; or messages, ending with a user's), the system message and the
    record's images placed."""
    msgs = ({"role": "user", "content": value},) if isinstance(value, str) else messages_of(where, value)
    if msgs[-1]["role"] != "user":
        raise ValueError(f"{where}: a prompt ends with a user message (the response answers it)")
    return place_images(where, _with_system(where, r, msgs), len(record_image_list(r)))


def _response(where: str, r: dict, key: str) -> str:
    """A response: a string, or TRL's conversational ``[{"role": "assistant", "content": ...}]`` (one or more
    assistant messages, joined)."""
    value = r.get(key)
    if isinstance(value, list):
        msgs = messages_of(where, value)
        if any(m["role"] != "assistant" for m in msgs):
            raise ValueError(f"{where}: {key!r} holds the assistant's reply: a string or assistant messages only")
        return "".join(_plain(where, m["content"]) for m in msgs)
    return _text(where, r, key)


def sft_example(where: str, r: dict) -> SFTExample:
    """An SFT record in any of the layouts of the module docstring.

    Raises:
        ValueError: naming ``where``, for a record of no known layout or with fields of the wrong type.
    """
    if "messages" in r:
        msgs = messages_of(where, r["messages"])
        if msgs[-1]["role"] != "assistant" or len(msgs) < 2:
            raise ValueError(f"{where}: 'messages' must end with the assistant's response after a prompt")
        prompt = _prompt(where, r, list(msgs[:-1]))
        return SFTExample(prompt, _plain(where, msgs[-1]["content"]), record_images(where, r, prompt), where)
    if "prompt" in r and "completion" in r:
        prompt = _prompt(where, r, r["prompt"])
        return SFTExample(prompt, _response(where, r, "completion"), record_images(where, r, prompt), where)
    if "text" in r and "output" not in r:
        text = _text(where, r, "text")
        if not text.strip():
            raise ValueError(f"{where}: the text is empty")
        return SFTExample((), text, (), where)
    missing = [k for k in ("instruction", "output") if k not in r]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)} (an SFT record is alpaca-style instruction, input, "
                         "output; or messages; or prompt and completion; or text; data.columns maps your column names)")
    prompt = _text(where, r, "instruction")
    prompt = prompt if not r.get("input") else f"{prompt}\n\n{_text(where, r, 'input')}"
    msgs = _prompt(where, r, prompt)
    return SFTExample(msgs, _text(where, r, "output"), record_images(where, r, msgs), where)


def _common_start(chosen, rejected) -> int:
    """How much ``chosen`` and ``rejected`` (two conversations, or two texts) share from their start: TRL's
    ``extract_prompt`` (for texts, a space just before the split goes with the responses)."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    if isinstance(chosen, str) and n and chosen[n - 1] == " ":
        n -= 1
    return n


def _implicit_prompt(where: str, r: dict) -> PreferencePair:
    chosen, rejected = r.get("chosen"), r.get("rejected")
    if isinstance(chosen, list) and isinstance(rejected, list):
        c, j = messages_of(where, chosen), messages_of(where, rejected)
        n = _common_start(c, j)
        if n == 0 or c[n - 1]["role"] != "user":
            raise ValueError(f"{where}: 'chosen' and 'rejected' must start with the same prompt (ending with a user "
                             "message) when there is no 'prompt' (TRL's implicit prompt)")
        if any(m["role"] != "assistant" for m in c[n:] + j[n:]) or not c[n:] or not j[n:]:
            raise ValueError(f"{where}: after their common prompt, 'chosen' and 'rejected' must each hold the "
                             "assistant's reply only")
        prompt = _prompt(where, r, [dict(m) for m in c[:n]])
        reply = lambda msgs: "".join(_plain(where, m["content"]) for m in msgs)  # noqa: E731
        return PreferencePair(prompt, reply(c[n:]), reply(j[n:]), record_images(where, r, prompt), where)
    c, j = _text(where, r, "chosen"), _text(where, r, "rejected")
    n = _common_start(c, j)
    if n == 0 or n == len(c) or n == len(j):
        raise ValueError(f"{where}: 'chosen' and 'rejected' share no prompt (TRL's implicit prompt is their common "
                         "start) or one holds the other whole; give a 'prompt' column")
    prompt = _prompt(where, r, c[:n])
    return PreferencePair(prompt, c[n:], j[n:], record_images(where, r, prompt), where)


def preference_pair(where: str, r: dict) -> PreferencePair:
    """A preference record in any of the layouts of the module docstring.

    Raises:
        ValueError: naming ``where``, for a record of no known layout or with fields of the wrong type.
    """
    missing = [k for k in ("chosen", "rejected") if k not in r]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)} (a preference record has a prompt, chosen and "
                         "rejected; data.columns maps your column names)")
    if "conversations" not in r and "prompt" not in r:
        return _implicit_prompt(where, r)
    prompt = _prompt(where, r, r.get("conversations", r.get("prompt")))
    return PreferencePair(prompt, _response(where, r, "chosen"), _response(where, r, "rejected"),
                          record_images(where, r, prompt), where)


def unpaired_example(where: str, r: dict) -> UnpairedExample:
    """TRL's unpaired preference record: ``prompt``, ``completion`` (strings, or conversational) and ``label``
    (true: desirable).

    Raises:
        ValueError: naming ``where``, for a missing field or a label that is not true / false.
    """
    missing = [k for k in ("prompt", "completion", "label") if k not in r]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)} (an unpaired preference record has prompt, "
                         "completion and label)")
    if not isinstance(r["label"], bool):
        raise ValueError(f"{where}: 'label' is true (a desirable completion) or false, not {r['label']!r}")
    prompt = _prompt(where, r, r["prompt"])
    return UnpairedExample(prompt, _response(where, r, "completion"), r["label"], record_images(where, r, prompt),
                           where)


_IMAGES = {"images", "image", "system"}


def fields_read(r: dict, kind: str) -> set[str]:
    """The fields of record ``r`` (after ``data.columns``) that its layout reads, for ``kind`` (``sft`` |
    ``preference``): the others are named as unused in the start-up summary."""
    if kind == "sft":
        if "messages" in r:
            return {"messages"} | _IMAGES
        if "prompt" in r and "completion" in r:
            return {"prompt", "completion"} | _IMAGES
        if "text" in r and "output" not in r:
            return {"text"}
        return {"instruction", "input", "output"} | _IMAGES
    if is_unpaired(r):
        return {"prompt", "completion", "label"} | _IMAGES
    return {"conversations" if "conversations" in r else "prompt", "chosen", "rejected"} | _IMAGES


def is_unpaired(r: dict) -> bool:
    """Whether a preference record is TRL's unpaired kind (a ``label``, no ``chosen``)."""
    return "label" in r and "chosen" not in r
