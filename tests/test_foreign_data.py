"""verl's and TRL's data layouts read as their projects write them: verl's parquet (``data_source``, chat
``prompt``, ``reward_model.ground_truth``, ``extra_info``; images with ``<image>`` placeholders) with a verl
``compute_score`` of the user's, dotted keys into struct columns, images kept as bytes in the data; and the
checks that keep a job from training silently on nothing: a reference empty in every record, a column a
reward function takes that is not there, columns nothing reads named."""

from __future__ import annotations

import json
import re
import sys
from types import SimpleNamespace

import pytest

from alignment.algorithms.composite_reward import RewardTerm
from alignment.compose import compose_job
from alignment.config import job_config
from alignment.data.prompt_data import load_prompt_files
from alignment.rewards.functions import function_scores, load_user_function
from alignment.data.samples import Sample
from alignment.schema import ConfigError
from tests.foreign_data import COMPUTE_SCORE, INSTRUCTION, extract_solution, gsm8k_rows, write_geo3k_parquet, \
    write_gsm8k_parquet


def data(**kw):
    base = dict(train_files=None, heldout_files=None, heldout_fraction=0.0, prompt_key="prompt", answer_key=None,
                response_key=None)
    return SimpleNamespace(**{**base, **kw})


@pytest.fixture()
def user_module(tmp_path, monkeypatch):
    """A verl project's reward module (``my_reward.py``) in the working directory, recording to $RECORD."""
    (tmp_path / "my_reward.py").write_text(COMPUTE_SCORE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("RECORD", str(tmp_path / "record.jsonl"))
    load_user_function.cache_clear()
    yield tmp_path / "record.jsonl"
    sys.modules.pop("my_reward", None)
    load_user_function.cache_clear()


def test_verls_gsm8k_parquet_reaches_compute_score_as_verl_hands_it(tmp_path, user_module):
    """A parquet written as verl's gsm8k.py writes it: the reference is ``reward_model.ground_truth`` (no
    data.answer_key given), and verl's compute_score gets exactly what verl's reward manager gives it."""
    rows = gsm8k_rows(6)
    path = write_gsm8k_parquet(tmp_path / "gsm8k" / "train.parquet", rows)
    sets = load_prompt_files(data(train_files=str(path)))
    train = sets.train
    assert train.answer_key == "reward_model.ground_truth" and len(train) == 6
    truths = [extract_solution(r["answer"]) for r in rows]
    assert [p.answer for p in train] == truths
    assert train[0].messages == ({"role": "user", "content": rows[0]["question"] + " " + INSTRUCTION},)
    # right answers score 1, a wrong one 0; every call got verl's arguments
    texts = [f"So the answer is #### {t}" for t in truths[:-1]] + ["#### 0.5"]
    samples = [Sample(prompt_ids=[1], response_ids=[2], logprobs=[-1.0], finished=True, text=t) for t in texts]
    scores = function_scores(RewardTerm("my_reward:compute_score"), list(train), samples, max_tokens=8)
    assert scores.tolist() == [1.0] * 5 + [0.0]
    calls = [json.loads(line) for line in user_module.read_text().splitlines()]
    assert [c["ground_truth"] for c in calls] == truths and {c["data_source"] for c in calls} == {"openai/gsm8k"}
    assert [c["extra_info"]["index"] for c in calls] == list(range(6)) and calls[0]["extra_info"] == {
        "split": "train", "index": 0, "answer": rows[0]["answer"], "question": rows[0]["question"]}
    # the same key given dotted; a field the struct column does not have named with the columns there are
    assert load_prompt_files(data(train_files=str(path), answer_key="reward_model.ground_truth")).train[1].answer \
        == truths[1]
    with pytest.raises(ValueError, match=r"data.answer_key='reward_model.answer': .* its columns are data_source, "
                                         r"prompt, ability, reward_model.style, reward_model.ground_truth, extra_info"):
        load_prompt_files(data(train_files=str(path), answer_key="reward_model.answer"))
    assert load_prompt_files(data(train_files=str(path), answer_key="extra_info.question")).train[2].answer == \
        rows[2]["question"]


def _png(color) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(buf, format="PNG")
    return buf.getvalue()


def test_verls_images_go_where_their_placeholders_are(tmp_path):
    """verl's geo3k.py layout: the image bytes kept in the parquet, ``<image>`` in the text: each image is a
    file (written once, by its bytes' sha256) at its placeholder's place, in order; a record whose placeholders
    and images differ in number is refused, naming it."""
    from PIL import Image

    red, blue = Image.open(__import__("io").BytesIO(_png("red"))), Image.open(__import__("io").BytesIO(_png("blue")))
    path = write_geo3k_parquet(tmp_path / "geo.parquet", [("<image>Find x.", "3", [red]),
                                                        ("Compare <image> with <image>.", "4", [red, blue]),
                                                        ("<image>Find y.", "5", [blue, red])])
    sets = load_prompt_files(data(train_files=str(path)))
    first, second = sets.train[0], sets.train[1]
    assert first.answer == "3" and first.messages[0]["content"] == [{"type": "image"},
                                                                     {"type": "text", "text": "Find x. Answer."}]
    assert second.messages[0]["content"] == [{"type": "text", "text": "Compare "}, {"type": "image"},
                                             {"type": "text", "text": " with "}, {"type": "image"},
                                             {"type": "text", "text": ". Answer."}]
    assert open(second.images[0], "rb").read() == open(first.images[0], "rb").read()  # red twice: one file
    assert Image.open(second.images[1]).getpixel((0, 0)) == (0, 0, 255)
    with pytest.raises(ValueError, match=r"geo.parquet row 2: 1 <image> placeholders in the prompt and 2 images"):
        sets.train[2]


def test_images_without_placeholders_go_first_as_trl_puts_them(tmp_path):
    image = tmp_path / "a.png"
    image.write_bytes(_png("green"))
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "What colour?", "image": "a.png", "answer": "green"}) + "\n"
                    + json.dumps({"prompt": [{"role": "user", "content": "Colour?"}], "image": "a.png",
                                  "answer": "green"}) + "\n")
    a, b = load_prompt_files(data(train_files=str(path))).train
    assert a.messages == ({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour?"}]},)
    assert b.messages[0]["content"][0] == {"type": "image"} and a.images == b.images == (str(image),)


def _check(tmp_path, rows, functions, *extra):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = job_config(compose_job("grpo", [f"data.train_files={path}", f"reward.functions={functions}",
                                          f"output_dir={tmp_path / 'out'}", *extra]).cfg)
    from launchers.common import check_job

    return check_job(cfg, 2)[3]


def test_a_reference_no_record_has_is_refused_at_start(tmp_path, user_module):
    rows = [{"prompt": f"{i}+{i}?", "answer": "", "hint": "add", "note": i} for i in range(8)]
    with pytest.raises(ConfigError, match=r"reward.functions\[math_verify\] \(math_verify\) compares each answer with "
                                          r"the reference answer, but data.answer_key's column answer is empty in every "
                                          r"training record"):
        _check(tmp_path, rows, "[{name: math_verify}]")
    with pytest.raises(ConfigError, match=r"reward.functions\[my_reward:compute_score\] .* column answer is empty"):
        _check(tmp_path, rows, "[{name: 'my_reward:compute_score'}]")
    no_answer = [{"prompt": f"{i}+{i}?", "hint": "add"} for i in range(8)]
    with pytest.raises(ConfigError, match=r"has no answer column \(answer, reward_model.ground_truth; its columns: "
                                          r"prompt, hint\): set data.answer_key"):
        _check(tmp_path, no_answer, "[{name: exact_match}]")
    with pytest.raises(ConfigError, match=r"reward.functions\[tests.reward_fns:contains_answer\] .* takes 'solution', "
                                          r"which is no column of"):
        _check(tmp_path, no_answer, "[{name: 'tests.reward_fns:contains_answer'}]")


def test_columns_nothing_reads_are_named(tmp_path):
    rows = [{"prompt": f"{i}+{i}?", "answer": str(2 * i), "hint": "add", "source": "mine"} for i in range(8)]
    prompts = _check(tmp_path, rows, "[{name: math_verify}]")
    assert prompts.unused_columns == ("hint", "source")
    assert _check(tmp_path, rows, "[{name: 'tests.reward_fns:even_length'}]").unused_columns == ()  # **kwargs


# ------------------------------------------------------------------ TRL's dataset types

from tests.foreign_data import trl_records  # noqa: E402

JOB_OF = {"sft": ("sft", []), "dpo": ("dpo", []), "rm": ("rm", []), "kto": ("dpo", ["algorithm.loss_type=kto"])}


@pytest.mark.parametrize("kind", sorted(trl_records()))
def test_each_of_trls_dataset_types_reads_as_its_trainer_reads_it(kind, tmp_path, smollm2_tokenizer):
    """Every TRL dataset type, standard and conversational, in the job whose trainer TRL matches to it: the
    prompt the chat template renders and the response trained on, as TRL splits them."""
    from alignment.data.examples import tokenize_split

    job, records = trl_records()[kind]
    path = tmp_path / f"{kind}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    config, extra = JOB_OF[job]
    cfg = job_config(compose_job(config, ["data=file", f"data.dataset={path}", "data.heldout_fraction=0.25",
                                          *extra]).cfg)
    train = tokenize_split(cfg.data, cfg.algorithm, smollm2_tokenizer, "train")
    held = tokenize_split(cfg.data, cfg.algorithm, smollm2_tokenizer, "heldout")
    assert len(train) + len(held) == 12 and held
    decode = lambda ids: smollm2_tokenizer.decode(ids)  # noqa: E731
    rows = train[0]
    if kind == "language_modeling":
        [(ids, p)] = rows
        assert p == 1 and decode(ids).startswith("The sky is blue on day") and ids[-1] == smollm2_tokenizer.eos_token_id
        return
    texts = [(decode(r[0][: r[1]]), decode(r[0][r[1]:])) for r in rows]
    prompt = texts[0][0]
    assert "What color is the sky on day" in prompt and prompt.rstrip().endswith("assistant")  # the chat template
    if job == "sft":
        assert texts[0][1].strip().startswith("It is blue.")
    elif kind == "preference_implicit":  # TRL's extract_prompt: the common start, up to the first difference
        assert prompt.split("<|im_start|>user\n")[1].startswith("What color is the sky on day") and "It is<" in prompt
        assert [t[1].split("<")[0] for t in texts] == [" blue.", " green."] and texts[1][0] == prompt
    elif job in ("dpo", "rm"):
        assert [t[1].strip()[:12] for t in texts] == ["It is blue.<", "It is green."] and texts[1][0] == prompt
    else:  # KTO: one completion and its label
        [(ids, p, pics, label)] = rows
        assert pics is None and isinstance(label, bool)
        assert texts[0][1].strip().startswith("It is blue." if label else "It is green.")


def test_unpaired_records_train_with_kto_only(tmp_path, smollm2_tokenizer):
    from alignment.data.examples import tokenize_split

    _, records = trl_records()["unpaired_preference"]
    path = tmp_path / "kto.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    for config, extra, says in (("dpo", [], "unpaired preference records (prompt, completion, label) train with KTO "
                                            "(algorithm.loss_type=kto, --config-name dpo: TRL's KTOTrainer); "
                                            "algorithm.name=dpo with loss_type=sigmoid needs chosen / rejected pairs"),
                                ("rm", [], "algorithm.name=rm needs chosen / rejected pairs")):
        cfg = job_config(compose_job(config, ["data=file", f"data.dataset={path}", *extra]).cfg)
        with pytest.raises(ValueError, match=re.escape(says)):
            tokenize_split(cfg.data, cfg.algorithm, smollm2_tokenizer, "train")
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps(records[0]) + "\n" + json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    cfg = job_config(compose_job("dpo", ["data=file", f"data.dataset={mixed}", "algorithm.loss_type=kto"]).cfg)
    with pytest.raises(ValueError, match=r"mixed.jsonl:2: a paired preference record among unpaired ones"):
        tokenize_split(cfg.data, cfg.algorithm, smollm2_tokenizer, "train")


