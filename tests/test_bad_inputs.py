"""The catalogue of bad inputs (docs/reference/bad-inputs.md): each case is what a user could give, checked the
way a job checks it at start on every rank before any process group (``launchers/preflight.py``'s
config check, then :mod:`launchers.input_checks`), and answered with one error naming the field or
file and the fix; nothing is written to the output directory. The docs page's table is this list
(``python -m tests.test_bad_inputs`` prints it; a test keeps the two equal).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from hydra.errors import ConfigCompositionException

from alignment.schema import ConfigError
from alignment.training.checkpoint import CheckpointError
from parallel.layout import LayoutError

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Case:
    """``given``: the input (docs column); ``make(tmp) -> (config name, overrides, world size)``;
    ``error``: the exception type; ``says``: a part of the message (docs column: what the user sees);
    ``patch``: monkeypatches a test needs (name -> (target, attribute, value))."""

    kind: str
    given: str
    make: Callable
    error: type | None
    says: str
    patch: Callable | None = None


def conf(name: str, *overrides: str, world: int = 2):
    return lambda tmp: (name, list(overrides), world)


# ------------------------------------------------------------------ files the cases point at

def _write(tmp: Path, name: str, text: str | bytes) -> str:
    path = tmp / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


def data_file(name: str, text: str | bytes, algorithm: str = "sft", *extra: str):
    def make(tmp):
        return algorithm, [f"data.dataset={_write(tmp, name, text)}", "data.limits_of=null", f"output_dir={tmp / 'out'}",
                           *extra], 2
    return make


def _free_port() -> int:
    import socket

    with socket.socket() as s:  # bound, then closed: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt_file(rows: list[dict], functions: str = "[{name: math_verify}]", tail: bytes = b"", extra=()):
    """A GRPO job on a JSONL prompt file of ``rows`` (then the raw bytes ``tail``), scored by ``functions``."""
    def make(tmp):
        path = tmp / "prompts.jsonl"
        path.write_bytes("".join(json.dumps(r) + "\n" for r in rows).encode() + tail)
        return "grpo", [f"data.train_files={path}", f"reward.functions={functions}", f"output_dir={tmp / 'out'}",
                        *extra], 2
    return make


def _job_dir(tmp: Path, body: str) -> Path:
    """A folder of the user's with ``myjob.yaml``: the shipped GRPO job, then ``body``."""
    d = tmp / "my_configs"
    d.mkdir(exist_ok=True)
    (d / "myjob.yaml").write_text("defaults:\n  - grpo\n  - _self_\n" + body)
    return d


def _tiny_dir(tmp: Path, name: str, **edit) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer; ``edit``: config.json or tokenizer_config.json
    entries to change (``chat_template=None`` removes the template)."""
    from tests.dist.tiny_llama import save_tiny_hf_dir

    path = save_tiny_hf_dir(tmp / name)
    cfg = json.loads((path / "config.json").read_text())
    for k, v in edit.items():
        if k == "chat_template":
            (path / "chat_template.jinja").unlink(missing_ok=True)
            tok = json.loads((path / "tokenizer_config.json").read_text())
            tok.pop("chat_template", None)
            (path / "tokenizer_config.json").write_text(json.dumps(tok))
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def model_dir(config: str, *extra: str, **edit):
    return lambda tmp: (config, [f"model.path={_tiny_dir(tmp, 'model', **edit)}", f"output_dir={tmp / 'out'}",
                                 *extra], 2)


def damaged_model(damage: Callable, config: str = "sft"):
    """An SFT job on a tiny model directory after ``damage(directory)``."""
    def make(tmp):
        path = _tiny_dir(tmp, "model")
        damage(path)
        return config, [f"model.path={path}", f"output_dir={tmp / 'out'}"], 2
    return make


def _cut_weights(d: Path) -> None:  # a download interrupted: the file ends early
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _garble_header(d: Path) -> None:  # bytes of the JSON header overwritten
    with open(d / "model.safetensors", "r+b") as f:
        f.seek(12)
        f.write(b"\xff" * 8)


def _shard_index(d: Path) -> None:  # an index naming a second shard that is not there
    weights = json.loads(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                                    "b": "model-00002-of-00002.safetensors"}}))
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps(weights))


def _no_tokenizer(d: Path) -> None:
    for name in ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model"):
        (d / name).unlink(missing_ok=True)


def checkpoint(saved: dict, damage: Callable | None = None, config: str = "sft", *extra: str, step: int = 4):
    """A run's output directory holding ``checkpoints/step_<step>`` as a job writes it (config.yaml of
    the run with ``saved`` overrides, Megatron's metadata.json, common.pt and a shard, the manifest),
    then ``damage(step_dir)``; the case resumes from it."""
    def make(tmp):
        from omegaconf import OmegaConf

        from launchers.preflight import compose
        from parallel.atomic_dir import write_manifest
        import torch

        out = tmp / "out"
        step_dir = out / "checkpoints" / f"step_{step}"
        step_dir.mkdir(parents=True)
        cfg = compose(config, [f"output_dir={out}", *extra, *(f"{k}={v}" for k, v in saved.items())])
        (step_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
        (step_dir / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
        torch.save({"step": step, "optimizer_kind": "plain"}, step_dir / "common.pt")
        (step_dir / "__0_0.distcp").write_bytes(os.urandom(4096))
        write_manifest(step_dir)
        if damage is not None:
            damage(step_dir)
        return config, [f"output_dir={out}", *extra], 2
    return make


def _other_prompts(tmp: Path):
    """A GRPO run's checkpoint made on 5 training prompts, resumed on a file of 2."""
    path = _write(tmp, "prompts.jsonl", "".join(json.dumps({"prompt": f"{i}+1?", "answer": str(i + 1)}) + "\n"
                                                  for i in range(2)))
    saved = {"train_prompts": 5, "sha256": "0" * 64}
    return checkpoint({}, lambda d: (d / "prompts.json").write_text(json.dumps(saved)), "grpo",
                      f"data.train_files={path}", "reward.functions=[{name: math_verify}]")(tmp)


