"""Tests for alignment.data.tasks / prompts and alignment.models.hf_assets, on the real shipped data."""

from __future__ import annotations

import json
import pathlib

import pytest

from alignment.data.prompts import build_prompt_ids
from alignment.data.tasks import (
    ARITHMETIC_GENERATOR,
    Problem,
    extract_final_number,
    load_problems,
    score_response,
)
from alignment.models.hf_assets import prepare_hf_dir, smollm2_gguf_path


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"First 3 + 4 = 7, so the result is \boxed{7}.", "7"),
        (r"\boxed{1,234} is it", "1234"),
        (r"She pays \boxed{\$18.00} in total.", "18"),
        ("The answer is 12.", "12"),
        ("So the final answer is: **42**", "42"),
        ("Answer: $1,250", "1250"),
        ("5 - 9 = -4", "-4"),
        ("The temperature drops to −3 degrees.", "-3"),
        ("He walks 2.50 miles each day.", "2.5"),
        ("It costs 42.0 dollars.", "42"),
        ("I have 3 apples and 5 pears, 8 fruits in all.", "8"),
        ("The answer is 7. Let me double check: 3 + 4 = 7 and 2 more is 9", "7"),
        ("I am not sure how to solve this problem.", None),
        ("", None),
    ],
)
def test_extract_final_number(text: str, expected: str | None) -> None:
    assert extract_final_number(text) == expected


def test_gsm8k_splits() -> None:
    heldout = load_problems("gsm8k", "heldout", 200)
    train = load_problems("gsm8k", "train", 1119)
    assert len(heldout) == 200 and len(train) == 1119
    assert not {p.question for p in heldout} & {p.question for p in train}
    first = heldout[0]
    assert first.question.startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert first.answer == "18" and first.task == "gsm8k" and first.entry is None
    assert heldout[-1].answer == "7500"  # line 200 of test.jsonl
    answers = {p.question[:40]: p.answer for p in train}
    assert answers["Baldur gets water from a well. He gets 5"] == "55"  # line 201
    assert "114200" in {p.answer for p in train}  # line 202: "#### 114,200"
    assert "-10" in {p.answer for p in train}  # line 490
    assert [p.question for p in load_problems("gsm8k", "train", 10, seed=3)] == [
        p.question for p in load_problems("gsm8k", "train", 10, seed=3)
    ]
    with pytest.raises(ValueError, match="200"):
        load_problems("gsm8k", "heldout", 201)


def test_arithmetic_disjoint_and_deterministic() -> None:
    train = load_problems("arithmetic", "train", 1000, seed=0)
    heldout = load_problems("arithmetic", "heldout", 200, seed=0)
    assert len(train) == 1000 and len(heldout) == 200
    assert not {p.question for p in train} & {p.question for p in heldout}
    # disjoint across seeds too: the held-out membership does not depend on the seed
    other = load_problems("arithmetic", "heldout", 200, seed=1)
    assert not {p.question for p in train} & {p.question for p in other}
    again = load_problems("arithmetic", "train", 1000, seed=0)
    assert [(p.question, p.answer) for p in again] == [(p.question, p.answer) for p in train]
    assert [p.question for p in load_problems("arithmetic", "train", 50, seed=1)] != [
        p.question for p in train[:50]
    ]
    p = train[0]
    assert p.task == "arithmetic" and p.entry is not None
    assert p.entry["metadata"]["source_dataset"] == ARITHMETIC_GENERATOR
    expr = p.entry["metadata"]["expression"]
    assert p.answer == str(eval(expr))  # e.g. "15 - 43" -> "-28"


def test_bad_task_and_split() -> None:
    with pytest.raises(ValueError, match="'algebra'.*arithmetic, gsm8k"):
        load_problems("algebra", "train", 3)
    with pytest.raises(ValueError, match="'test'.*train, heldout"):
        load_problems("gsm8k", "test", 3)


def test_score_response() -> None:
    p = load_problems("arithmetic", "heldout", 1)[0]
    right, wrong = p.answer, str(int(p.answer) + 7)
    assert score_response(p, f"The answer is {right}.") == 1.0
    assert score_response(p, rf"\boxed{{{right}}}") == 1.0
    assert score_response(p, f"{wrong}") == 0.0
    assert score_response(p, "I don't know.") == 0.0

    g = Problem(question="How many?", answer="114200", task="gsm8k", entry=None)
    assert score_response(g, "So he makes $114,200 in total.") == 1.0
    assert score_response(g, r"\boxed{114200.0}") == 1.0
    assert score_response(g, "The answer is 114201.") == 0.0
    assert score_response(g, "no idea") == 0.0
    neg = Problem(question="?", answer="-10", task="gsm8k", entry=None)
    assert score_response(neg, "The change is -10.") == 1.0
    assert score_response(neg, "The change is 10.") == 0.0

    # a hand-made reasoning-gym style entry graded by the generator's own scorer
    e = Problem("State the final answer to the following arithmetic problem: 4 - 9 =", "-5", "arithmetic",
                {"question": "4 - 9 =", "answer": "-5", "metadata": {"source_dataset": "chain_sum"}})
    assert score_response(e, "4 - 9 = -5") == 1.0
    assert score_response(e, "4 - 9 = 5") == 0.0


def test_prepare_hf_dir_and_prompt_ids() -> None:
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    assert gguf.is_file() and gguf.suffix == ".gguf"
    hf_dir = prepare_hf_dir("smollm2")
    assert prepare_hf_dir(str(hf_dir)) == hf_dir  # an HF dir is returned as is
    config = json.loads((hf_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True and config["dtype"] == "float32"
    assert (hf_dir / "model.safetensors").stat().st_size > 500_000_000  # fp32, tied head not duplicated

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    ids = build_prompt_ids(tok, Problem("What is 3 + 4?", "7", "arithmetic"))
    assert isinstance(ids, list) and all(type(i) is int for i in ids)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\n")  # the template's default system prompt is kept
    assert "<|im_start|>user\nWhat is 3 + 4?\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="'poetry'"):
        build_prompt_ids(tok, Problem("x", "", "poetry"))


def test_prepare_hf_dir_errors(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope-model"):
        prepare_hf_dir(str(tmp_path / "nope-model"))
    with pytest.raises(ValueError, match="without config.json"):
        prepare_hf_dir(str(tmp_path))
    bad = tmp_path / "weights.bin"
    bad.write_bytes(b"x")
    with pytest.raises(ValueError, match="weights.bin.*gguf"):
        prepare_hf_dir(str(bad))


def test_length_smoke_task():
    """``length``: the arithmetic questions, rewarded by closeness to 20 characters (TRL's quickstart
    reward scaled to [0, 1]); prompts ask for it."""
    from alignment.data.prompts import INSTRUCTIONS
    from alignment.data.tasks import Problem, load_problems, score_response

    problems = load_problems("length", "train", 3, seed=0)
    arithmetic = load_problems("arithmetic", "train", 3, seed=0)
    assert [p.question for p in problems] == [p.question for p in arithmetic]
    assert all(p.task == "length" and p.answer == "20" for p in problems)
    p = Problem("What is 2 + 3?", "20", "length")
    assert score_response(p, "x" * 20) == 1.0 and score_response(p, "  " + "x" * 20 + "\n") == 1.0
    assert score_response(p, "x" * 10) == 0.5 and score_response(p, "x" * 25) == 0.75
    assert score_response(p, "x" * 40) == 0.0 and score_response(p, "x" * 400) == 0.0
    assert "20 characters" in INSTRUCTIONS["length"]
