"""Prompt files of your own (alignment/data/prompt_data.py): every format and column mapping, the
held-out split, de-duplication, the order of steps over epochs and a resume at an epoch boundary,
overlong prompts, system prompts and chat-template keyword arguments."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from alignment.data.prompt_data import EpochOrder, fit_prompts, is_heldout, load_prompt_files
from alignment.data.prompts import job_prompts
from alignment.data.prompts import PromptStyle, prompt_messages
from alignment.data.tasks import FILE_TASK, Problem
from alignment.config import total_steps
from launchers.loop import prompts_of_step

ROWS = [{"question": f"What is {i} + {i}?", "solution": str(2 * i), "level": i % 3} for i in range(40)]


def data(**kw):
    base = {"train_files": None, "heldout_files": None, "heldout_fraction": 0.0, "prompt_key": "question",
            "answer_key": "solution", "task": "arithmetic", "shuffle": True, "overlong_prompts": "error"}
    return OmegaConf.create({**base, **kw})


def write(path, rows, fmt):
    import datasets

    ds = datasets.Dataset.from_list(rows)
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "parquet":
        ds.to_parquet(str(path))
    elif fmt == "csv":
        ds.to_csv(str(path), index=False)
    else:
        ds.save_to_disk(str(path))
    return str(path)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv", "saved"])
def test_every_format_reads_the_same_problems(tmp_path, fmt):
    path = write(tmp_path / f"train.{fmt}", ROWS, fmt)
    sets = load_prompt_files(data(train_files=path))
    assert len(sets.train) == 40 and len(sets.heldout) == 0 and sets.duplicates == 0 and sets.records == 40
    p = sets.train[7]
    assert (p.question, p.answer, p.task, p.messages) == ("What is 7 + 7?", "14", FILE_TASK, None)
    assert str(p.columns["solution"]) == "14" and int(p.columns["level"]) == 1 and "question" not in p.columns


def test_answer_key_defaults_to_an_answer_column_and_may_be_absent(tmp_path):
    path = write(tmp_path / "a.jsonl", [{"prompt": "Say hi", "answer": 3}, {"prompt": "Say bye"}], "jsonl")
    sets = load_prompt_files(data(train_files=path, prompt_key="prompt", answer_key=None))
    assert [p.answer for p in sets.train] == ["3", ""]
    path = write(tmp_path / "b.jsonl", [{"prompt": "Say hi"}], "jsonl")
    assert load_prompt_files(data(train_files=path, prompt_key="prompt", answer_key=None)).train[0].answer == ""


def test_chat_prompts_with_a_system_message(tmp_path):
    rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}],
             "answer": "red"}]
    sets = load_prompt_files(data(train_files=write(tmp_path / "c.jsonl", rows, "jsonl"), prompt_key="messages",
                                  answer_key=None))
    p = sets.train[0]
    assert p.question == "Name a color." and p.messages[0] == {"role": "system", "content": "Be brief."}
    # the file's own system message wins over data.system_prompt; data.instruction follows the question
    assert prompt_messages(p, PromptStyle(instruction="One word.", system_prompt="ignored")) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color.\nOne word."}]


def test_system_prompt_and_template_kwargs_reach_the_rendered_prompt():
    from transformers import AutoTokenizer

    from alignment.data.prompts import build_prompt_ids
    from alignment.models.hf_assets import prepare_hf_dir

    tok = AutoTokenizer.from_pretrained(prepare_hf_dir("smollm2"))
    p = Problem("Name a color.", "", FILE_TASK)
    text = tok.decode(build_prompt_ids(tok, p, PromptStyle(system_prompt="You are terse.")))
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nName a color.<|im_end|>")
    # a file's prompt gets no task instruction; a task's gets its own
    assert prompt_messages(p) == [{"role": "user", "content": "Name a color."}]
    assert prompt_messages(Problem("1 + 1?", "2", "arithmetic"))[0]["content"] == "1 + 1?\nAnswer with a single number."
    seen = {}

    class Recording:
        def apply_chat_template(self, messages, **kw):
            seen.update(kw)
            return [1, 2]

    assert build_prompt_ids(Recording(), p, PromptStyle(chat_template_kwargs={"enable_thinking": False})) == [1, 2]
    assert seen["enable_thinking"] is False and seen["add_generation_prompt"] is True


def test_heldout_fraction_is_a_hash_split_and_duplicates_are_dropped(tmp_path):
    rows = ROWS + ROWS[:5]  # five repeats
    sets = load_prompt_files(data(train_files=write(tmp_path / "d.jsonl", rows, "jsonl"), heldout_fraction=0.25))
    train = {p.question for p in sets.train}
    held = {p.question for p in sets.heldout}
    assert not train & held and len(train) + len(held) == 40 and sets.duplicates == 5 and sets.records == 45
    assert held == {r["question"] for r in ROWS if is_heldout(r["question"], 0.25)}
    assert 4 <= len(held) <= 16  # ~10 of 40
    # a held-out file: its prompts are never trained on, even when the training file repeats them
    h = write(tmp_path / "h.jsonl", ROWS[:3], "jsonl")
    sets = load_prompt_files(data(train_files=write(tmp_path / "d.jsonl", rows, "jsonl"), heldout_files=[h]))
    assert len(sets.heldout) == 3 and len(sets.train) == 37 and sets.duplicates == 8


@pytest.mark.parametrize("rows, key, says", [
    (ROWS, "prompt", "data.prompt_key='prompt': .* has no such column; its columns are question, solution, level"),
    ([{"question": "  ", "solution": "1"}], "question", "row 0 \\(question\\): the prompt is empty"),
    ([{"question": [{"role": "assistant", "content": "hi"}], "solution": "1"}], "question",
     "must end with a user message"),
])
def test_bad_files_are_named(tmp_path, rows, key, says):
    path = write(tmp_path / "bad.jsonl", rows, "jsonl")
    with pytest.raises(ValueError, match=says):
        load_prompt_files(data(train_files=path, prompt_key=key))


def test_missing_unknown_and_unparsable_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.train_files=.*nope.jsonl: no such file"):
        load_prompt_files(data(train_files=str(tmp_path / "nope.jsonl")))
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ValueError, match="unknown format '.txt'"):
        load_prompt_files(data(train_files=str(tmp_path / "x.txt")))
    (tmp_path / "broken.jsonl").write_text('{"question": "a"}\n{"question": \n')
    with pytest.raises(ValueError, match="broken.jsonl: json reader failed"):
        load_prompt_files(data(train_files=str(tmp_path / "broken.jsonl")))
    with pytest.raises(ValueError, match="data.answer_key='gold': .* its columns are question, solution, level"):
        load_prompt_files(data(train_files=write(tmp_path / "ok.jsonl", ROWS, "jsonl"), answer_key="gold"))


def test_epoch_order_reshuffles_every_epoch_and_is_a_function_of_the_step():
    items = list(range(10))
    order = EpochOrder(items, seed=3)
    first, second = [order[i] for i in range(10)], [order[i] for i in range(10, 20)]
    assert sorted(first) == items == sorted(second) and first != second and first != items
    assert [EpochOrder(items, seed=3)[i] for i in range(20)] == first + second  # a fresh object: the same order
    assert [EpochOrder(items, 3, keep_first=True)[i] for i in range(10)] == items
    assert [EpochOrder(items, 3, shuffle=False)[i] for i in range(20)] == items + items


def test_resumed_at_an_epoch_boundary_trains_every_prompt_as_often():
    """verl #7401's bug class: a run stopped at the end of an epoch and resumed must not skip the next
    epoch. Steps here are the loop's (prompts_of_step): 10 prompts, 4 a step, over 2 DP ranks."""
    from collections import Counter

    items = list(range(10))
    cfg = OmegaConf.create({"trainer": {"steps": 0, "epochs": 2}, "rollout": {"prompts_per_step": 4}})
    steps = total_steps(cfg, len(items))
    assert steps == 5  # 2 epochs x 10 prompts / 4 a step

    def run(step_range):
        order = EpochOrder(items, seed=11)  # what a (re)started job builds
        return [x for s in step_range for r in range(2) for x in prompts_of_step(order, s, 4, r, 2)]

    whole = run(range(steps))
    for stop in range(1, steps):  # killed after any step, epoch boundaries (steps 2.5, 5) included
        assert run(range(stop)) + run(range(stop, steps)) == whole
    assert Counter(whole) == Counter(items * 2)  # every prompt exactly twice