def _truncate(d: Path) -> None:
    with open(d / "__0_0.distcp", "r+b") as f:
        f.truncate(1000)


class _Payload:  # what a malicious common.pt would run when unpickled
    def __reduce__(self):
        return (os.system, (f"touch {os.environ.get('MEGALIGN_PAYLOAD', '/tmp/megalign_payload')}",))


def _malicious_common(d: Path) -> None:
    import torch

    from parallel.atomic_dir import write_manifest

    torch.save({"step": 4, "x": _Payload()}, d / "common.pt")
    write_manifest(d)


def _prm_dir(tmp: Path, train: str) -> str:
    d = tmp / "prm_data"
    d.mkdir()
    (d / "train.jsonl").write_text(train)
    (d / "heldout.jsonl").write_text(json.dumps({"prompt": "1+1", "completions": ["2"], "labels": [True]}) + "\n")
    return str(d)


def _not_installed(package: str):
    """A patch under which ``package`` is not installed (``importlib.util.find_spec`` finds nothing)."""
    def patch(monkeypatch):
        import importlib.util

        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    return patch


ALPACA = json.dumps({"instruction": "Say hi", "input": "", "output": "Hi"})

CASES: list[Case] = [
    # ---- configs: numeric fields out of range
    Case("config", "`trainer.lr=-1`", conf("grpo", "trainer.lr=-1"), ConfigError,
         "trainer.lr=-1.0: must be > 0"),
    Case("config", "`trainer.micro_batch_size=0`", conf("grpo", "trainer.micro_batch_size=0"), ConfigError,
         "trainer.micro_batch_size=0: must be >= 1"),
    Case("config", "`trainer.global_batch_size=15` at DP 2", conf("sft", "trainer.global_batch_size=15"), ConfigError,
         "trainer.global_batch_size=15 must be a multiple of the data-parallel size 2"),
    Case("config", "`rollout.group_size=1` (GRPO)", conf("grpo", "rollout.group_size=1"), ConfigError,
         "rollout.group_size=1: GRPO needs at least 2 samples per prompt"),
    Case("config", "`rollout.temperature=0` (GRPO)", conf("grpo", "rollout.temperature=0"), ConfigError,
         "rollout.temperature=0.0: GRPO samples"),
    Case("config", "`rollout.max_model_len=9000` (SmolLM2: 8,192 positions)",
         conf("grpo", "rollout.max_model_len=9000"),
         ConfigError, "rollout.max_model_len=9000 exceeds the model's max_position_embeddings=8192"),
    Case("config", "`algorithm.clip_ratio_high=-1`", conf("grpo", "algorithm.clip_ratio_high=-1"), ConfigError,
         "clip_ratio_high=-1.0: must be > 0"),
    Case("config", "`data.heldout_size=0`", conf("grpo", "data.heldout_size=0"), ConfigError,
         "data.heldout_size=0: must be >= 1"),
    Case("config", "`trainer.max_bad_steps=-1`", conf("grpo", "trainer.max_bad_steps=-1"), ConfigError,
         "trainer.max_bad_steps=-1: must be >= 0"),
    Case("config", "`model.lora.rank=-4`", conf("grpo", "model.lora.rank=-4"), ConfigError,
         "model.lora.rank=-4: must be >= 0 (0: no LoRA)"),
    Case("config", "`rollout.max_staleness=-1`", conf("grpo", "rollout.max_staleness=-1"), ConfigError,
         "rollout.max_staleness=-1: must be >= 0"),
    # ---- configs: unknown names
    Case("config", "`algorithm.name=ppo2`", conf("grpo", "algorithm.name=ppo2"), ConfigError,
         "algorithm.name='ppo2': valid values are grpo, ppo, rft, online_dpo, distill, sft, rm, dpo, prm"),
    Case("config", "`algorithm.loss_type=dpop` (DPO)", conf("dpo", "algorithm.loss_type=dpop"), ConfigError,
         "algorithm.loss_type='dpop': valid values are sigmoid, ipo, hinge, kto, simpo, orpo"),
    Case("config", "`algorithm.advantage_estimator=vtrace`", conf("grpo", "algorithm.advantage_estimator=vtrace"),
         ConfigError, "algorithm.advantage_estimator='vtrace': valid values are grpo, grpo_no_std, rloo"),
    Case("config", "`algorithm.policy_loss=grpo`", conf("grpo", "algorithm.policy_loss=grpo"), ConfigError,
         "algorithm.policy_loss='grpo': valid values are ppo, gspo, cispo"),
    Case("config", "`algorithm.advantage_estimator=examples.custom_algorithm.advantages:mean_baseline` (no such function)",
         conf("grpo", "algorithm.advantage_estimator=examples.custom_algorithm.advantages:mean_baseline"), ConfigError,
         "algorithm.advantage_estimator=examples.custom_algorithm.advantages:mean_baseline: "
         "examples.custom_algorithm.advantages has no function mean_baseline"),
    Case("config", "`algorithm.policy_loss=examples.custom_algorithm.advantages:median_baseline` (an estimator)",
         conf("grpo", "algorithm.policy_loss=examples.custom_algorithm.advantages:median_baseline"), ConfigError,
         "algorithm.policy_loss=examples.custom_algorithm.advantages:median_baseline: failed on logprobs [2, 3] "
         "(TypeError: median_baseline() takes 2 positional arguments but 6 were given); the contract is fn(logprobs, "
         "old_logprobs, advantages, response_mask, clip_ratio_low, clip_ratio_high) -> (per_token_loss, is_clipped), "
         "both [batch, seq]"),
    Case("config", "`data.task=mmlu`", conf("grpo", "data.task=mmlu"), ConfigError,
         "data.task='mmlu': valid values are arithmetic, gsm8k"),
    Case("config", "`rollout.backend=sglang`", conf("grpo", "rollout.backend=sglang"), ConfigError,
         "rollout.backend='sglang': valid values are vllm, megatron"),
    Case("config", "`rollout.environment=chess`", conf("grpo", "rollout.environment=chess"), ConfigError,
         "rollout.environment='chess': valid values are single_turn, tools, verifiers, openenv or 'package.module:factory'"),
    Case("config", "`reward.functions=[{name: helpfulness}]`", conf("grpo", "reward.functions=[{name: helpfulness}]"),
         ConfigError, "reward.functions names 'helpfulness'"),
    Case("config", "`trainer.lrr=1e-6` (a misspelt key)", conf("grpo", "trainer.lrr=1e-6"), ConfigError,
         "trainer.lrr: no such key; did you mean trainer.lr?"),
    Case("config", "`+trainer.stpes=3` (a misspelt key with Hydra's `+`)", conf("grpo", "+trainer.stpes=3"), ConfigError,
         "trainer.stpes: no such key; did you mean trainer.steps?"),
    Case("config", "`trainer.kl_coef=0.1` (a key of another section)", conf("grpo", "trainer.kl_coef=0.1"), ConfigError,
         "trainer.kl_coef: no such key; did you mean algorithm.kl_coef?"),
    Case("config", "`reward.functions=[{name: math_verify, wieght: 2}]` (a misspelt key in an entry)",
         conf("grpo", "reward.functions=[{name: math_verify, wieght: 2}]"), ConfigError,
         "reward.functions[0] has no key 'wieght'; did you mean weight?"),
    Case("config", "a misspelt key in your own job file (`--config-dir`)", lambda tmp: (
        "myjob", ["--config-dir=" + str(_job_dir(tmp, "trainer:\n  stpes: 3\n")), f"output_dir={tmp / 'out'}"], 2),
         ConfigError, "trainer.stpes (in "),
    Case("config", "`--config-dir` that does not exist", lambda tmp: (
        "grpo", [f"--config-dir={tmp / 'nowhere'}", f"output_dir={tmp / 'out'}"], 2), ConfigError,
         "nowhere: no such directory"),
    Case("config", "`trainer.steps=many` (a wrong type)", conf("grpo", "trainer.steps=many"), ConfigError,
         "trainer.steps=many: trainer.steps takes an integer >= 0 (0: whole epochs), not 'many'"),
    Case("config", "`trainer.lr: abc` in your own job file", lambda tmp: (
        "myjob", ["--config-dir=" + str(_job_dir(tmp, "trainer:\n  lr: abc\n")), f"output_dir={tmp / 'out'}"], 2),
         ConfigError, "trainer.lr takes a number > 0"),
    Case("config", "`algorithm.loss_type=ipo` for GRPO (another algorithm's setting)",
         conf("grpo", "algorithm.loss_type=ipo"), ConfigError, "algorithm.loss_type=ipo is set, but algorithm.name=grpo "
         "has no such setting (it belongs to online_dpo, dpo): remove it"),
    Case("config", "`algorithm.kl_coef=0.1` for DPO (its KL strength is `algorithm.beta`)",
         conf("dpo", "algorithm.kl_coef=0.1"), ConfigError, "algorithm.kl_coef=0.1 is set, but algorithm.name=dpo has "
         "no such setting (it belongs to grpo, ppo, distill)"),
    Case("config", "`data.task=gsm8k` with prompt files of your own", prompt_file(
        [{"prompt": "1+1?", "answer": "2"}], extra=("data.task=gsm8k",)), ConfigError,
         "data.task=gsm8k is set, but algorithm.name=grpo reads it only without data.train_files"),
    Case("config", "`rollout.max_tokens=64` for SFT", conf("sft", "rollout.max_tokens=64"), ConfigError,
         "rollout.max_tokens=64 is set, but algorithm.name=sft does not read it"),
    # ---- configs: combinations that cannot work
    Case("config", "Ulysses context parallelism for a model whose heads it cannot split (SmolLM2: 9)",
         conf("grpo", "parallel.context_parallel_size=2", "parallel.cp_comm_type=a2a"), LayoutError,
         "cp_comm_type=a2a (Ulysses): 9 query heads"),
    Case("config", "`rollout.max_staleness=1` without importance weights", conf("grpo", "rollout.max_staleness=1"),
         ConfigError, "rollout.max_staleness=1 trains on samples from a policy up to 1 step(s) old"),
    Case("config", "`parallel.tensor_model_parallel_size=2` for SmolLM2's 9 heads",
         conf("grpo", "parallel.tensor_model_parallel_size=2"), LayoutError,
         "parallel.tensor_model_parallel_size=2 must divide the model's 9 attention heads"),
    Case("config", "`parallel.tensor_model_parallel_size=3` on 2 processes",
         conf("grpo", "parallel.tensor_model_parallel_size=3"), LayoutError,
         "parallel.tensor_model_parallel_size=3 does not divide the world size 2"),
    Case("config", "`trainer.offload=true` for DPO", conf("dpo", "trainer.offload=true"), ConfigError,
         "trainer.offload=true is set, but algorithm.name=dpo does not read it"),
    Case("config", "a file of your own with the demo config's limits (`--config-name sft data.dataset=mine.jsonl`)",
         conf("sft", "data.dataset=mine.jsonl"), ConfigError, "data.dataset=mine.jsonl: this data config's limits were "
         "chosen for alpaca_en_demo (data.train_size=192, data.heldout_size=64 taken from the end"),
    Case("data", "a `data.columns` column the records lack", data_file(
        "qa.jsonl", json.dumps({"question": "Hi?", "answer": "Hello."}) + "\n", "sft",
        "data.columns={prompt: question, response: reply}"), ValueError,
         "data.columns.response='reply', but the record has no such column; its columns are question, answer"),
    Case("config", "`data.dataset=alpaca_en_demo` for DPO", conf("dpo", "data.dataset=alpaca_en_demo"), ConfigError,
         "data.dataset='alpaca_en_demo': algorithm.name=dpo trains on dpo_en_demo"),
    Case("config", "`cluster=slurm_h100x8` (16 processes) started as 8", conf("grpo", "cluster=slurm_h100x8", world=8),
         ConfigError, "cluster.nodes x cluster.gpus_per_node = 2 x 8 = 16 processes, but 8"),
    Case("config", "shared-prompt packing with context parallelism",
         conf("grpo", "trainer.shared_prompt_packing=true", "parallel.context_parallel_size=2"), ConfigError,
         "trainer.shared_prompt_packing=true does not run with parallel.context_parallel_size=2"),
    Case("config", "a token budget per micro-batch below the longest rollout",
         conf("grpo", "trainer.max_tokens_per_microbatch=256", "rollout.max_model_len=512"), ConfigError,
         "trainer.max_tokens_per_microbatch=256 is below rollout.max_model_len=512"),
    Case("config", "pipeline parallelism without packing for rejection sampling (uneven micro-batches)",
         conf("rft", "parallel.pipeline_model_parallel_size=2", "trainer.sequence_packing=false"),
         ConfigError, "with parallel.pipeline_model_parallel_size > 1 set trainer.sequence_packing=true"),
    # ---- data
    Case("data", "`data.dataset=` a file that does not exist", lambda tmp: (
        "sft", [f"data.dataset={tmp / 'none.jsonl'}", "data=file", f"output_dir={tmp / 'out'}"], 2), FileNotFoundError,
         "none.jsonl: no such file"),
    Case("data", "an empty dataset file", data_file("empty.jsonl", ""), ValueError, "holds no records"),
    Case("data", "a malformed JSON line", data_file("bad.jsonl", ALPACA + "\n" + '{"instruction": "x",\n'),
         ValueError, "bad.jsonl:2: not a JSON line"),
    Case("data", "a data file with a byte that is not UTF-8 (a Latin-1 line)", data_file(
        "latin1.jsonl", (ALPACA + "\n" + '{"instruction": "Caf\u00e9?", "output": "Oui"}\n').encode("latin-1")),
         ValueError, "latin1.jsonl:2: not UTF-8 text (byte 0xe9 at column 21"),
    Case("data", "a record without its response", data_file("short.jsonl", json.dumps({"instruction": "x"}) + "\n"),
         ValueError, "short.jsonl:1: missing output"),
    Case("data", "a preference record without `rejected`", data_file(
        "pairs.jsonl", json.dumps({"prompt": "x", "chosen": "a"}) + "\n", "dpo"), ValueError,
         "pairs.jsonl:1: missing rejected"),
    Case("data", "`data.heldout_size` larger than the dataset", data_file(
        "few.jsonl", "".join(json.dumps({"instruction": f"q{i}", "output": "a"}) + "\n" for i in range(5)), "sft",
        "data.heldout_size=8"), ValueError, "data.heldout_size=8: must be in [1, 4]"),
    Case("data", "a PRM data directory that does not exist", lambda tmp: (
        "prm", [f"data.dataset={tmp / 'nowhere'}", f"output_dir={tmp / 'out'}"], 2), ConfigError,
         "algorithm.name=prm trains on a directory of step-labelled solutions"),
    Case("data", "a PRM record with fewer labels than steps", lambda tmp: (
        "prm", [f"data.dataset={_prm_dir(tmp, json.dumps(dict(prompt='p', completions=['a', 'b'], labels=[True])))}",
                f"output_dir={tmp / 'out'}"], 2), ValueError, "train.jsonl:1: a record needs a prompt string"),
    Case("data", "GSM8K prompts longer than `rollout.max_model_len` leaves room for",
         conf("grpo_gsm8k", "rollout.max_model_len=320", "rollout.max_tokens=128"), ConfigError,
         "the longest prompt has 225 tokens"),
    Case("data", "`data.generator=chain_summ` (not a reasoning-gym dataset)", conf("grpo", "data.generator=chain_summ"),
         ConfigError, "data.generator='chain_summ' is not a reasoning-gym dataset"),
    Case("data", "a tokenizer without a chat template", model_dir("sft", chat_template=None), ConfigError,
         "its tokenizer has no chat template"),
    Case("data", "a prompt file without the `data.prompt_key` column", prompt_file([{"question": "1+1?", "answer": "2"}]),
         ConfigError, "data.prompt_key='prompt': "),
    Case("data", "an empty prompt in a prompt file", prompt_file([{"prompt": "1+1?"}, {"prompt": " "}]), ConfigError,
         "row 1 (prompt): the prompt is empty"),
    Case("data", "a prompt file with a byte that is not UTF-8", prompt_file(
        [{"prompt": "1+1?", "answer": "2"}], tail=b'{"prompt": "2+2\xff?", "answer": "4"}\n'), ConfigError,
         "prompts.jsonl:2: not UTF-8 text (byte 0xff at column 16"),
    Case("data", "an empty prompt file", prompt_file([]), ConfigError, "prompts.jsonl: the file holds no records"),
    Case("reward", "a TRL reward function taking a column the prompt file does not have", prompt_file(
        [{"prompt": "1+1?", "answer": "2"}], "[{name: 'tests.reward_fns:contains_answer'}]"), ConfigError,
         "reward.functions[tests.reward_fns:contains_answer] (tests.reward_fns:contains_answer) takes 'solution', which "
         "is no column of"),
    Case("data", "TRL's unpaired preference records (a `label` each) for DPO's sigmoid loss", data_file(
        "kto.jsonl", "".join(json.dumps({"prompt": f"Hi {i}", "completion": "Hello", "label": i % 2 == 0}) + "\n"
                             for i in range(6)), "dpo", "data.heldout_size=2"),
         ValueError, "unpaired preference records (prompt, completion, label) train with KTO (algorithm.loss_type=kto"),
    Case("data", "verl's parquet with a reference empty in every record", prompt_file(
        [{"prompt": [{"role": "user", "content": f"{i}+1?"}], "reward_model": {"style": "rule", "ground_truth": ""}}
         for i in range(4)]), ConfigError, "reward.functions[math_verify] (math_verify) compares each answer with the "
         "reference answer, but data.answer_key's column reward_model.ground_truth is empty in every training record"),
    Case("data", "`images` whose count differs from the `<image>` placeholders", prompt_file(
        [{"prompt": [{"role": "user", "content": "<image><image>How many?"}], "images": ["a.png"], "answer": "2"}]),
         ConfigError, "prompts.jsonl row 0: 2 <image> placeholders in the prompt and 1 images"),
    Case("data", "a prompt with images for a text model", prompt_file(
        [{"prompt": "How many?", "images": ["a.png"], "answer": "2"}]), ConfigError,
         "shows images, but model.path is a text model"),
    Case("config", "an `output_dir` that cannot be created (a file in the way)", lambda tmp: (
        "grpo", [f"output_dir={_write(tmp, 'a_file', 'x')}/run"], 2), ConfigError,
         "/a_file/run: cannot be created (", ),
    Case("data", "prompt files and no `reward.functions` to score the answers", prompt_file(
        [{"prompt": "1+1?"}], functions="[]"), ConfigError, "data.train_files: prompts of your own need reward.functions"),
    Case("reward", "a reward module that does not import", conf(
        "grpo", "reward.functions=[{name: no_such_pkg.rewards:score}]"), ConfigError,
         "module 'no_such_pkg.rewards' does not import"),
    Case("reward", "a reward function whose signature fits neither TRL's nor verl's", conf(
        "grpo", "reward.functions=[{name: tests.reward_fns:no_convention}]"), ConfigError,
         "fits neither convention: TRL's fn(prompts, completions, completion_ids, **kwargs)"),
    Case("reward", "a reward server nothing answers at", lambda tmp: (
        "grpo", [f"reward.functions=[{{name: judge, function: http, url: 'http://127.0.0.1:{_free_port()}/score'}}]"], 2),
         ConfigError, "reward.functions[judge]: reward server http://127.0.0.1:"),
    Case("reward", "a judge template without `{completion}`", conf(
        "grpo", "reward.functions=[{name: j, function: judge, url: 'http://localhost:8000/v1', template: 'Rate {prompt}'}]"),
         ConfigError, "reward.functions[j].template has no {completion}"),
    Case("reward", "a pairwise judge with one response per prompt", conf(
        "grpo", "reward.functions=[{name: j, function: judge, url: 'http://localhost:8000/v1', mode: pairwise}]",
        "rollout.group_size=1"), ConfigError, "reward.functions[j].mode=pairwise compares a prompt's responses"),
    Case("reward", "a judge model directory that does not exist", conf(
        "grpo", "reward.functions=[{name: j, function: judge, model: /no/judge}]"), ConfigError,
         "(/no/judge has no config.json)"),
    # ---- checkpoints (trainer.resume=true: the latest complete one)
    Case("checkpoint", "a shard file cut short", checkpoint({}, _truncate), CheckpointError,
         "__0_0.distcp has 1000 bytes, 4096 were written"),
    Case("checkpoint", "a shard file missing", checkpoint({}, lambda d: (d / "__0_0.distcp").unlink()), CheckpointError,
         "__0_0.distcp is missing"),
    Case("checkpoint", "`common.pt` that is not weights only (a pickled command)", checkpoint({}, _malicious_common),
         CheckpointError, "common.pt does not load as weights only"),
    Case("checkpoint", "only an interrupted save (`step_4.tmp`)", lambda tmp: (
        (tmp / "out" / "checkpoints" / "step_4.tmp").mkdir(parents=True), ("sft", [f"output_dir={tmp / 'out'}"], 2))[1],
         None, "ignoring step_4.tmp"),
    Case("checkpoint", "a checkpoint of another algorithm", checkpoint({"algorithm.name": "sft"}, None, "dpo"),
         ConfigError, "written by another run: algorithm.name='sft' (now 'dpo')"),
    Case("checkpoint", "a run resumed on other prompt files", _other_prompts, ConfigError,
         "the training prompts' count=5 (now 2); the training prompts' sha256='000"),
    Case("checkpoint", "a run with partial rollouts carried across steps resumed without them (its prompts in "
         "flight would be lost, its early-trained ones trained again)", checkpoint(
        {"rollout.partial": "true", "rollout.partial_carry_over": "true", "rollout.max_staleness": 1,
         "algorithm.rollout_correction.is_level": "token"}, None, "grpo"),
         ConfigError, "rollout.partial_carry_over=True (now False)"),
    Case("checkpoint", "a checkpoint with LoRA adapters resumed without them", checkpoint({"model.lora.rank": 8}),
         ConfigError, "model.lora.rank=8 (now 0)"),
    Case("checkpoint", "distributed-optimizer state saved at PP 2, resumed at PP 1", checkpoint(
        {"parallel.pipeline_model_parallel_size": 2}, None, "sft", "trainer.use_distributed_optimizer=true"),
         ConfigError, "parallel.pipeline_model_parallel_size=2 (now 1)"),
    Case("checkpoint", "a checkpoint of another model", lambda tmp: checkpoint(
        {"model.path": _tiny_dir(tmp, "other", hidden_size=32)})(tmp), ConfigError,
         "the model's hidden_size=32 (now 576"),
    # ---- models
    Case("model", "an unsupported architecture (`GPT2LMHeadModel`)",
         model_dir("sft", architectures=["GPT2LMHeadModel"]), ConfigError,
         "model architecture 'GPT2LMHeadModel' is not supported; supported: LlamaForCausalLM"),
    Case("model", "`model.safetensors` cut short (a download interrupted)", damaged_model(_cut_weights), ConfigError,
         "model.safetensors is damaged (Error while deserializing header: incomplete metadata, file not fully covered"),
    Case("model", "`model.safetensors` with a garbled header", damaged_model(_garble_header), ConfigError,
         "model.safetensors is damaged (Error while deserializing header"),
    Case("model", "a weight shard that `model.safetensors.index.json` names, missing", damaged_model(_shard_index),
         FileNotFoundError, "model-00002-of-00002.safetensors named by model.safetensors.index.json is missing"),
    Case("model", "a `config.json` that is not JSON", damaged_model(lambda d: (d / "config.json").write_text(
        '{"hidden_size": 64,')), ConfigError, "config.json is not JSON (Expecting property name enclosed in double "
         "quotes at line 1 column 20)"),
    Case("model", "the tokenizer's files missing", damaged_model(_no_tokenizer), FileNotFoundError,
         "no tokenizer files (tokenizer.json, vocab.json + merges.txt, or tokenizer.model)"),
    Case("model", "a tokenizer larger than the model's vocabulary", model_dir("sft", vocab_size=250), ConfigError,
         "but the model's vocab_size is 250"),
    Case("model", "`model.reward_model_path` that does not exist", lambda tmp: (
        "ppo", ["model.path=smollm2", f"model.reward_model_path={tmp / 'rm'}", f"output_dir={tmp / 'out'}"], 2),
         FileNotFoundError,
         "model.reward_model_path="),
    Case("model", "a reward model with another vocabulary", lambda tmp: (
        "ppo", ["model.path=smollm2", f"model.reward_model_path={_tiny_dir(tmp, 'rm', vocab_size=50000)}",
                f"output_dir={tmp / 'out'}"], 2),
         ConfigError, "has a vocabulary of 50000 tokens, the policy"),
    Case("model", "`model.path=ORG/NAME` offline (`HF_HUB_OFFLINE=1`) and not in the Hub's cache",
         conf("sft", "model.path=Acme/Not-Cached"), FileNotFoundError, "model.path=Acme/Not-Cached: not in the Hugging "
         "Face cache", patch=lambda mp: (mp.setenv("HF_HUB_OFFLINE", "1"), mp.setenv("HF_HUB_CACHE", "/nonexistent/hub"))),
    # ---- environment
    Case("environment", "vLLM not installed, `rollout.backend=vllm`", conf("grpo"), ConfigError,
         "rollout.backend=vllm, but vLLM is not installed", patch=_not_installed("vllm")),
    Case("environment", "a tracker whose package is not installed (`logger.backends=[tensorboard, wandb]`)",
         conf("sft", "logger.backends=[tensorboard, wandb]"), ConfigError, "logger.backends has wandb, but the package "
         "is not installed: pip install 'megalign[trackers]' (or wandb)", patch=_not_installed("wandb")),
    Case("environment", "verifiers not installed, `rollout.environment=verifiers`",
         conf("grpo", "rollout.environment=verifiers", "rollout.environment_id=tests.verifiers_envs"), ConfigError,
         "rollout.environment=verifiers needs the verifiers package, which is not installed: pip install "
         "'megalign[verifiers]'", patch=_not_installed("verifiers")),
    Case("environment", "openenv-core not installed, `rollout.environment=openenv`",
         conf("grpo", "rollout.environment=openenv", "rollout.environment_id=tests.openenv_envs:GuessEnv",
              "rollout.environment_args={url: 'http://127.0.0.1:9'}"), ConfigError,
         "rollout.environment=openenv needs the openenv-core package, which is not installed: pip install "
         "'megalign[openenv]'", patch=_not_installed("openenv")),
    Case("environment", "an OpenEnv server that does not answer (`rollout.environment_args={url: ...}`)",
         conf("grpo", "rollout.environment=openenv", "rollout.environment_id=tests.openenv_envs:GuessEnv",
              "rollout.environment_args={url: 'http://127.0.0.1:9'}"), ConfigError,
         "rollout.environment_args.url=http://127.0.0.1:9 does not answer"),
    Case("environment", "an OpenEnv app that does not import (`rollout.environment_args={app: ...}`)",
         conf("grpo", "rollout.environment=openenv", "rollout.environment_id=tests.openenv_envs:GuessEnv",
              "rollout.environment_args={app: 'tests.openenv_envs:no_app'}"), ConfigError,
         "rollout.environment_args.app=tests.openenv_envs:no_app: module 'tests.openenv_envs' has no 'no_app'"),
    Case("environment", "OpenEnv reset arguments holding the task's `seed`",
         conf("grpo", "rollout.environment=openenv", "rollout.environment_id=tests.openenv_envs:GuessEnv",
              "rollout.environment_args={app: 'tests.openenv_envs:app', reset_kwargs: {seed: 1}}"), ConfigError,
         "rollout.environment_args.reset_kwargs={'seed': 1}: give a mapping of reset()'s keyword arguments, without "
         "seed (each task is its seed)"),
    Case("data", "an OpenEnv client whose Action has several text fields and no `action_field`",
         conf("grpo", "rollout.environment=openenv", "rollout.environment_id=tests.openenv_envs:TwoFieldEnv",
              "rollout.environment_args={url: 'http://127.0.0.1:9'}"), ConfigError,
         "its Action (TwoFieldAction) has 2 text fields (message, note): name the one the reply fills with "
         "rollout.environment_args.action_field"),
    Case("data", "a verifiers environment that does not import (`rollout.environment_id=my_env`)",
         conf("grpo", "rollout.environment=verifiers", "rollout.environment_id=my_env"), ConfigError,
         "rollout.environment_id=my_env: Could not import 'my_env' (ModuleNotFoundError: No module named 'my_env')"),
    Case("data", "a verifiers environment whose `load_environment` raises (`rollout.environment_args={kind: chess}`)",
         conf("grpo", "rollout.environment=verifiers", "rollout.environment_id=tests.verifiers_envs",
              "rollout.environment_args={kind: chess}"), ConfigError,
         "rollout.environment_id=tests.verifiers_envs: load_environment(**rollout.environment_args={'kind': 'chess'}) "
         "failed: ValueError: kind='chess'"),
    Case("environment", "an MLflow tracking server that does not answer (`MLFLOW_TRACKING_URI`)",
         conf("sft", "logger.backends=[tensorboard, mlflow]"), ConfigError, "logger.backends has mlflow, but "
         "MLFLOW_TRACKING_URI=http://127.0.0.1:9 does not answer", patch=lambda mp: mp.setenv(
             "MLFLOW_TRACKING_URI", "http://127.0.0.1:9")),
    Case("environment", "MLflow's file store as the tracking URI (`MLFLOW_TRACKING_URI=file:///...`)",
         conf("sft", "logger.backends=[tensorboard, mlflow]"), ConfigError, "is MLflow's file store, which cannot "
         "hold a run's reward/<term> beside reward/<term>/scored", patch=lambda mp: mp.setenv(
             "MLFLOW_TRACKING_URI", "file:///tmp/mlruns")),
    Case("config", "an unknown tracker (`logger.backends=[tensorboard, comet]`)",
         conf("sft", "logger.backends=[tensorboard, comet]"), ConfigError,
         "logger.backends=['tensorboard', 'comet']: give each of tensorboard, wandb, mlflow, trackio at most once"),
    Case("environment", "a GPU cluster config on a CPU machine", conf(
        "sft", "cluster=slurm_h100x8", "trainer.micro_batch_size=1", world=16),
         ConfigError, "has no CUDA device"),
]


