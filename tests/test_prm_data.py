"""The process reward model's data and best-of-N picks by hand: steps of a response, automatic and
outcome labels, tokenisation with the score at each step's last token, the JSONL records and their
errors, aggregation of step scores, majority vote and the reranking table."""

from __future__ import annotations

import json
import math

import pytest

from alignment.algorithms.best_of_n import aggregate_steps, majority_vote, pick_best
from alignment.data.step_data import (
    StepRecord,
    encode_steps,
    label_steps,
    load_records,
    split_steps,
    step_prompt,
    supervised_labels,
    write_records,
)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from alignment.models.hf_assets import prepare_hf_dir

    return AutoTokenizer.from_pretrained(prepare_hf_dir("smollm2"))


def test_steps_and_their_labels_by_hand():
    steps = split_steps("3 + 4 = 7\n\n 7 + 12 = 20 \nThe answer is 20.\n")
    assert steps == ["3 + 4 = 7", "7 + 12 = 20", "The answer is 20."]  # blank lines are not steps
    assert label_steps(steps) == [True, False, None]
    assert split_steps("a; b;;c", ";") == ["a", "b", "c"] and split_steps("\n \n") == []
    with pytest.raises(ValueError, match="separator is empty"):
        split_steps("a", "")
    r = StepRecord("p", steps, [True, False, None], outcome=False)
    assert supervised_labels(r, "process") == [True, False, None]
    assert supervised_labels(r, "outcome") == [None, None, False]  # the ORM: the answer, at the last step
    assert supervised_labels(StepRecord("p", [], []), "outcome") == []
    with pytest.raises(ValueError, match="valid values are process, outcome"):
        supervised_labels(r, "steps")


def test_encode_steps_scores_each_step_at_its_separator(tokenizer):
    prompt = step_prompt("What is 3 + 4 + 12?")
    assert prompt == ("What is 3 + 4 + 12?\nSolve it step by step: one operation per line, written as 'a + b = c', "
                      "then the answer.")
    steps = ["3 + 4 = 7", "7 + 12 = 19", "The answer is 19."]
    ids, p, ends = encode_steps(tokenizer, prompt, steps)
    newline, eos = tokenizer.encode("\n", add_special_tokens=False), tokenizer.eos_token_id
    assert newline == [198] and ids[ends[0]] == 198 and ids[ends[1]] == 198 and ids[ends[2]] == eos
    assert ends[-1] == len(ids) - 1 and p < ends[0]
    assert tokenizer.decode(ids[p:]) == "3 + 4 = 7\n7 + 12 = 19\nThe answer is 19.<|im_end|>"
    # each step is its own tokens, so the prompt and the steps before a step do not change where it ends
    first = tokenizer.encode(steps[0], add_special_tokens=False)
    assert ends[0] == p + len(first)
    # max_length drops the steps that would end past it
    short, _, kept = encode_steps(tokenizer, prompt, steps, max_length=ends[1] + 1)
    assert kept == ends[:2] and len(short) == ends[1] + 1
    with pytest.raises(ValueError, match="leaves no room for the first step"):
        encode_steps(tokenizer, prompt, steps, max_length=p + 1)
    with pytest.raises(ValueError, match="no steps"):
        encode_steps(tokenizer, prompt, [])