def test_overlong_prompts_error_or_drop():
    from alignment.data.prompt_data import PromptSets

    probs = [Problem("x" * n, "", FILE_TASK) for n in (5, 50, 8)]
    sets = PromptSets(probs, [Problem("y" * 60, "", FILE_TASK)], 4, 0, ("f",))
    with pytest.raises(ValueError, match=r"the longest prompt has 60 tokens .*\(2 prompts are too long\)"):
        fit_prompts(sets, lambda p: len(p.question), 64, 16, "error", "data.train_files")
    kept = fit_prompts(sets, lambda p: len(p.question), 64, 16, "drop", "data.train_files")
    assert [len(p.question) for p in kept.train] == [5, 8] and not kept.heldout and kept.overlong == 2
    assert kept.tokens == 13 and "dropped 0 duplicate and 2 overlong prompts" in kept.summary()


def test_job_prompts_builtin_task_and_files_go_the_same_way(tmp_path):
    cfg = OmegaConf.create({"seed": 1, "data": {**data(), "train_size": 6, "heldout_size": 3, "generator": None,
                                                "generator_kwargs": {"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                                                     "max_digits": 1}}})
    sets = job_prompts(cfg.data, cfg.seed)
    assert len(sets.train) == 6 and len(sets.heldout) == 3 and sets.sources == ("data.task=arithmetic",)
    cfg.data.train_files = write(tmp_path / "t.parquet", ROWS, "parquet")
    cfg.data.heldout_fraction = 0.5
    sets = job_prompts(cfg.data, cfg.seed)
    assert len(sets.train) + len(sets.heldout) == 40 and sets.train[0].task == FILE_TASK


@pytest.mark.parametrize("fmt", ["parquet", "csv", "saved"])
def test_sft_and_preference_data_from_parquet_csv_and_saved_datasets(tmp_path, fmt):
    from alignment.data.chat_data import load_preference_pairs, load_sft_examples

    sft = [{"instruction": f"Say {i}", "input": "", "output": f"{i}"} for i in range(6)]
    examples = load_sft_examples("train", 2, write(tmp_path / f"sft.{fmt}", sft, fmt))
    assert [(e.messages[0]["content"], e.response) for e in examples] == [(f"Say {i}", f"{i}") for i in range(4)]
    pairs = [{"prompt": f"Pick {i}", "chosen": "good", "rejected": "bad"} for i in range(5)]
    train = load_preference_pairs("train", 1, write(tmp_path / f"pairs.{fmt}", pairs, fmt))
    assert len(train) == 4 and (train[0].messages[0]["content"], train[0].chosen, train[0].rejected) == \
        ("Pick 0", "good", "bad")


@pytest.mark.parametrize("job", ["grpo", "rft", "online_dpo", "ppo"])
def test_every_rl_job_takes_prompt_files(tmp_path, job):
    """The start-up check of every RL job reads the same prompt file the same way (the job then trains on
    ``Run.prompts``); PPO with prompt files trains on them, not on dpo_en_demo."""
    from alignment.models.hf_assets import prepare_hf_dir
    from launchers.common import check_job
    from launchers.preflight import compose

    hf = prepare_hf_dir("smollm2")
    extra = [f"model.path={hf}", "model.reward_model_path=''", f"model.critic_path={hf}"] if job == "ppo" else []
    path = write(tmp_path / "t.jsonl", [{"prompt": r["question"], "answer": r["solution"]} for r in ROWS], "jsonl")
    cfg = compose(job, [f"data.train_files={path}", "data.heldout_fraction=0.25", "reward.functions=[{name: numeric}]",
                        f"output_dir={tmp_path / 'out'}", *extra])
    *_, prompts = check_job(cfg, 2)
    assert len(prompts.train) + len(prompts.heldout) == 40 and prompts.train[0].task == FILE_TASK
    assert prompts.tokens > 0 and prompts.sources == (path,)


def test_one_json_lines_reader_names_file_line_and_column(tmp_path):
    """alignment/data/text_files.read_jsonl, the reader of every .jsonl megalign reads (data.dataset, the PRM's
    records, the regression suite, GSM8K): each record with its file:line, blank lines skipped, a bad line named by
    file, line and column, a bad byte by file, line and column."""
    from alignment.data.text_files import read_jsonl

    path = tmp_path / "d.jsonl"
    path.write_text('{"a": 1}\n\n  \n[2, 3]\n')
    assert read_jsonl(path, "data.dataset") == [(f"{path}:1", {"a": 1}), (f"{path}:4", [2, 3])]
    path.write_text('{"a": 1}\n{"a": 2,, "b": 3}\n')
    with pytest.raises(ValueError, match=rf"^{path}:2: not a JSON line \(Expecting property name enclosed in double "
                                         r"quotes at column 9\)$"):
        read_jsonl(path, "data.dataset")
    path.write_bytes(b'{"a": 1}\n{"a": "\xff"}\n')
    with pytest.raises(ValueError, match=rf"^data.dataset={path}:2: not UTF-8 text \(byte 0xff at column 8"):
        read_jsonl(path, "data.dataset")