def _id(case: Case) -> str:
    return re.sub(r"[^a-z0-9]+", "_", f"{case.kind} {case.given}".lower()).strip("_")[:60]


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_bad_input_gets_one_clear_error(case, tmp_path, monkeypatch, capfd):
    """``megalign train --dry-run`` on the case: exactly one line, ``megalign: error: ...`` with the
    message, exit status 2 (the run starting instead where nothing is wrong), the error of the
    catalogued type, nothing unpickled run and nothing written: the case runs in its own working
    directory with its own ``output_dir`` (the case's, else ``out`` there), and every byte under
    that directory is the same after the check as before (:func:`snapshot`)."""
    from launchers import console
    from tools import cli

    if case.patch is not None:
        case.patch(monkeypatch)
    monkeypatch.chdir(tmp_path)  # a default relative output_dir, or anything else relative, lands here
    monkeypatch.setenv("MEGALIGN_PAYLOAD", str(tmp_path / "payload_ran"))
    raised = []
    monkeypatch.setattr(cli, "error_line", lambda e: raised.append(e) or console.error_line(e))
    name, overrides, world = case.make(tmp_path)
    if not any(o.startswith(("output_dir=", "+output_dir=")) for o in overrides):
        overrides = [*overrides, f"output_dir={tmp_path / 'out'}"]
    before = snapshot(tmp_path)
    capfd.readouterr()
    status = cli.train(["--dry-run", "--nproc", str(world), f"--config-name={name}", *overrides])
    out, err = capfd.readouterr()
    lines = (out + err).splitlines()
    if case.error is None:  # the start-up summary, then ok
        assert status == 0 and lines[-1].startswith("ok: ") and case.says in out and not err, out + err
    else:
        assert status == 2, out + err
        assert len(lines) == 1 and lines[0].startswith("megalign: error: "), out + err
        assert case.says in lines[0], lines[0]
        assert len(raised) == 1 and isinstance(raised[0], case.error), raised
    assert not (tmp_path / "payload_ran").exists()  # nothing unpickled ran
    after = snapshot(tmp_path)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, changed  # nothing written, changed or removed, nor a directory made