def test_records_round_trip_and_bad_files(tmp_path):
    records = [StepRecord("q1", ["1 + 1 = 2"], [True], "1 + 1", "2", True),
               StepRecord("q2", ["a", "2 + 2 = 5"], [None, False], "2 + 2", "4", False)]
    write_records(tmp_path / "train.jsonl", records)
    assert not (tmp_path / "train.jsonl.tmp").exists()
    assert load_records(tmp_path, "train") == records
    assert json.loads((tmp_path / "train.jsonl").read_text().splitlines()[1])["labels"] == [None, False]
    with pytest.raises(FileNotFoundError, match="python tools/make_prm_data.py --out"):
        load_records(tmp_path, "heldout")
    with pytest.raises(ValueError, match="valid values are train, heldout"):
        load_records(tmp_path, "test")
    (tmp_path / "heldout.jsonl").write_text('{"prompt": "q", "completions": ["a"], "labels": []}\n')
    with pytest.raises(ValueError, match=r"heldout.jsonl:1: a record needs .* as many labels"):
        load_records(tmp_path, "heldout")
    (tmp_path / "heldout.jsonl").write_text('\n{"prompt": "q", "completions": ["a"], "labels": [1]}\n{oops\n')
    with pytest.raises(ValueError, match=r"heldout.jsonl:3: not a JSON line \(Expecting property name enclosed in "
                                         r"double quotes at column 2\)"):
        load_records(tmp_path, "heldout")
    (tmp_path / "heldout.jsonl").write_text('{"prompt": "q", "steps": ["a"]}\n')
    with pytest.raises(ValueError, match=r"heldout.jsonl:1: not a step record"):
        load_records(tmp_path, "heldout")
    (tmp_path / "heldout.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="holds no records"):
        load_records(tmp_path, "heldout")


def test_step_records_from_parquet_and_saved_datasets(tmp_path):
    """A split may be ``train.parquet`` or a ``Dataset.save_to_disk`` directory with TRL's stepwise columns
    (prompt, completions, labels; other columns ignored); ``.jsonl`` is looked for first."""
    import datasets

    rows = [{"prompt": "q1", "completions": ["1 + 1 = 2", "so 2"], "labels": [True, None], "source": "mine"},
            {"prompt": "q2", "completions": ["2 + 2 = 5"], "labels": [False], "source": "mine"}]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "train.parquet"))
    datasets.Dataset.from_list(rows[1:]).save_to_disk(str(tmp_path / "heldout"))
    assert load_records(tmp_path, "train") == [StepRecord("q1", ["1 + 1 = 2", "so 2"], [True, None]),
                                               StepRecord("q2", ["2 + 2 = 5"], [False])]
    assert load_records(tmp_path, "heldout") == [StepRecord("q2", ["2 + 2 = 5"], [False])]
    write_records(tmp_path / "train.jsonl", [StepRecord("q3", ["x"], [True])])
    assert [r.prompt for r in load_records(tmp_path, "train")] == ["q3"]
    datasets.Dataset.from_list([{"prompt": "q", "completions": ["a", "b"], "labels": [True]}]).to_parquet(
        str(tmp_path / "bad" / "train.parquet"))
    with pytest.raises(ValueError, match=r"train.parquet row 0: a record needs .* as many labels"):
        load_records(tmp_path / "bad", "train")


def test_best_of_n_by_hand():
    probs = [0.9, 0.5, 0.8]
    assert aggregate_steps(probs, "prod") == pytest.approx(0.36)
    assert aggregate_steps(probs, "min") == 0.5 and aggregate_steps(probs, "last") == 0.8
    assert aggregate_steps([], "min") == -math.inf
    with pytest.raises(ValueError, match="valid values are prod, min, last"):
        aggregate_steps(probs, "mean")
    assert pick_best([0.1, 0.7, 0.7, 0.2]) == 1  # the first of the tied best
    assert pick_best([-math.inf, -math.inf]) == 0
    with pytest.raises(ValueError, match="no solutions"):
        pick_best([])
    assert majority_vote(["3", "5", "5", None, "3"]) == 0  # 3 and 5 tie: the answer seen first
    assert majority_vote(["3", None, "5", "5"]) == 2
    assert majority_vote([None, None]) == 0 and majority_vote([None, "4"]) == 1


def test_rerank_table_by_hand():
    from tools.rerank import group_by_problem, rerank, step_accuracy

    def rec(q, answer, outcome, labels=(None,)):
        return StepRecord(q, [f"so {answer}"] * len(labels), list(labels), q, "", outcome)

    # problem A: answers 7 (right), 8, 8 -> the vote is wrong; problem B: 5 (wrong), 6 (right), 6 -> right
    a = [rec("A", 7, True), rec("A", 8, False), rec("A", 8, False)]
    b = [rec("B", 5, False, (True, False)), rec("B", 6, True, (True, True)), rec("B", 6, True, (True, True))]
    groups = group_by_problem(a + b)
    assert [len(g) for g in groups] == [3, 3] and group_by_problem(a + b, 3) == groups
    with pytest.raises(ValueError, match="not whole groups of 4"):
        group_by_problem(a + b, 4)
    prm = [[0.9], [0.2], [0.3], [0.9, 0.1], [0.6, 0.7], [0.95, 0.5]]
    # B by product: 0.09, 0.42, 0.475 -> the third (right); by min: 0.1, 0.6, 0.5 -> the second (right);
    # by the last step: 0.1, 0.7, 0.5 -> the second. A: 0.9 -> the first (right) by every aggregation.
    orm = [[0.1], [0.8], [0.3], [0.2, 0.9], [0.1, 0.2], [0.4, 0.3]]  # A -> 8 (wrong), B -> 5 (wrong)
    table = rerank(groups, {"prm": prm, "orm": orm})
    assert table == {"random": pytest.approx((1 / 3 + 2 / 3) / 2), "majority_vote": 0.5, "prm_prod": 1.0,
                     "prm_min": 1.0, "prm_last": 1.0, "orm_last": 0.0, "pass@3": 1.0}
    # labelled steps: B's 0.9 (T, ok), 0.1 (F, ok), 0.6 (T), 0.7 (T), 0.95 (T), 0.5 (T: not > 0.5, wrong)
    assert step_accuracy([r.labels for r in a + b], prm) == pytest.approx(5 / 6)


