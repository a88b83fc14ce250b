"""The evaluation harness's parts without an engine: metrics against hand-computed values, the grading
shared with the in-training held-out evaluation, the suites' files and errors, checkpoint resolution,
the comparisons that set ``tools/evaluate.py``'s exit status, the reward-model judge against
``transformers`` and the report files."""

from __future__ import annotations

import json
import re

import pytest

from alignment.data.tasks import Problem
from alignment.evaluation import metrics
from alignment.rewards import grading
from alignment.data.samples import Sample


def _sample(text: str, **info) -> Sample:
    return Sample([1], [2, 3], [0.0, 0.0], text, True, info=info)


def test_behaviour_metrics_by_hand():
    assert metrics.is_refusal("I'm sorry, but I can't help with that.")
    assert metrics.is_refusal("As an AI language model, I cannot browse the web.")
    assert metrics.is_refusal("I cannot assist with this request.")
    assert not metrics.is_refusal("Sorry for the delay: the answer is 12.")
    assert not metrics.is_refusal("I can help with that. First, ...")
    # "a b c d a b c d", bigrams: ab bc cd da ab bc cd -> 7 grams, 4 distinct
    assert metrics.repeated_ngram_fraction("a b c d a b c d", n=2) == pytest.approx(3 / 7)
    assert metrics.repeated_ngram_fraction("one two three", n=4) == 0.0
    assert metrics.is_repetitive("go " * 50) and not metrics.is_repetitive("The quick brown fox jumps over it.")
    assert metrics.is_empty(" \n\t") and not metrics.is_empty(" x ")
    assert metrics.is_garbled("abc\ufffd") and metrics.is_garbled("\x00\x01\x02\x03x")
    assert not metrics.is_garbled("Ünïcödé — ça va? 3 + 4 = 7 ✓") and not metrics.is_garbled("")
    found = metrics.behaviour(["I can't help with that.", "", "ok " * 20, "Fine."], [6, 0, 20, 2])
    assert found == {"mean_length": 7.0, "refusal_rate": 0.25, "repetition_rate": 0.25, "empty_rate": 0.25,
                     "garbled_rate": 0.0}
    with pytest.raises(ValueError, match="one length per response"):
        metrics.behaviour(["a"], [1, 2])


def test_wilson_interval_and_win_rate():
    low, high = metrics.wilson_interval(8, 10)  # textbook value: 0.490 .. 0.943
    assert (round(low, 3), round(high, 3)) == (0.490, 0.943)
    assert metrics.wilson_interval(0, 0) == (0.0, 1.0)
    low, high = metrics.wilson_interval(0, 20)
    assert low == 0.0 and 0 < high < 0.2
    with pytest.raises(ValueError, match="outside"):
        metrics.wilson_interval(11, 10)
    w = metrics.win_rate([1.0, 0.5, 0.2, 0.9], [0.0, 0.5, 0.3, 0.1])
    assert (w["wins"], w["ties"], w["losses"]) == (2, 1, 1)
    assert w["win_rate"] == pytest.approx(2.5 / 4)
    assert (w["ci_low"], w["ci_high"]) == pytest.approx(metrics.wilson_interval(2.5, 4))
    with pytest.raises(ValueError, match="one pair per prompt"):
        metrics.win_rate([1.0], [])


