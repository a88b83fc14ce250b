"""``data``: what a job trains on (:class:`DataConfig`: a built-in task, prompt files, or a dataset
of examples) and the checks of its own values: an RL job's prompt source (:func:`check_prompt_source`)
and a fixed-data job's dataset (:func:`check_dataset`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from alignment.data.chat_data import is_data_file
from alignment.data.records import check_columns
from alignment.data.step_data import SPLIT_FILES, split_path
from alignment.data.tasks import TASKS
from alignment.schema import ConfigError, ranged

OVERLONG_PROMPTS = ("error", "drop")


@dataclass
class DataConfig:
    """Task or dataset and split sizes; held-out records are never trained on."""

    # RL jobs: arithmetic (reasoning-gym chain_sum) | gsm8k | humaneval (unit tests run in the sandbox) |
    # length (a smoke test)
    task: str = "arithmetic"
    # SFT / RM / DPO jobs: alpaca_en_demo (SFT) | dpo_en_demo (pairs), from the llamafactory sdist, or a file
    # of your own (.json array / .jsonl lines): SFT records alpaca-style {instruction, input, output} or
    # {messages: [...]} ending with the assistant's; pairs ShareGPT-style {conversations, chosen, rejected} or
    # {prompt, chosen, rejected} (alignment/data/chat_data.py);
    # PRM: a directory of step-labelled solutions (train.jsonl, heldout.jsonl) from tools/make_prm_data.py
    dataset: str = "dpo_en_demo"
    # SFT / RM / DPO: your file's column names for the fields read (LLaMA-Factory's dataset_info names):
    # prompt, query (appended to the prompt), response, system, messages (SFT); prompt, messages, chosen,
    # rejected, system (pairs); e.g. {prompt: question, response: answer}
    columns: Any = None
    # the dataset the split sizes and lengths of this data config were chosen for (the demo configs set it):
    # another data.dataset is refused until you choose its limits (data=file takes a file whole)
    limits_of: Optional[str] = None
    max_length: int = ranged(256, 2, note=' (tokens)')  # tokens of prompt + response (longer ones are truncated)
    max_prompt_length: int = ranged(128, 1, note=' (tokens)')  # the prompt keeps its last max_prompt_length tokens
    # task=arithmetic: the reasoning-gym generator (null: chain_sum) and its settings, e.g.
    # basic_arithmetic with 4-6 terms of 2-3 digits for the tool task (configs/data/arithmetic_tools.yaml)
    generator: Optional[str] = None
    generator_kwargs: dict[str, Any] = field(default_factory=lambda: {  # task=arithmetic: the generator's settings
        "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})
    train_size: Optional[int] = ranged(2000, 1)  # the first N training examples (null: all; SFT / RM / DPO)
    # data.task's held-out problems; SFT / RM / DPO without held-out files or fraction: the last N
    heldout_size: int = ranged(100, 1)
    # RL tasks: the instruction after the question; null: the task's own (alignment/data/prompts.py; a file's
    # prompts have none), e.g. "Solve it step by step, ..." (alignment.data.step_data.STEP_INSTRUCTION) for a PRM
    instruction: Optional[str] = None
    # RL jobs on prompts of your own (alignment/data/prompt_data.py), instead of data.task: a path or a list of
    # paths, each a .jsonl / .json / .parquet / .csv file or a Dataset.save_to_disk directory, read with
    # Hugging Face datasets; every record is used (data.train_size / heldout_size apply to data.task only)
    train_files: Optional[Any] = None
    # held-out prompts: files like train_files, or else the records whose prompt hashes into
    # heldout_fraction of [0, 1) (the same split for every seed); neither: no held-out evaluation
    heldout_files: Optional[Any] = None
    # the fraction of train_files' prompts (or an SFT / RM / DPO file's records) held out by hash; null: 0.05 of
    # train_files without heldout_files, else 0 (alignment/compose.py)
    heldout_fraction: Optional[float] = ranged(None, 0, 1, note=' (0: no held-out split by hash; null: 0.05 of '
                                               'data.train_files, else 0)')
    prompt_key: str = "prompt"  # the prompt column: a string, or chat messages [{role, content}, ...]
    answer_key: Optional[str] = None  # the reference-answer column; null: "answer" when the files have one
    # algorithm.distill_samples=dataset: the column of data.train_files holding each prompt's answer, the text the
    # student learns the teacher's distributions on (off-policy KD; TRL's prompt-completion "completion")
    response_key: Optional[str] = None
    shuffle: bool = True  # a fresh order of the training prompts every epoch, from the seed and the epoch
    # a prompt longer than rollout.max_model_len - rollout.max_tokens: error (refused at start) | drop (counted)
    overlong_prompts: str = "error"
    system_prompt: Optional[str] = None  # RL jobs: a system message before each prompt; null: the template's default
    # RL jobs: keyword arguments of the tokenizer's chat template, e.g. {enable_thinking: false} for Qwen3
    chat_template_kwargs: Any = None


def check_prompt_source(d: DataConfig) -> None:
    """An RL job's prompts: a built-in ``data.task`` (and its generator), or ``data.train_files`` with
    one way to hold prompts out and a known ``data.overlong_prompts``."""
    if d.overlong_prompts not in OVERLONG_PROMPTS:
        raise ConfigError(f"data.overlong_prompts={d.overlong_prompts!r}: valid values are {', '.join(OVERLONG_PROMPTS)}")
    if not d.train_files:
        if d.heldout_files or d.heldout_fraction:
            raise ConfigError("data.heldout_files / data.heldout_fraction split data.train_files; data.task's problems "
                              "have their own held-out split (data.heldout_size): give data.train_files, or unset them")
        if d.train_size is None:
            raise ConfigError(f"data.train_size=null: data.task={d.task} draws that many training problems; give a number")
        if d.task not in TASKS:
            raise ConfigError(f"data.task={d.task!r}: valid values are {', '.join(TASKS)} (or prompts of your own: "
                              "data.train_files)")
        return check_generator(d)
    if d.heldout_files and d.heldout_fraction:
        raise ConfigError(f"data.heldout_files and data.heldout_fraction={d.heldout_fraction} are both set: hold out "
                          "a file's prompts or a fraction of data.train_files, not both")
    if not d.prompt_key:
        raise ConfigError("data.prompt_key is empty: name the column that holds the prompts (e.g. prompt)")


def check_generator(d: DataConfig) -> None:
    """``data.generator``: a reasoning-gym dataset, for the arithmetic-style tasks only."""
    gen = d.generator
    if gen is None:
        return
    if d.task not in ("arithmetic", "length"):
        raise ConfigError(f"data.generator={gen!r} applies to data.task=arithmetic (or length); data.task={d.task} "
                          "has its own data; set data.generator=null")
    from reasoning_gym.factory import DATASETS

    if gen not in DATASETS:
        close = [n for n in sorted(DATASETS) if "arith" in n or "sum" in n]
        raise ConfigError(f"data.generator={gen!r} is not a reasoning-gym dataset; e.g. {', '.join(close)}")


def check_dataset(d: DataConfig, algorithm: str, examples: str) -> None:
    """A fixed-data job's examples (``algorithm``: its name; ``examples``: the kind it trains on, ``sft``,
    ``preference`` or ``steps``): ``data.dataset`` of that kind (the demo set, a file of your own, or the PRM data
    tool's directory), limits chosen for it, columns the algorithm reads, and a prompt shorter than the example.

    Raises:
        ConfigError: naming the field and the fix.
    """
    if d.train_files:
        raise ConfigError(f"data.train_files are prompts for the RL jobs; algorithm.name={algorithm} reads its "
                          "examples from data.dataset (a demo set or a file of your own; held out: "
                          "data.heldout_files)")
    if examples == "steps":
        missing = [f for split, f in SPLIT_FILES.items() if split_path(d.dataset, split) is None]
        if missing:
            raise ConfigError(f"data.dataset={d.dataset}: algorithm.name={algorithm} trains on a directory of step-labelled "
                              f"solutions, but {', '.join(missing)} is missing there; write them with `python "
                              f"tools/make_prm_data.py --out {d.dataset}` (or point data.dataset at such a directory)")
    else:
        wanted = "alpaca_en_demo" if examples == "sft" else "dpo_en_demo"
        if not is_data_file(d.dataset) and d.dataset != wanted:
            raise ConfigError(f"data.dataset={d.dataset!r}: algorithm.name={algorithm} trains on {wanted} or a file "
                              f"of your own ({'alpaca or chat messages' if examples == 'sft' else 'prompt, chosen, rejected'} "
                              "records in .json / .jsonl / .parquet / .csv or a save_to_disk directory)")
        if d.limits_of and d.dataset != d.limits_of:
            raise ConfigError(f"data.dataset={d.dataset}: this data config's limits were chosen for {d.limits_of} "
                              f"(data.train_size={d.train_size}, data.heldout_size={d.heldout_size} taken from the "
                              f"end, data.max_length={d.max_length}); add data=file to use your file whole (held "
                              "out: data.heldout_fraction=0.05), or set data.limits_of=null to keep these")
        try:
            check_columns(dict(d.columns or {}), examples)
        except ValueError as e:
            raise ConfigError(str(e)) from e
    if d.max_prompt_length >= d.max_length:
        raise ConfigError(f"data.max_prompt_length={d.max_prompt_length} must be in [1, data.max_length="
                          f"{d.max_length})")