def snapshot(root: Path) -> dict[str, str]:
    """Every path under ``root`` -> the sha256 of its bytes (``dir`` for a directory)."""
    return {str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in root.rglob("*") if not p.is_symlink()}


def table() -> str:
    lines = ["| # | kind | input | what the user sees (part of the message) |", "|---|---|---|---|"]
    for i, c in enumerate(CASES, 1):
        says = (c.says or "(nothing: the run starts)").replace("|", "\\|")
        lines.append(f"| {i} | {c.kind} | {c.given} | {('`' + says + '`') if c.says else says} |")
    return "\n".join(lines)


def ranges_table() -> str:
    """The docs page's list of every numeric field's range."""
    from alignment.config import every_range

    return "\n".join(f"- `{f}` {r.describe()}{r.note}" for f, r in every_range().items())


def test_the_readme_lists_the_catalogue():
    assert len(CASES) >= 40
    page = (ROOT / "docs" / "reference" / "bad-inputs.md").read_text()
    assert table() in page and ranges_table() in page, \
        "docs/reference/bad-inputs.md differs from the catalogue: python -m tests.test_bad_inputs prints both"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    print(table() + "\n\n" + ranges_table())


def _outside(field: str, side: str):
    """A value of ``field`` just outside its range, below it (``side="low"``) or above it ("high")."""
    from alignment.config import every_range

    r = every_range()[field]
    if side == "high":
        return r.high + 1 if r.high_in else r.high
    return r.low - 1 if r.low_in else r.low


