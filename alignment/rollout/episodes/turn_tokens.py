"""The tokens an environment's answer adds to a conversation, by the chat template, without
re-tokenising anything the model wrote (token-in/token-out, as verl's agent loop and slime keep
their rollouts): the model's tokens stay as the engine sampled them, and the text between two
model turns (the end of the assistant turn, the observation messages, the next assistant header)
is rendered by the template and tokenised on its own.

The pieces come from the template itself, by difference: an assistant turn holding a marker is
rendered, and what follows the marker is the turn's closing (``<|im_end|>\\n`` for ChatML); the same
conversation with the observation messages and the generation prompt appended gives the
observation's text as the part after it.
"""

from __future__ import annotations

from collections.abc import Sequence

from alignment.data.chat_data import encode_prompt

__all__ = ["TurnTokens"]

_MARK = "\u2063MEGALIGN_TURN\u2063"  # content no real turn holds


class TurnTokens:
    """Token ids of an episode's prompt and of what goes between model turns, for one tokenizer.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        eos_token_ids: the ids that end a model turn (the engine stops at them).
        template_kwargs: keyword arguments of the chat template (``data.chat_template_kwargs``).
    Raises:
        ValueError: the template does not render a conversation as a prefix of the same
            conversation with more messages (the observation could not be cut out of it).
    """

    def __init__(self, tokenizer, eos_token_ids: Sequence[int], template_kwargs: dict | None = None):
        self.tokenizer, self.eos = tokenizer, set(int(i) for i in eos_token_ids)
        self.template_kwargs = dict(template_kwargs or {})
        self._renders_tools: bool | None = None
        self._base = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": _MARK}]
        rendered = self._render(self._base, generation_prompt=False)
        if rendered.count(_MARK) != 1:
            raise ValueError("the chat template does not render an assistant message's content once; "
                             "multi-turn rollouts need a template that does")
        self._prefix = rendered
        self.closing = rendered.split(_MARK, 1)[1]  # what ends an assistant turn, e.g. "<|im_end|>\n"

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                  **self.template_kwargs)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The episode's opening messages with the assistant generation prefix (``tools``: OpenAI
        function schemas the template lists, as ``apply_chat_template(tools=...)`` does)."""
        return encode_prompt(self.tokenizer, messages, **self.template_kwargs, **({"tools": tools} if tools else {}))

    def renders_tools(self) -> bool:
        """Whether the chat template lists a ``tools=`` argument in the prompt (SmolLM2's does not;
        Qwen2.5's and Qwen3's do)."""
        if self._renders_tools is None:
            probe = [{"type": "function", "function": {"name": "megalign_probe_tool", "parameters": {}}}]
            messages = [{"role": "user", "content": "Q"}]
            self._renders_tools = "megalign_probe_tool" in self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, tools=probe, **self.template_kwargs)
        return self._renders_tools

    def observation_text(self, observation: list[dict]) -> str:
        """The template's text for ``observation`` after an assistant turn, up to and including the
        next assistant header (without the closing of the assistant turn).

        Raises:
            ValueError: the template renders the longer conversation with a different beginning.
        """
        full = self._render(self._base + list(observation), generation_prompt=True)
        if not full.startswith(self._prefix):
            raise ValueError(f"the chat template renders the conversation differently once {observation[0]['role']!r} "
                             "messages follow the assistant's; token-in/token-out needs it to append only")
        return full[len(self._prefix):]

    def continuation_ids(self, turn_ids: Sequence[int], observation: list[dict]) -> list[int]:
        """The ids after a model turn ``turn_ids`` and before the model's next turn: the rest of the
        turn's closing (all of it when the turn stopped on a stop string or without EOS; what
        follows the EOS token's text otherwise), the observation and the next assistant header."""
        closing = self.closing
        if turn_ids and int(turn_ids[-1]) in self.eos:
            eos_text = self.tokenizer.decode([int(turn_ids[-1])])
            closing = closing[len(eos_text):] if closing.startswith(eos_text) else ""
        return self._encode(closing + self.observation_text(observation))