def test_kto_on_unpaired_rows_by_hand():
    """The unpaired KTO objective: each row's loss is TRL's (desirable: 1 - sigmoid(beta (r - z0)), undesirable:
    1 - sigmoid(beta (z0 - r))), averaged over the global batch's rows; its metrics split by label."""
    import torch

    from alignment.trainers.kto import KTOObjective

    k = KTOObjective(vocab_size=8, beta=0.5)
    k.kl_ref_point = 0.2
    batch = {"input_ids": torch.zeros(3, 4)}
    k.add_targets(batch, [([1], 1, None, True), ([1], 1, None, False), ([1], 1, None, True)])
    assert batch["desirable"].tolist() == [True, False, True] and k.normalizer(batch) == (3.0,)
    logprobs = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5], [-3.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    ref = torch.tensor([-2.5, -2.0, -2.0])
    loss, sums = k.loss({"loss_mask": mask, "ref_logps": ref, "desirable": batch["desirable"]},
                        {"logprobs": logprobs}, (6.0,))
    r = torch.tensor([-3.0 + 2.5, -1.5 + 2.0, -3.0 + 2.0])
    sig = torch.sigmoid
    expected = torch.stack([1 - sig(0.5 * (r[0] - 0.2)), 1 - sig(0.5 * (0.2 - r[1])), 1 - sig(0.5 * (r[2] - 0.2))])
    assert torch.allclose(loss, expected.sum() / 6.0)
    m = KTOObjective.metrics({k_: float(v) for k_, v in sums.items()})
    assert m["loss"] == pytest.approx(float(expected.mean())) and m["kl"] == pytest.approx(0.2)
    assert m["reward/desirable"] == pytest.approx(0.5 * float(r[0] + r[2]) / 2)
    assert m["reward/undesirable"] == pytest.approx(0.5 * float(r[1]))


def test_an_sft_files_columns_its_layout_does_not_read_are_named(tmp_path):
    from launchers.common import check_job

    path = tmp_path / "pc.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Hi {i}", "completion": "Hello", "meta": i, "source": "x"}) + "\n"
                            for i in range(8)))
    cfg = job_config(compose_job("sft", ["data=file", f"data.dataset={path}", "data.heldout_fraction=0", "data.heldout_size=2", "trainer.global_batch_size=2",
                                         "trainer.micro_batch_size=1", f"output_dir={tmp_path / 'out'}"]).cfg)
    counts = check_job(cfg, 2)[3]
    assert counts.unused_columns == ("meta", "source") and counts.train + counts.heldout == 8