def test_reasoning_counts_by_hand():
    """k = 3 samples per problem: pass@1 is the mean fraction right, pass@3 whether any is, maj@3
    whether the commonest final answer is right."""
    problems = [Problem("2+2?", "4", "gsm8k"), Problem("3+3?", "6", "gsm8k"), Problem("1+1?", "2", "gsm8k")]
    groups = [[_sample("The answer is 4"), _sample("5"), _sample("so 4", tool_calls=1)],
              [_sample("5"), _sample("7"), _sample("7")],
              [_sample("3"), _sample("2"), _sample("3")]]
    right = grading.grade(problems, groups, max_tokens=16)
    assert right == [[True, False, True], [False, False, False], [False, True, False]]
    c = grading.counts(problems, groups, right, 3)
    assert c == {"problems": 3.0, "pass@1": pytest.approx(2 / 3 + 0 + 1 / 3), "pass@3": 2.0, "maj@3": 1.0,
                 "tool_calls": 1.0}
    r = grading.rates(c, 3)
    assert r == {"pass@1": pytest.approx(1 / 3), "pass@3": pytest.approx(2 / 3), "maj@3": pytest.approx(1 / 3),
                 "tool_call_rate": pytest.approx(1 / 9)}
    assert grading.rates(grading.counts(problems[:1], [groups[0][:1]], [[True]], 1), 1) == \
        {"pass@1": 1.0, "tool_call_rate": 0.0}
    with pytest.raises(ValueError, match="k=2"):
        grading.counts(problems, groups, right, 2)
    with pytest.raises(ValueError, match="groups of samples for 2 problems"):
        grading.grade(problems[:2], groups, 16)


def test_suites_and_the_regression_file(tmp_path):
    from alignment.evaluation import suites

    assert [s.name for s in suites.get_suites("gsm8k, behaviour")] == ["gsm8k", "behaviour"]
    with pytest.raises(ValueError, match="unknown gsm9k; valid: arithmetic"):
        suites.get_suites("gsm8k,gsm9k")
    shipped = suites.regression_items()
    assert len(shipped) == 36 and len({i["id"] for i in shipped}) == 36
    assert {i["match"] for i in shipped} == {"number", "contains"}
    cases = {
        '{"id": "a", "question": "q"}': "r.jsonl:1: missing answer",
        'not json': "r.jsonl:1: not a JSON line",
        '{"id": "a", "question": "q", "answer": "1", "match": "regex"}': "match='regex'; valid: number, contains",
        '{"id": "a", "question": "q", "answer": "1", "task": "chess"}': "task='chess'",
        '{"id": "a", "question": "q", "answer": "1"}\n{"id": "a", "question": "r", "answer": "2"}':
            "r.jsonl:2: id 'a' appears twice",
        '\n': "no items",
    }
    for text, message in cases.items():
        path = tmp_path / "r.jsonl"
        path.write_text(text)
        with pytest.raises(ValueError, match=re.escape(message)):
            suites.regression_items(path)
    with pytest.raises(FileNotFoundError, match="--regression-file"):
        suites.regression_items(tmp_path / "missing.jsonl")


def test_gsm8k_and_humaneval_suites_hold_every_problem():
    from alignment.evaluation import suites

    for name, size in (("gsm8k", 1319), ("humaneval", 164)):
        suite = suites.SUITES[name]
        items = suites.problems(suite, suites.suite_config(suite))
        assert len(items) == size and len({p.question for p in items}) == size
    assert len(suites.problems(suites.SUITES["arithmetic"], suites.suite_config(suites.SUITES["arithmetic"]), 7)) == 7


