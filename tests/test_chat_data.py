"""The llamafactory demo data: splits, chat-template tokenisation with truncation, and the
padded batch layout (which positions the loss and the reward head read)."""

from __future__ import annotations

import pytest
import torch

from alignment.data.chat_data import encode_example, load_preference_pairs, load_sft_examples
from alignment.models.value_head import sequence_scores
from alignment.training.batching import make_sequence_batch


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from alignment.models.hf_assets import prepare_hf_dir

    return AutoTokenizer.from_pretrained(prepare_hf_dir("smollm2"))


def test_splits_are_deduplicated_and_disjoint():
    train, held = load_preference_pairs("train", 50), load_preference_pairs("heldout", 50)
    assert (len(train), len(held)) == (245, 50)  # 300 records, 5 repeat an earlier prompt
    prompts = lambda ps: {str(p.messages) for p in ps}  # noqa: E731
    assert len(prompts(train)) == 245 and not prompts(train) & prompts(held)
    assert not {p.chosen for p in train} & {p.chosen for p in held}
    assert held[0].messages[-1]["role"] == "user" and held[0].chosen != held[0].rejected
    sft, sft_held = load_sft_examples("train", 100), load_sft_examples("heldout", 100)
    assert len(sft) == 885 and sft[0].messages[0]["content"] == "Describe a process of making crepes."
    assert not {e.messages[0]["content"] for e in sft} & {e.messages[0]["content"] for e in sft_held}


def test_encode_example_is_prompt_then_response_ending_at_eos(tokenizer):
    msgs = ({"role": "user", "content": "What is 2+3?"},)
    ids, p = encode_example(tokenizer, msgs, "5", max_length=512)
    assert tokenizer.decode(ids[p:]) == "5<|im_end|>"  # response closed by the end-of-turn token
    assert tokenizer.decode(ids[:p]).endswith("What is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    # truncation keeps the END of the prompt and the START of the response
    long_ids, long_p = encode_example(tokenizer, msgs, "one two three four five six seven eight", 12, 5)
    assert len(long_ids) == 12 and long_p == 5 and long_ids[:5] == ids[p - 5 : p]
    with pytest.raises(ValueError, match="max_length"):
        encode_example(tokenizer, msgs, "5", max_length=1)


def test_sequence_batch_masks_response_predictions_and_last_token():
    b = make_sequence_batch([([5, 6, 7, 8], 2), ([9, 10, 11], 1)], pad_id=0, pad_to_multiple=4)
    assert b["input_ids"].tolist() == [[5, 6, 7, 8], [9, 10, 11, 0]]
    # position t predicts token t+1: row 0's response tokens 7, 8 are predicted at 1, 2
    assert b["loss_mask"].tolist() == [[0, 1, 1, 0], [1, 1, 0, 0]]
    assert b["last_index"].tolist() == [3, 2] and b["response_lengths"].tolist() == [2, 2]
    values = torch.arange(8.0).reshape(2, 4, 1)
    assert sequence_scores(values, b["last_index"]).tolist() == [3.0, 6.0]
    with pytest.raises(ValueError, match="prompt_len"):
        make_sequence_batch([([5, 6], 2)], pad_id=0)
    with pytest.raises(ValueError, match="last_index"):
        sequence_scores(values, torch.tensor([0, 4]))


def test_data_files_of_your_own(tmp_path):
    """``data.dataset=<file>``: alpaca and chat-message SFT records, ShareGPT and TRL-style pairs, in a
    .jsonl or a .json array, read as the demo sets are (duplicates dropped, the last records held out)."""
    import json

    from alignment.data.chat_data import PreferencePair, SFTExample

    sft = tmp_path / "sft.jsonl"
    sft.write_text("\n".join(json.dumps(r) for r in [
        {"instruction": "Add", "input": "2 and 3", "output": "5"},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello"}]},
        {"instruction": "Add", "input": "2 and 3", "output": "five"},  # the same prompt again: dropped
        {"messages": [{"from": "human", "value": "Bye"}, {"from": "gpt", "value": "Goodbye"}]}]) + "\n")
    assert load_sft_examples("train", 1, str(sft)) == [
        SFTExample(({"role": "user", "content": "Add\n\n2 and 3"},), "5"),
        SFTExample(({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}), "Hello")]
    assert load_sft_examples("heldout", 1, str(sft)) == [SFTExample(({"role": "user", "content": "Bye"},), "Goodbye")]
    pairs = tmp_path / "pairs.json"
    pairs.write_text(json.dumps([
        {"prompt": "Q1", "chosen": "good", "rejected": "bad"},
        {"conversations": [{"from": "human", "value": "Q2"}], "chosen": {"from": "gpt", "value": "a"},
         "rejected": {"from": "gpt", "value": "b"}}]))
    assert load_preference_pairs("train", 1, str(pairs)) == [
        PreferencePair(({"role": "user", "content": "Q1"},), "good", "bad")]
    assert load_preference_pairs("heldout", 1, str(pairs))[0].chosen == "a"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"prompt": "x"}))
    with pytest.raises(ValueError, match="a .json dataset is an array of records, not a dict"):
        load_preference_pairs("train", 1, str(bad))
    bad.write_text(json.dumps([{"messages": [{"role": "user", "content": "only a prompt"}]}]))
    with pytest.raises(ValueError, match=r"bad.json record 1: 'messages' must end with the assistant's response"):
        load_sft_examples("train", 1, str(bad))