#: a job that reads the field (alignment/reads.py), and what it needs set for that
READERS = {
    "algorithm.beta": ("dpo", ()), "algorithm.label_smoothing": ("dpo", ()),
    "algorithm.simpo_gamma": ("dpo", ("algorithm.loss_type=simpo",)),
    "algorithm.orpo_lambda": ("dpo", ("algorithm.loss_type=orpo",)), "algorithm.center_coef": ("rm", ()),
    "algorithm.distill_beta": ("distill", ("algorithm.distill_loss=jsd",)), "algorithm.task_reward_weight": ("distill", ()),
    "algorithm.iteration_steps": ("online_dpo", ("algorithm.ref_update=iteration",)),
    "algorithm.max_sampling_rounds": ("grpo", ("algorithm.dynamic_sampling=true",)),
    "algorithm.overlong_penalty_factor": ("grpo", ("algorithm.overlong_buffer_len=8",)),
    "algorithm.rollout_correction.is_threshold": ("grpo", ("algorithm.rollout_correction.is_level=token",)),
    "algorithm.rollout_correction.mask_high": ("grpo", ("algorithm.rollout_correction.mask_level=token",)),
    "algorithm.rollout_correction.mask_low": ("grpo", ("algorithm.rollout_correction.mask_level=token",)),
    "data.max_length": ("sft", ()), "data.max_prompt_length": ("sft", ()), "trainer.global_batch_size": ("sft", ()),
    "model.lora.alpha": ("grpo", ("model.lora.rank=8",)), "model.lora.dropout": ("grpo", ("model.lora.rank=8",)),
    "rollout.agent_concurrency": ("grpo", ("rollout.agent=examples.agents.react_math:run",)),
    "rollout.agent_timeout_s": ("grpo", ("rollout.agent=examples.agents.react_math:run",)),
    "rollout.agent_max_tokens": ("grpo", ("rollout.agent=examples.agents.react_math:run",)),
    "rollout.agent_max_tokens_per_turn": ("grpo", ("rollout.agent=examples.agents.react_math:run",)),
    "rollout.max_turns": ("grpo", ("rollout.environment=tools",)),
    "rollout.partial_chunk_tokens": ("grpo", ("rollout.partial=true",)),
}