def test_checkpoint_resolution(tmp_path, tiny_model_dir):
    from alignment.evaluation.checkpoints import megatron_source, resolve

    assert resolve(str(tiny_model_dir)) == tiny_model_dir
    run = tmp_path / "run"
    (run / "checkpoints" / "step_4.tmp").mkdir(parents=True)
    (run / "hf").symlink_to(tiny_model_dir)
    assert resolve(str(run)) == run / "hf"  # no complete checkpoint: the run's export
    with pytest.raises(ValueError, match="step_4.tmp is an incomplete checkpoint"):
        resolve(str(run / "checkpoints" / "step_4.tmp"))
    step = run / "checkpoints" / "step_3"
    step.mkdir()
    (step / "config.yaml").write_text("model: {path: smollm2}\n")
    (step / "common.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="no metadata.json: an incomplete checkpoint"):
        megatron_source(step)
    (step / "metadata.json").write_text("{}")
    assert megatron_source(run) == step  # the run's latest complete step
    with pytest.raises(FileNotFoundError, match="neither an HF directory"):
        resolve(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no such directory or known model"):
        resolve(str(tmp_path / "nothing"))


def test_compare_finds_regressions_and_win_rates():
    from tools.evaluate import compare

    def result(correct, passed, length):
        return {"arithmetic": {"metrics": {}, "items": [{"correct": c, "text": ""} for c in correct]},
                "regression": {"metrics": {}, "items": [{"id": f"q{i}", "passed": p} for i, p in enumerate(passed)]},
                "behaviour": {"metrics": {"mean_length": length}, "items": []}}

    found = compare({"base": result([1, 0, 0, 1], [True, True, False], 10.0),
                     "new": result([1, 1, 0, 0], [True, False, True], 15.0),
                     "same": result([1, 0, 0, 1], [True, True, True], 10.0)}, "base", None)
    assert found["regressions"] == {"new": ["q1"], "same": []}
    assert found["length_drift"] == {"new": pytest.approx(0.5), "same": 0.0}
    w = found["win_rates"]["new"]["verifier (arithmetic)"]
    assert (w["wins"], w["ties"], w["losses"], w["win_rate"]) == (1, 2, 1, 0.5)
    judged = compare({"base": {}, "new": {}}, "base", {"base": [0.0, 1.0], "new": [1.0, 1.0]})
    assert judged["win_rates"]["new"]["reward model (preference)"]["win_rate"] == 0.75


def test_reward_model_judge_matches_transformers(tmp_path):
    """Batched with right padding, each score equals the head's output at the last token of the lone
    sequence (where the RM job trained it; transformers' own pooling looks for the first pad token,
    which SmolLM2's tokenizer shares with its end of turn)."""
    import torch
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    from alignment.data.chat_data import encode_example, encode_prompt
    from alignment.evaluation.judge import reward_scores
    from alignment.models.hf_assets import prepare_hf_dir
    from tests.dist.tiny_llama import tiny_llama_config

    tokenizer = AutoTokenizer.from_pretrained(prepare_hf_dir("smollm2"))
    config = tiny_llama_config(vocab_size=len(tokenizer))
    config.num_labels, config.pad_token_id = 1, tokenizer.pad_token_id
    torch.manual_seed(0)
    rm = LlamaForSequenceClassification(config).eval()
    rm.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    prompts = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Name a colour, please."}]] * 2
    answers = ["Hello there, how can I help you today?", "Blue.", "", "Red, green or a much longer answer."]
    scores = reward_scores(tmp_path / "rm", prompts, answers, batch_size=3)
    for p, a, s in zip(prompts, answers, scores):
        ids = encode_example(tokenizer, p, a, 1024)[0] if a else encode_prompt(tokenizer, p) + [tokenizer.eos_token_id]
        with torch.no_grad():
            alone = rm.score(rm.model(torch.tensor([ids])).last_hidden_state)[0, -1, 0].item()
            assert s == pytest.approx(alone, abs=1e-5)
    with pytest.raises(ValueError, match="not a one-label"):
        reward_scores(prepare_hf_dir("smollm2"), prompts[:1], answers[:1])  # a causal LM, not a judge


def test_report_files(tmp_path):
    from alignment.evaluation import report

    table = {"base": {"arithmetic": {"accuracy": 0.25, "pass@4": 0.5}},
             "new": {"arithmetic": {"accuracy": 0.5}, "behaviour": {"mean_length": 12.0}}}
    md = report.metrics_table(table)
    assert md.split("\n\n") == ["| arithmetic | accuracy | pass@4 |\n|---|---|---|\n| base | 0.250 | 0.500 |\n"
                                 "| new | 0.500 |  |",
                                 "| behaviour | mean_length |\n|---|---|\n| base |  |\n| new | 12.000 |"]
    paths = report.write(tmp_path, {"metrics": table}, md)
    assert json.loads(paths["json"].read_text())["metrics"] == table
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