def test_column_mappings_and_held_out_files_or_fraction(tmp_path):
    """``data.columns`` renames a file's columns (LLaMA-Factory's names) for SFT and pairs, a ``system``
    column becomes the system message; held out: ``data.heldout_files`` (their prompts leave training), or
    the prompts hashing into ``data.heldout_fraction`` (the same split at any call, disjoint)."""
    import json

    from alignment.data.chat_data import PreferencePair, SFTExample
    from alignment.data.records import check_columns

    qa = tmp_path / "qa.jsonl"
    rows = [{"question": f"Q{i}", "reply": f"A{i}", "persona": "Be brief.", "id": i} for i in range(40)]
    qa.write_text("".join(json.dumps(r) + "\n" for r in rows))
    columns = {"prompt": "question", "response": "reply", "system": "persona"}
    train = load_sft_examples("train", 1, str(qa), heldout_fraction=0.25, columns=columns)
    held = load_sft_examples("heldout", 1, str(qa), heldout_fraction=0.25, columns=columns)
    assert train[0] == SFTExample(({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q0"}), "A0") \
        or held[0].messages[1]["content"] == "Q0"
    assert len(train) + len(held) == 40 and 0 < len(held) < 20
    assert not {e.messages[1]["content"] for e in train} & {e.messages[1]["content"] for e in held}
    assert load_sft_examples("heldout", 1, str(qa), heldout_fraction=0.25, columns=columns) == held  # stable
    other = tmp_path / "held.jsonl"
    other.write_text(json.dumps(rows[3]) + "\n" + json.dumps({**rows[3], "reply": "again"}) + "\n")
    assert [e.response for e in load_sft_examples("heldout", 1, str(qa), heldout_files=[str(other)],
                                                  columns=columns)] == ["A3"]
    assert len(load_sft_examples("train", 1, str(qa), heldout_files=str(other), columns=columns)) == 39
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("q,good,bad\nWhich?,this,that\nOther?,x,y\n")
    got = load_preference_pairs("train", 1, str(pairs), columns={"prompt": "q", "chosen": "good", "rejected": "bad"})
    assert got == [PreferencePair(({"role": "user", "content": "Which?"},), "this", "that")]
    with pytest.raises(ValueError, match=r"data.columns.response='answer', but the record has no such column; its "
                                         "columns are question, reply, persona, id"):
        load_sft_examples("train", 1, str(qa), columns={"prompt": "question", "response": "answer"})
    with pytest.raises(ValueError, match=r"data.columns has \['chosen'\]; for sft records it maps prompt, query"):
        check_columns({"chosen": "c"}, "sft")


def test_the_start_up_check_counts_what_an_sft_job_trains_on(tmp_path, tiny_model_dir):
    """``data=file``: the whole file, 5 % held out by hash; the check before any process group tokenises
    both splits as the job will and prints the examples, tokens and sequences cut."""
    import datasets

    from alignment.data.chat_data import load_sft_examples
    from launchers.common import check_job
    from launchers.preflight import compose

    rows = [{"q": f"Spell the number {i}.", "a": " ".join(["word"] * (i % 7 + 1))} for i in range(60)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "qa.parquet"))
    cfg = compose("sft", [f"model.path={tiny_model_dir}", f"output_dir={tmp_path / 'out'}", "data=file",
                          f"data.dataset={tmp_path / 'qa.parquet'}", "data.columns={prompt: q, response: a}",
                          "data.max_length=24", "data.max_prompt_length=16", "trainer.global_batch_size=2",
                          "trainer.micro_batch_size=1"])
    counts = check_job(cfg, 2)[3]
    held = load_sft_examples("heldout", 1, str(tmp_path / "qa.parquet"), heldout_fraction=0.05,
                             columns={"prompt": "q", "response": "a"})
    assert (counts.train, counts.heldout) == (60 - len(held), len(held)) and counts.heldout > 0
    assert 0 < counts.at_limit < counts.train and counts.tokens > 0
    assert counts.summary() == (f"data: {counts.train} training examples ({counts.tokens:,} tokens; {counts.at_limit} "
                                f"sequences cut at data.max_length=24) and {counts.heldout} held out, from "
                                f"{tmp_path / 'qa.parquet'}")
