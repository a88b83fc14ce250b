"""The llamafactory demo data: splits, chat-template tokenisation with truncation, and the
padded batch layout (which positions the loss and the reward head read)."""

from __future__ import annotations

import pytest
import torch

from alignment.data.chat_data import encode_example, load_preference_pairs, load_sft_examples
from alignment.models.value_head import sequence_scores
from alignment.trainers.batching import make_sequence_batch


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
