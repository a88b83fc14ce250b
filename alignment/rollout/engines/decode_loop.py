"""Static-batch generation with the whole decode step on the device: forward, sampling and the stop checks.

Megatron-Core 0.16.1's ``TextGenerationController.generate_all_output_tokens_static_batch`` does host work around
every decode step: a context window cut from the batch, timing events, the sampled tokens scattered by a boolean
mask, and two ``torch.all`` reads of device flags that wait for the step to finish. With the step itself a CUDA
graph (:class:`alignment.rollout.engines.static_decode.StaticDecoder`) that host work set the pace for a small model:
~4.3 ms a step on an H200 against the ~65 us its weights take to read (docs/results.md).

:class:`DecodeLoop` runs the same generation with everything a step decides on the device, in the step's graph:

- the logits as :mod:`alignment.rollout.engines.megatron_engine`'s wrapper returns them (fp32, divided by the temperature,
  ``-inf`` on the padding columns), the token drawn as ``argmax(p / e)``, ``e ~ Exp(1)`` (greedy: ``argmax``), and
  its logprob under ``log_softmax`` of those logits, exactly as the engine's controller draws them;
- rows still inside their prompt (static batching starts decoding at the shortest prompt) take their prompt's token
  instead; a row is done at its first EOS token (kept in the response) or at ``max_tokens`` response tokens;
- the tokens, logprobs and done flags live in device tensors of the batch size, written at the step's position
  (a tensor, so one graph serves every step of a 64-position bucket).

The host only replays the graph once a step and reads the done flags every ``check_every`` steps (a few steps
past the last EOS are wasted, their tokens never read). On a CPU the same code runs uncaptured and draws the same
random numbers in the same order as Megatron's loop, so both give the same tokens
(``tests/test_megatron_engine.py``).
"""

from __future__ import annotations

import torch

from alignment.rollout.engines.static_decode import StaticDecoder

CHECK_EVERY = 8  # decode steps between two reads of the done flags on a GPU (each read waits for the device)


def race_sample(logits: torch.Tensor) -> torch.Tensor:
    """One token per row from ``softmax(logits)``, ``logits`` ``[batch, vocab]`` (fp32, already divided by the
    temperature; ``-inf`` columns never drawn): ``argmax(p / e)`` with ``e ~ Exp(1)`` made from ``-log(uniform)``,
    the exponential-race form of ``multinomial(p)`` that vLLM samples with. Returns ``[batch]`` token ids. Both
    Megatron's loop (the engine's controller) and :class:`DecodeLoop` draw with it, so on a CPU they draw alike."""
    probs = torch.softmax(logits, dim=-1)
    race = torch.rand_like(probs).clamp_(min=torch.finfo(probs.dtype).tiny).log_().neg_()
    return (probs / race).argmax(dim=-1)


