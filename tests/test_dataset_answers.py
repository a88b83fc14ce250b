"""Off-policy KD on a dataset's answers (``algorithm.distill_samples=dataset``): the answers become
samples token for token as SFT's tokenisation renders them (a sampler stopping at the end of the turn),
cut to ``max_tokens``; the teacher's logprobs of the sampled tokens by hand; the file checks."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from alignment.data.chat_data import encode_example
from alignment.data.prompt_data import load_prompt_files
from alignment.data.prompts import build_prompt_ids
from alignment.data.tasks import Problem
from alignment.envs.base import SingleTurn
from alignment.data.samples import SamplingConfig
from alignment.rollout.episodes.dataset_answers import DatasetAnswers, answer_ids
from alignment.rollout.episodes.multi_turn import run_episodes
from alignment.trainers.distill import sampled_logprobs
from tests.conftest import SMOLLM2_EOS

EOS = SMOLLM2_EOS  # <|im_end|>

PROBLEMS = [Problem("What is 3 + 4?", "7", "file", messages=({"role": "user", "content": "What is 3 + 4?"},)),
            Problem("Name a prime.", "", "file", messages=({"role": "system", "content": "Be brief."},
                                                           {"role": "user", "content": "Name a prime."}))]
ANSWERS = ["3 + 4 = 7.\nThe answer is 7.", "Two, the only even prime."]


def test_answers_are_the_tokens_sft_trains_on(smollm2_tokenizer, chatml_turns):
    """The episode's prompt + response ids equal SFT's rendering of the same conversation (the chat
    template's assistant turn, cut after <|im_end|>): exactly what a sampler that stops there yields."""
    tokenizer, turns = smollm2_tokenizer, chatml_turns
    seen = []
    groups = run_episodes(DatasetAnswers(turns, ANSWERS).generate, SingleTurn(), PROBLEMS, turns,
                          SamplingConfig(n=2, max_tokens=64), max_turns=1,
                          on_done=lambda i, samples: seen.append((i, len(samples))))
    assert seen == [(0, 2), (1, 2)]
    for problem, answer, group in zip(PROBLEMS, ANSWERS, groups):
        ids, prompt_len = encode_example(tokenizer, problem.messages, answer, max_length=512, max_prompt_length=512)
        assert len(group) == 2 and group[0] is not group[1]
        for s in group:
            assert s.prompt_ids == ids[:prompt_len] == build_prompt_ids(tokenizer, problem)
            assert s.response_ids == ids[prompt_len:] and s.response_ids[-1] == EOS and s.finished
            assert s.logprobs == [0.0] * len(s.response_ids) and s.loss_mask is None
            assert s.text == answer


def test_long_answers_are_cut_to_max_tokens(smollm2_tokenizer, chatml_turns):
    tokenizer, turns = smollm2_tokenizer, chatml_turns
    full, finished = answer_ids(turns, ANSWERS[0], 64)
    assert finished and full == tokenizer.encode(ANSWERS[0], add_special_tokens=False) + [EOS]
    cut, finished = answer_ids(turns, ANSWERS[0], 5)
    assert cut == full[:5] and not finished
    exact, finished = answer_ids(turns, ANSWERS[0], len(full))
    assert exact == full and finished
    with pytest.raises(ValueError, match="empty answer"):
        answer_ids(turns, "", 8)
    with pytest.raises(ValueError, match="2 prompts but 1 dataset answers"):
        DatasetAnswers(turns, ANSWERS[:1]).generate([[1], [2]], SamplingConfig(n=1, max_tokens=8))


def test_sampled_logprobs_read_the_next_token():
    vocab = torch.log_softmax(torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4) / 5, dim=-1)
    ids = torch.tensor([[0, 3, 1], [2, 2, 0]])
    got = sampled_logprobs(vocab, ids)
    want = torch.tensor([[vocab[0, 0, 3], vocab[0, 1, 1], vocab[0, 2, 0]],
                         [vocab[1, 0, 2], vocab[1, 1, 0], vocab[1, 2, 2]]])
    assert torch.equal(got, want)


def _data(tmp_path, rows, **extra):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fields = dict(train_files=str(path), heldout_files=None, heldout_fraction=0.0, prompt_key="prompt",
                  answer_key=None, response_key="completion")
    fields.update(extra)
    return SimpleNamespace(**fields), path


def test_the_response_column_is_checked_when_the_files_are_read(tmp_path):
    rows = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(4)]
    data, _ = _data(tmp_path, rows)
    sets = load_prompt_files(data)
    assert [p.columns["completion"] for p in sets.train] == ["a0", "a1", "a2", "a3"]
    data, path = _data(tmp_path, rows, response_key="solution")
    with pytest.raises(ValueError, match=r"data.response_key='solution': .*d.jsonl has no such column; its columns "
                                         r"are prompt, completion"):
        load_prompt_files(data)
    data, path = _data(tmp_path, rows[:2] + [{"prompt": "q2", "completion": " "}])
    with pytest.raises(ValueError, match=r"d.jsonl row 2 \(completion\): the answer to distill on is ' '; give every "
                                         "training record a non-empty string"):
        load_prompt_files(data)
    data, _ = _data(tmp_path, rows[:2] + [{"prompt": "q2", "completion": " "}], response_key=None)
    assert len(load_prompt_files(data).train) == 3  # not distilling on it: not read