def _reader(field: str) -> tuple[str, tuple]:
    if field in READERS:
        return READERS[field]
    ppo = field.startswith(("trainer.critic", "algorithm.gamma", "algorithm.gae", "algorithm.value", "algorithm.target"))
    return ("ppo" if ppo else "grpo"), ()


def _sides() -> list[tuple[str, str]]:
    """Every numeric field's lower side, and the upper side of those bounded above."""
    from alignment.config import every_range

    return [(f, "low") for f in sorted(every_range())] + [(f, "high") for f, r in sorted(every_range().items())
                                                           if r.high is not None]


def test_every_numeric_field_has_a_range_or_is_marked_unbounded():
    from alignment.algorithms import registry
    from alignment.config import JobConfig, every_range
    from alignment.schema import numeric_fields

    fields = dict(numeric_fields(JobConfig))
    for algorithm in registry.ALGORITHMS.values():  # each algorithm's own section
        fields.update(numeric_fields(algorithm.config, "algorithm."))
    unmarked = [name for name, f in fields.items() if "range" not in f.metadata]
    assert unmarked == [], f"numeric fields with neither ranged(...) nor unbounded(...): {unmarked}"
    assert len(every_range()) >= 70 and every_range()["trainer.micro_batch_size"].describe() == ">= 1"
    assert every_range()["rollout.top_p"].describe() == "in (0, 1]"
    assert every_range()["algorithm.gae_lambda"].describe() == "in [0, 1]"


@pytest.mark.parametrize("field,side", _sides(), ids=[f"{f}-{side}" for f, side in _sides()])
def test_numeric_field_out_of_range(field, side):
    """Each numeric field just outside its range, on each side it has: one error naming it and its
    range, before anything else reads it."""
    from alignment.config import every_range
    from launchers.preflight import check

    value = _outside(field, side)
    config, extra = _reader(field)
    with pytest.raises(ConfigError) as info:
        check(config, [f"{field}={value}", "model.path=smollm2", *extra], 2)
    assert str(info.value).startswith(f"{field}=") and f"must be {every_range()[field].describe()}" in str(info.value), \
        str(info.value)
