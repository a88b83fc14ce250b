"""How a job's config is composed (``alignment/compose.py``): strict keys with the nearest valid ones, a job
file in the user's own folder (``--config-dir``) that uses the shipped groups, what the user set apart from
what the shipped files set, a job on the user's own data that takes the general defaults rather than the
demo's, the settings a job does not read refused when the user sets them (``alignment/reads.py``) and
marked by ``--print-config``, and the start-up summary ``megalign train --dry-run`` prints."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import yaml

from alignment.algorithms import registry
from alignment.algorithms.config import GRPOConfig, RFTConfig
from alignment.compose import DEFAULT_HELDOUT_FRACTION, LORA_LR, compose_job, job_keys, nearest, split_job_args
from alignment.config import JobConfig, job_config
from alignment.reads import RULES, unread_keys
from alignment.schema import ConfigError, schema_keys
from tools import cli


def _prompts(tmp_path: Path, n: int = 40) -> Path:
    path = tmp_path / "my prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(n)))
    return path


OWN = ["reward.functions=[{name: math_verify}]"]


# ------------------------------------------------------------------ strict keys

@pytest.mark.parametrize("given,says", [
    ("trainer.stpes=3", "trainer.stpes: no such key; did you mean trainer.steps?"),
    ("+trainer.stpes=3", "trainer.stpes: no such key; did you mean trainer.steps?"),
    ("++trainer.stpes=3", "trainer.stpes: no such key; did you mean trainer.steps?"),
    ("rollout.kl_coef=0.1", "rollout.kl_coef: no such key; did you mean algorithm.kl_coef?"),
    ("model.lora.rnk=8", "model.lora.rnk: no such key; did you mean model.lora.rank?"),
    ("trainer.steps=many", "trainer.steps=many: trainer.steps takes an integer >= 0 (0: whole epochs), not 'many'"),
    ("trainer.lr=abc", "trainer.lr=abc: trainer.lr takes a number > 0, not 'abc'"),
    ("trainer.lr=null", "trainer.lr=null: trainer.lr takes a number > 0, not null"),
    ("trainer.resume=maybe", "trainer.resume=maybe: trainer.resume takes true or false, not 'maybe'"),
    ("reward.functions=[{name: math_verify, wieght: 2}]", "reward.functions[0] has no key 'wieght'; did you mean weight?"),
    ("reward.functions=[math_verify]", "each entry of reward.functions is a mapping {key: value, ...}, entry 0 is "
                                       "'math_verify'"),
    ("model.lora={rank: 8, alhpa: 16}", "model.lora has no key 'alhpa'; did you mean alpha?"),
    ("trainer=oops", "trainer=oops: trainer takes a mapping {key: value, ...}, not 'oops'"),  # not a group
])
def test_a_key_outside_the_schema_or_a_wrong_type_is_one_line_naming_the_fix(given, says):
    if says is None:
        compose_job("grpo", [given])
        return
    with pytest.raises(Exception) as info:
        compose_job("grpo", [given])
    assert says in str(info.value), str(info.value)


def test_plus_on_a_key_the_schema_has_sets_it_and_free_form_mappings_take_new_keys():
    c = compose_job("grpo", ["+trainer.steps=3", "++rollout.group_size=4", "data.generator_kwargs.max_digits=2",
                             "+data.chat_template_kwargs.enable_thinking=false"]).cfg
    assert (c.trainer.steps, c.rollout.group_size, c.data.generator_kwargs.max_digits) == (3, 4, 2)
    assert c.data.chat_template_kwargs == {"enable_thinking": False}


def test_nearest_keys():
    keys = job_keys(GRPOConfig)
    assert nearest("trainer.stpes", keys) == ["trainer.steps"]
    assert nearest("algorithm.clip_ration", keys) == ["algorithm.clip_ratio", "algorithm.clip_ratio_c",
                                                      "algorithm.clip_ratio_high"]
    assert nearest("data.max_tokens", keys) == ["data.max_length", "rollout.max_tokens"]


def test_job_options_on_the_command_line():
    assert split_job_args(["-cn", "sft", "-cd", "d", "a=1"]) == ("sft", "d", ["a=1"])
    assert split_job_args(["--config-name=dpo.yaml", "--config-dir=x", "b=2"]) == ("dpo", "x", ["b=2"])
    assert split_job_args([]) == ("grpo", None, [])
    with pytest.raises(ConfigError, match="--config-dir needs a value"):
        split_job_args(["--config-dir"])
    with pytest.raises(ConfigError, match="unknown option '--multirun'"):
        split_job_args(["--multirun"])


# ------------------------------------------------------------------ your own config folder

def _job(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.yaml").write_text(textwrap.dedent(text))
    return folder


def test_a_job_file_in_your_own_folder_uses_the_shipped_groups(tmp_path):
    own = _job(tmp_path / "my_configs", "my_grpo", """\
        defaults:
          - job_schema
          - model: smollm2
          - algorithm: dr_grpo
          - parallel: single
          - rollout: long
          - data: arithmetic
          - mine: small
          - _self_
        run_name: mine
        trainer:
          steps: 3
          lr: 2e-6
        """)
    _job(own / "mine", "small", "# @package rollout\ngroup_size: 4\n")
    comp = compose_job("my_grpo", ["trainer.micro_batch_size=4"], own)
    c = comp.cfg
    assert comp.job_file == own / "my_grpo.yaml" and comp.config_dir == own
    assert (c.algorithm.name, c.algorithm.advantage_estimator, c.rollout.max_tokens) == ("grpo", "grpo_no_std", 256)
    assert (c.run_name, c.trainer.steps, c.trainer.lr, c.rollout.group_size) == ("mine", 3, 2e-6, 4)
    # what the user set: the command line, their job file and their group file; the shipped groups' values are not
    assert comp.user_keys == {"trainer.micro_batch_size", "run_name", "trainer.steps", "trainer.lr",
                              "rollout.group_size"}
    # a shipped job as the base
    _job(own, "on_grpo", "defaults:\n  - grpo\n  - _self_\nrollout:\n  temperature: 1.0\n")
    c = compose_job("on_grpo", [], own).cfg
    assert (c.run_name, c.rollout.temperature, c.trainer.steps) == ("grpo_smollm2_arithmetic", 1.0, 12)


def test_your_job_files_mistakes_are_named_with_the_file(tmp_path):
    own = _job(tmp_path / "c", "typo", "defaults:\n  - grpo\n  - _self_\ntrainer:\n  stpes: 3\n")
    with pytest.raises(ConfigError, match=r"trainer.stpes \(in .*typo.yaml\): no such key; did you mean trainer.steps"):
        compose_job("typo", [], own)
    _job(own, "no_schema", "run_name: x\n")
    with pytest.raises(ConfigError, match="does not start from megalign's schema; begin it with `- job_schema`"):
        compose_job("no_schema", [], own)
    with pytest.raises(ConfigError, match="--config-name nothing: no nothing.yaml in .* the shipped jobs are cispo"):
        compose_job("nothing", [], own)
    with pytest.raises(ConfigError, match="--config-dir .*missing: no such directory"):
        compose_job("grpo", [], tmp_path / "missing")


# ------------------------------------------------------------------ your data, not the demo's defaults

def test_a_job_on_your_own_prompts_takes_the_general_defaults(tmp_path):
    demo = compose_job("grpo", []).cfg
    assert (demo.run_name, demo.trainer.steps, demo.rollout.max_tokens, demo.rollout.max_model_len) == \
        ("grpo_smollm2_arithmetic", 12, 48, 512)
    path = _prompts(tmp_path)
    comp = compose_job("grpo", [f"data.train_files={path}", *OWN])
    c = comp.cfg
    assert comp.left_out == {"run_name": "grpo_smollm2_arithmetic", "trainer.steps": 12, "rollout.max_tokens": 48,
                             "rollout.eval_max_tokens": 48, "rollout.max_model_len": 512}
    assert (c.run_name, c.output_dir) == ("grpo_my_prompts", "outputs/grpo_my_prompts")
    assert (c.trainer.steps, c.rollout.max_tokens, c.rollout.eval_max_tokens, c.rollout.max_model_len) == \
        (0, 1024, 1024, None)
    assert c.data.heldout_fraction == DEFAULT_HELDOUT_FRACTION and comp.derived == {
        "run_name": "grpo_my_prompts", "data.heldout_fraction": DEFAULT_HELDOUT_FRACTION}
    assert c.trainer.lr == 5e-6  # not the demo's task: the job's choice, printed as the job's (test_dry_run_...)
    # what the user sets stays, and a held-out file or fraction of theirs is theirs
    c = compose_job("grpo", [f"data.train_files={path}", *OWN, "rollout.max_tokens=64", "trainer.steps=5",
                             "run_name=x", f"data.heldout_files={path}"]).cfg
    assert (c.rollout.max_tokens, c.rollout.eval_max_tokens, c.trainer.steps, c.run_name) == (64, 64, 5, "x")
    assert c.data.heldout_fraction == 0.0
    # SFT on a data file of yours: its own run name
    sft = compose_job("sft", ["data=file", f"data.dataset={tmp_path / 'qa.jsonl'}"])
    assert sft.cfg.run_name == "sft_qa" and sft.left_out == {"run_name": "sft_smollm2_alpaca"}


def test_lora_turned_on_takes_loras_learning_rate_and_agents_their_own_budgets(tmp_path):
    c = compose_job("grpo", ["model.lora.rank=8"])
    assert c.cfg.trainer.lr == LORA_LR and c.derived == {"trainer.lr": LORA_LR}
    assert compose_job("grpo", ["model.lora.rank=8", "trainer.lr=3e-5"]).cfg.trainer.lr == 3e-5
    assert compose_job("grpo_lora", []).cfg.trainer.lr == 1e-4 and compose_job("grpo", []).cfg.trainer.lr == 5e-6
    agent = compose_job("grpo", ["rollout.agent=examples.agents.react_math:run"]).cfg.rollout
    assert (agent.max_tokens, agent.eval_max_tokens, agent.max_tokens_per_turn) == (4096, 4096, 1024)
    agent = compose_job("grpo_tools", ["rollout.environment=single_turn", "rollout.agent_command=python a.py",
                                       "rollout.agent_max_tokens=192", "rollout.agent_max_tokens_per_turn=96"]).cfg
    assert (agent.rollout.max_tokens, agent.rollout.max_tokens_per_turn) == (192, 96)
    with pytest.raises(ConfigError, match="rollout.max_tokens=256 is set, but algorithm.name=grpo reads it only without "
                                          "an agent"):
        compose_job("grpo", ["rollout.agent=examples.agents.react_math:run", "rollout.max_tokens=256"])


# ------------------------------------------------------------------ settings the job does not read

@pytest.mark.parametrize("job,given,says", [
    ("sft", "rollout.temperature=1.0", "rollout.temperature=1.0 is set, but algorithm.name=sft does not read it"),
    ("grpo", "trainer.global_batch_size=64", "trainer.global_batch_size=64 is set, but algorithm.name=grpo does not"),
    ("dpo", "algorithm.simpo_gamma=1.0", "algorithm.simpo_gamma=1.0 is set, but algorithm.name=dpo reads it only with "
                                         "algorithm.loss_type=simpo"),
    ("grpo", "algorithm.max_sampling_rounds=5", "reads it only with algorithm.dynamic_sampling=true"),
    ("grpo", "model.lora.alpha=32", "reads it only with model.lora.rank > 0"),
    ("grpo", "trainer.critic_lr=1e-5", "is read by ppo"),
])
def test_a_setting_the_job_does_not_read_is_refused_when_you_set_it(job, given, says):
    with pytest.raises(ConfigError) as info:
        compose_job(job, [given])
    assert says in str(info.value) and "it would change nothing; remove it" in str(info.value), str(info.value)


@pytest.mark.parametrize("job,given,says", [
    ("grpo", "algorithm.loss_type=ipo", "algorithm.loss_type=ipo is set, but algorithm.name=grpo has no such setting "
                                        "(it belongs to online_dpo, dpo): remove it"),
    ("dpo", "algorithm.kl_coef=0.1", "algorithm.kl_coef=0.1 is set, but algorithm.name=dpo has no such setting (it "
                                     "belongs to grpo, ppo, distill): remove it"),
    ("rft", "algorithm.kl_coef=0.04", "algorithm.kl_coef=0.04 is set, but algorithm.name=rft has no such setting"),
    ("sft", "algorithm.beta=0.2", "algorithm.beta=0.2 is set, but algorithm.name=sft has no such setting (it belongs "
                                  "to online_dpo, dpo)"),
    ("dpo", "algorithm.betta=0.2", "algorithm.betta: algorithm.name=dpo has no such key; did you mean algorithm.beta?"),
    ("grpo", "algorithm.name=sgd", "algorithm.name='sgd': valid values are grpo, ppo, rft, online_dpo, distill, sft, rm"),
])
def test_a_key_of_another_algorithms_section_is_no_key_of_this_one(job, given, says):
    """Each algorithm's section has its own keys only (alignment/algorithms/config.py): another's is refused when
    you set it, naming whose it is; one a shipped file set for another algorithm is left out, and listed."""
    with pytest.raises(ConfigError) as info:
        compose_job(job, [given])
    assert says in str(info.value), str(info.value)
    comp = compose_job("grpo", ["algorithm.name=rft"])  # grpo.yaml's GRPO settings, left out
    assert type(job_config(comp.cfg).algorithm) is RFTConfig and "clip_ratio" not in comp.cfg.algorithm
    assert comp.dropped == {"algorithm.advantage_estimator": "grpo", "algorithm.clip_ratio": 0.2,
                            "algorithm.kl_coef": 0.04, "algorithm.kl_estimator": "k3",
                            "algorithm.loss_agg_mode": "token-mean"}


def test_what_the_shipped_files_set_stays_quiet_and_every_rule_names_real_keys():
    keys = schema_keys(JobConfig)
    for algorithm in registry.ALGORITHMS.values():
        keys.update(job_keys(algorithm.config))
    assert all(r.key in keys for r in RULES), [r.key for r in RULES if r.key not in keys]
    for job in ("grpo", "ppo", "dpo", "sft", "rm", "prm", "rft", "online_dpo", "distill", "grpo_tools", "grpo_humaneval",
                "recipes/grpo-qwen3-30b-a3b-gsm8k-4n8g"):
        comp = compose_job(job, [])
        assert comp.user_keys == set()
        assert unread_keys(comp.cfg, keys)  # every job has settings it does not read: quiet, as shipped
    dpo = compose_job("dpo", []).cfg
    assert set(unread_keys(dpo, ["algorithm.beta", "rollout", "data.dataset"])) == {"rollout"}
    assert "kl_coef" not in dpo.algorithm  # another algorithm's key: not in DPO's section at all


def test_print_config_checks_and_marks_what_the_job_does_not_read(capsys):
    assert cli.main(["train", "--config-name", "dpo", "--print-config"]) == 0
    text = capsys.readouterr().out
    cfg = yaml.safe_load(text)
    assert cfg["algorithm"]["name"] == "dpo" and cfg["trainer"]["lr"] == 2e-6
    lines = {line.split(":")[0].strip(): line for line in text.splitlines() if ":" in line}
    assert "kl_coef" not in lines  # not DPO's: not in its section
    assert "# not read" not in lines["beta"] and "# not read" in lines["rollout"]
    assert cli.main(["train", "--print-config", "trainer.micro_batch_size=5"]) == 2  # checked: 64 samples a rank
    assert "trainer.micro_batch_size=5 must divide" in capsys.readouterr().err


# ------------------------------------------------------------------ the dry run tells the truth

def test_dry_run_prints_what_the_job_takes_and_from_where(tmp_path, capsys, monkeypatch):
    """A GRPO job on a prompt file, scored by a reward module in the working directory (importable as with
    ``python -m``): the demo values it did not take, the derived ones, what the shipped job set, the data,
    the rewards with their conventions and the reference they read, the steps, the lengths, resume, memory."""
    path = _prompts(tmp_path)
    (tmp_path / "my_scores.py").write_text(textwrap.dedent("""\
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return float(ground_truth in solution_str)
        """))
    monkeypatch.chdir(tmp_path)
    out_dir = tmp_path / "out"
    assert cli.main(["train", "--nproc", "2", "--dry-run", f"data.train_files={path}", f"output_dir={out_dir}",
                     "reward.functions=[{name: 'my_scores:compute_score'}]"]) == 0
    lines = capsys.readouterr().out.splitlines()
    text = "\n".join(lines)
    assert lines[0] == ("your own data, so not the demo's values (set them to keep them): run_name=grpo_smollm2_arithmetic"
                        " -> grpo_my_prompts, rollout.max_tokens=48 -> 1024, rollout.eval_max_tokens=48 -> 1024, "
                        "rollout.max_model_len=512 -> null, trainer.steps=12 -> 0")
    assert lines[1] == ("derived: run_name=grpo_my_prompts (from the algorithm and the data), data.heldout_fraction=0.05"
                        " (of your prompts held out by prompt hash; 0 trains on all)")
    assert lines[2] == ("from the job's files (configs/grpo.yaml and the shipped files it builds on): trainer.lr=5e-06, "
                        "trainer.use_distributed_optimizer=True")  # data.task and the rest are not read with files
    data = next(line for line in lines if line.startswith("data: "))
    train, held = (int(x) for x in data.split("; ")[2].replace(" training prompts, ", " ").split(" held out")[0].split())
    assert data.startswith(f"data: 40 records from {path}; dropped 0 duplicate") and train + held == 40 and held > 0
    assert f"steps: {train // 8} (trainer.steps=0: 1 epoch(s) of {train} prompts, rollout.prompts_per_step=8)" in lines
    assert ("rewards: my_scores:compute_score x 1 (my_scores:compute_score, verl's compute_score (data_source, "
            "solution_str, ground_truth = the reference answer, extra_info))") in lines
    assert "reference answer: column answer" in lines
    length = next(line for line in lines if line.startswith("lengths: "))
    cfg = job_config(compose_job("grpo", [f"data.train_files={path}", *OWN]).cfg)
    from launchers.common import check_job

    _, _, _, prompts = check_job(cfg, 2)
    assert length == (f"lengths: rollout.max_tokens=1024, eval_max_tokens=1024, max_model_len={prompts.longest + 1024} "
                      f"(the longest prompt: {prompts.longest} tokens; the model's positions: 8192)")
    assert cfg.rollout.max_model_len == prompts.longest + 1024
    assert f"fresh start (no checkpoint in {out_dir / 'checkpoints'})" in lines
    assert any(line.startswith("memory: ") and "GiB per process" in line for line in lines), text
    assert lines[-1].startswith("ok: grpo (grpo), 2 process(es)") and not out_dir.exists()


def test_a_revision_applies_to_a_hub_id_only():
    with pytest.raises(ConfigError, match=r"model.revision=v2 is set, but algorithm.name=grpo reads it only with "
                                          r"model.path a Hub id \(org/name\)"):
        compose_job("grpo", ["model.revision=v2"])
    assert compose_job("grpo", ["model.path=Acme/Tiny", "model.revision=v2"]).cfg.model.revision == "v2"
