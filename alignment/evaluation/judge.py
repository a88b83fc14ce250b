"""A reward model as judge: the scalar score of (prompt, answer) pairs from the HF export of a
``--config-name rm`` job (``*ForSequenceClassification``, ``num_labels=1``), read at the last
token of the conversation tokenised as the reward model was trained
(:func:`alignment.data.chat_data.encode_example`)."""

from __future__ import annotations

from pathlib import Path

from alignment.data.chat_data import encode_example, encode_prompt


def encode_answer(tokenizer, prompt: list[dict], answer: str, max_length: int = 1024) -> list[int]:
    """Token ids of ``prompt`` + ``answer`` as the reward model was trained on them
    (:func:`alignment.data.chat_data.encode_example`); an answer the template cannot render after the
    prompt (empty or whitespace only) as the prompt's ids, the answer's and the end-of-turn token."""

    try:
        return encode_example(tokenizer, prompt, answer, max_length)[0]
    except ValueError:
        ids = encode_prompt(tokenizer, prompt) + tokenizer(answer, add_special_tokens=False)["input_ids"]
        return (ids + ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []))[-max_length:]


def reward_scores(model_dir: str | Path, prompts: list[list[dict]], answers: list[str], max_length: int = 1024,
                  batch_size: int = 8, dtype: str = "float32") -> list[float]:
    """One reward per (``prompts[i]``, ``answers[i]``) with the reward model at ``model_dir``, run in
    ``dtype`` with ``transformers`` (right padding, the score at each sequence's last token).

    Raises:
        ValueError: ``prompts`` and ``answers`` of different lengths, or ``model_dir`` not a sequence
            classifier with one label (naming the file and the fix).
    """
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    if len(prompts) != len(answers):
        raise ValueError(f"{len(prompts)} prompts and {len(answers)} answers")
    config = AutoConfig.from_pretrained(model_dir)
    if not any(a.endswith("ForSequenceClassification") for a in config.architectures or []) or config.num_labels != 1:
        raise ValueError(f"--reward-model {model_dir}: {Path(model_dir) / 'config.json'} is not a one-label "
                         f"*ForSequenceClassification (architectures {config.architectures}); give the HF export "
                         "of a `--config-name rm` run (its <output_dir>/hf)")
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    encoded = [encode_answer(tokenizer, p, a, max_length) for p, a in zip(prompts, answers)]
    out: list[float] = []
    for start in range(0, len(encoded), batch_size):
        rows = encoded[start : start + batch_size]
        width = max(map(len, rows))
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
        with torch.no_grad():
            hidden = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
            logits = model.score(hidden)[..., 0].float()
        out += [float(logits[i, len(r) - 1]) for i, r in enumerate(rows)]
    return out