def test_dense_step_rewards_and_process_advantages_by_hand():
    import torch

    from alignment.algorithms.process_rewards import place_step_rewards, process_advantages, to_batch_columns

    rewards, positions, lengths = [[0.9, 0.2], [0.5], [], [0.8]], [[1, 3], [2], [], [0]], [4, 3, 2, 1]
    placed = place_step_rewards(rewards, positions, lengths)
    assert torch.equal(placed, torch.tensor([[0, 0.9, 0, 0.2], [0, 0, 0.5, 0], [0, 0, 0, 0], [0.8, 0, 0, 0]]))
    # group 1 (rows 0, 1): steps 0.9, 0.2, 0.5: mean 0.533.., unbiased std 0.35119..
    mean, std = 1.6 / 3, math.sqrt(((0.9 - 1.6 / 3) ** 2 + (0.2 - 1.6 / 3) ** 2 + (0.5 - 1.6 / 3) ** 2) / 2)
    z = [(r - mean) / (std + 1e-6) for r in (0.9, 0.2, 0.5)]
    adv = process_advantages(rewards, positions, lengths, group_size=2)
    # a token's advantage: the normalised rewards of the steps ending at or after it
    assert adv[0].tolist() == pytest.approx([z[0] + z[1], z[0] + z[1], z[1], z[1]], abs=1e-6)
    assert adv[1].tolist() == pytest.approx([z[2], z[2], z[2], 0.0], abs=1e-6)  # 0 past its 3 tokens
    assert adv[2:].abs().max().item() == 0.0  # group 2: one step in all (std 0, centred 0) and a row without
    dr = process_advantages(rewards, positions, lengths, group_size=2, normalize_by_std=False)  # Dr.GRPO: r - mean
    assert dr[0].tolist() == pytest.approx([0.9 + 0.2 - 2 * mean] * 2 + [0.2 - mean] * 2, abs=1e-6)
    with pytest.raises(ValueError, match="group_size=3 must be >= 1 and divide the 4 rows"):
        process_advantages(rewards, positions, lengths, group_size=3)
    with pytest.raises(ValueError, match=r"row 0: step ends \[3, 1\] must increase"):
        place_step_rewards([[1, 2]], [[3, 1]], [4])
    with pytest.raises(ValueError, match="row 0: 1 step rewards for 2 step ends"):
        place_step_rewards([[1]], [[0, 1]], [4])
    # response token k of a row with a p-token prompt sits at column p + k - 1 of make_batch
    cols = to_batch_columns(torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]]), [2, 1], 5)
    assert cols.tolist() == [[0, 1, 2, 0, 0], [3, 0, 0, 0, 0]]
    with pytest.raises(ValueError, match="does not fit in 3 columns"):
        to_batch_columns(torch.tensor([[1.0, 2.0, 3.0]]), [2], 3)


def test_response_steps_place_each_step_on_the_token_completing_it(tokenizer):
    from alignment.data.step_data import response_steps, step_spans

    text = "3 + 4 = 7\n\n 7 + 12 = 19\nThe answer is 19."
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    steps, positions = response_steps(tokenizer, ids)
    assert steps == ["3 + 4 = 7", "7 + 12 = 19", "The answer is 19."]
    for (a, b), p in zip(step_spans(text), positions):  # the prefix up to p is the first to hold the step
        assert len(tokenizer.decode(ids[: p + 1])) >= b > len(tokenizer.decode(ids[:p]))
    assert tokenizer.decode(ids[positions[0]]) == "7" and positions[-1] == len(ids) - 2  # the ".", not EOS
    assert response_steps(tokenizer, [tokenizer.eos_token_id]) == ([], [])
    assert step_spans("  a \n\nbb\n") == [(2, 3), (6, 8)]
