"""A judge model run in the job (alignment/rewards/judge_models.py's LocalJudge) against transformers:
the same chat-templated prompts, greedy, 12 tokens each. Writes both replies, the judge's scores with
verdicts made of a word only one reply holds (a random model never says "correct"), the hand-set scores
those words carry, and what the default verdicts make of transformers' replies.

    python tests/dist/judge_worker.py WORK_DIR OUT.json
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HAND = [0.25, 0.5, 1.0]  # the scores the three replies' own verdict words are given
sys.path.insert(0, str(ROOT))

from tests.dist.report import exit_now  # noqa: E402  (after the repository root is on the path)


def verdicts_for(replies: list[str]) -> dict[str, float]:
    """Verdicts (word -> score, first match wins) that give reply i the score HAND[i]: peeled off in
    order, each reply's word is one no reply still unassigned holds (the random model never says
    "correct")."""
    words = {i: set(re.findall(r"[a-z]+", r.lower())) for i, r in enumerate(replies)}
    verdicts = {}
    while words:
        own = {i: sorted(w.difference(*(o for j, o in words.items() if j != i))) for i, w in words.items()}
        i = next((i for i, w in own.items() if w), None)
        assert i is not None, f"no word tells these replies apart: {[replies[j] for j in words]}"
        verdicts[own[i][0]] = HAND[i]
        del words[i]
    return verdicts


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from alignment.data.chat_data import encode_prompt
    from alignment.data.tasks import FILE_TASK, Problem
    from alignment.rewards.judge import TEMPLATE, judge_scores, parse_score, render, settings_of
    from alignment.rewards.judge_models import backend, close_local
    from alignment.data.samples import Sample
    from tests.dist.tiny_llama import save_tiny_hf_dir

    work, out = Path(sys.argv[1]), Path(sys.argv[2])
    model_dir = str(save_tiny_hf_dir(work / "model"))
    problems = [Problem(q, a, FILE_TASK) for q, a in (("What is 2+2?", "4"), ("Name a colour.", "red"), ("Hi?", ""))]
    answers = ["4", "blue", "hello there"]
    settings = {"model": model_dir, "max_tokens": 12, "max_model_len": 512, "kv_cache_gib": 0.1}
    conversations = [[{"role": "user", "content": render(TEMPLATE, p, a)}] for p, a in zip(problems, answers)]
    replies = backend(settings_of(settings)).replies(conversations)

    tokenizer, model = AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir).eval()
    expected = []
    for messages in conversations:
        ids = torch.tensor([encode_prompt(tokenizer, messages)])
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.eos_token_id)
        expected.append(tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
    verdicts = verdicts_for(expected)
    samples = [Sample([i], [1], [0.0], a, True) for i, a in enumerate(answers)]
    scores = judge_scores("local", problems, samples, {**settings, "verdicts": verdicts})  # the same engine again
    close_local()
    out.write_text(json.dumps({"vllm": replies, "transformers": expected, "scores": scores, "verdicts": verdicts,
                               "expected_scores": HAND,
                               "default_verdicts": [parse_score(r, {}) for r in expected]}))


if __name__ == "__main__":
    main()
    exit_now()