class _Rows:
    """One batch size's device state: ``tokens`` ``[batch, max_seq]`` (prompts, then what is generated),
    ``logprobs`` ``[batch, max_seq]`` (fp32, at each generated token's position), ``lengths`` ``[batch]`` (prompt
    lengths), ``done`` ``[batch]`` and the settings the step reads (``max_tokens`` ``[1]``, ``eos`` ``[n]``). Kept
    between calls: a captured graph reads these very tensors."""

    def __init__(self, batch: int, max_seq: int, n_eos: int, device):
        self.tokens = torch.zeros(batch, max_seq, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(batch, max_seq, dtype=torch.float32, device=device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)
        self.max_tokens = torch.zeros(1, dtype=torch.long, device=device)
        self.eos = torch.zeros(n_eos, dtype=torch.long, device=device)


class DecodeLoop:
    """Generation of a static batch on ``static``'s fixed-shape step, sampling and stop checks included (see the
    module docstring).

    Args:
        static: the decoder of the engine's model (its graphs, when captured, include this loop's sampling).
        eos_token_ids: a row is done at any of these tokens (counted in its response).
        vocab_size: the tokenizer's vocabulary; logits of Megatron's padding columns (ids >= it) are ``-inf``.
        check_every: steps between two reads of the done flags (default: :data:`CHECK_EVERY` with graphs, 1
            without, where a read costs nothing).
    """

    def __init__(self, static: StaticDecoder, eos_token_ids: set[int], vocab_size: int, check_every: int | None = None):
        self.static, self.vocab_size = static, vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.check_every = check_every or (CHECK_EVERY if static.graphs else 1)
        self._rows: dict[int, _Rows] = {}

    def generate(self, wrapper, prompts: list[list[int]], max_tokens: int, temperature: float, greedy: bool
                 ) -> list[tuple[list[int], list[float]]]:
        """Each prompt's response token ids (ending at its first EOS token, or ``max_tokens`` long) and their
        logprobs (nats, of ``softmax(logits / temperature)``; greedy: at temperature 1).

        ``wrapper``: the engine's ``GPTInferenceWrapper`` (its context is the KV cache; its forward runs the prefill,
        up to the shortest prompt, and returns fp32 logits divided by ``wrapper.temperature``). Call under
        ``torch.inference_mode()``, with the RNG to sample from seeded.

        Raises:
            ValueError: the longest prompt plus ``max_tokens`` exceeds the context's ``max_sequence_length``."""
        context = wrapper.inference_context
        lengths = [len(p) for p in prompts]
        batch, shortest, total = len(prompts), min(lengths), max(lengths) + max_tokens
        if total > context.max_sequence_length:
            raise ValueError(f"a prompt of {max(lengths)} tokens + max_tokens={max_tokens} exceeds the KV cache's "
                             f"{context.max_sequence_length} positions")
        device = next(self.static.model.parameters()).device
        rows = self._state(batch, context.max_sequence_length, device)
        rows.tokens.zero_()
        rows.tokens[:, :max(lengths)] = torch.tensor([p + [0] * (max(lengths) - len(p)) for p in prompts],
                                                     device=device)
        rows.lengths.copy_(torch.tensor(lengths, device=device))
        rows.done.zero_()
        rows.max_tokens.fill_(max_tokens)
        temperature = wrapper.temperature = 1.0 if greedy else float(temperature)

        wrapper.prep_model_for_inference()
        window = wrapper.get_batch_for_context_window(wrapper.prep_inference_input(rows.tokens[:, :total]), 0,
                                                      shortest)
        context.materialize_only_last_token_logits = True
        logits = wrapper.run_one_forward_step(window)  # the prefill: fp32, / temperature, padding -inf
        self._advance(rows, logits, torch.full((1,), shortest - 1, dtype=torch.long, device=device), None, greedy)
        position = shortest
        while position < total - 1:
            context.sequence_len_offset = position
            step = self.static.prepare(rows.tokens[:, position:position + 1], context)
            self.static.run(("loop", greedy, temperature, step.batch, step.end),
                            lambda: self._advance(rows, self.static.step(step), step.position, temperature, greedy),
                            restore=(rows.done,))
            position += 1
            if (position - shortest) % self.check_every == 0 and bool(rows.done.all()):
                break
        return self._responses(rows, lengths)

    def _state(self, batch: int, max_seq: int, device) -> _Rows:
        """The batch size's :class:`_Rows` (made once per size, KV length and EOS count; the settings refilled)."""
        rows = self._rows.get(batch)
        if rows is None or rows.tokens.size(1) != max_seq or rows.eos.numel() != len(self.eos_token_ids):
            rows = self._rows[batch] = _Rows(batch, max_seq, len(self.eos_token_ids), device)
            self.static.reset()  # graphs read the old tensors
        rows.eos.copy_(torch.tensor(self.eos_token_ids, dtype=torch.long, device=device))
        return rows

    def _advance(self, rows: _Rows, logits: torch.Tensor, position: torch.Tensor, temperature: float | None,
                 greedy: bool) -> None:
        """From ``logits`` ``[batch, 1, padded_vocab]`` at ``position`` ``[1]``, the token at ``position + 1``:
        drawn (or the prompt's, for a row still in its prompt), written with its logprob, and the done flags
        updated. ``temperature``: the model's own logits (the fixed-shape step), scaled here as the wrapper scales
        them; None: the wrapper's already (fp32, / temperature, padding ``-inf``)."""
        x = logits[:, -1, :]
        if temperature is not None:  # the wrapper's scaling (megatron_engine._temperature_wrapper), the same bits
            x = x.float() / temperature
            x[:, self.vocab_size:] = float("-inf")
        drawn = x.argmax(dim=-1) if greedy else race_sample(x)
        logprob = torch.log_softmax(x, dim=-1).gather(-1, drawn[:, None])
        at = position + 1
        started = rows.lengths <= at  # [batch] rows past their prompt at the new position
        token = torch.where(started, drawn, rows.tokens.index_select(1, at)[:, 0])
        rows.tokens.index_copy_(1, at, token[:, None])
        rows.logprobs.index_copy_(1, at, logprob)
        live = started & ~rows.done
        ended = (token[:, None] == rows.eos).any(dim=-1) | (at - rows.lengths + 1 >= rows.max_tokens)
        rows.done |= live & ended

    def _responses(self, rows: _Rows, lengths: list[int]) -> list[tuple[list[int], list[float]]]:
        """Each row's response: from its prompt's end to its first EOS token, or ``max_tokens`` tokens."""
        tokens, logprobs = rows.tokens.tolist(), rows.logprobs.tolist()
        limit, eos = int(rows.max_tokens), set(self.eos_token_ids)
        out = []
        for ids, lps, start in zip(tokens, logprobs, lengths):
            ids, lps = ids[start:start + limit], lps[start:start + limit]
            end = next((k + 1 for k, t in enumerate(ids) if t in eos), len(ids))
            out.append((ids[:end], lps[:end]))
        return out
