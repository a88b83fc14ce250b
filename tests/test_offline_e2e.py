"""Real SFT, reward-model and DPO jobs (Hydra config -> Megatron model -> steps over the
llamafactory demo data -> checkpoint -> HF export) on a tiny random Llama, 2 processes; the
reward model and DPO also on a tiny Qwen3-MoE with expert parallelism."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.conftest import Job, run_jobs, run_torchrun
from tests.dist.tiny_llama import save_tiny_hf_dir

pytestmark = pytest.mark.slow  # launches processes: the full suite only (CONTRIBUTING.md, test tiers)

COMMON = ["data.max_length=64", "data.max_prompt_length=32", "trainer.progress_bar=false", "trainer.lr=1e-3"]


def job(tmp_path, config, *overrides, out=None, model_dir=None, common_overrides=None):
    if model_dir is None:
        model_dir = tmp_path / "tiny"
        if not model_dir.exists():
            save_tiny_hf_dir(model_dir)
    out = out or tmp_path / config
    result = tmp_path / f"{config}.json"
    common = COMMON if common_overrides is None else common_overrides
    run_torchrun("offline_e2e_worker.py", config, str(model_dir), str(out), *common, *overrides, str(result),
                 timeout=900)
    return json.loads(result.read_text()), out


SIZES = ["data.train_size=8", "data.heldout_size=8", "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
         "trainer.epochs=3"]


@pytest.fixture(scope="module")
def first_runs(tmp_path_factory) -> dict:
    """SFT, the reward model and DPO, 3 epochs of the same 8 examples each, in one launch."""
    root = tmp_path_factory.mktemp("offline")
    model_dir = save_tiny_hf_dir(root / "tiny")
    jobs = {"sft": Job("sft", model_dir, root / "sft", [*COMMON, *SIZES]),
            "rm": Job("rm", model_dir, root / "rm", [*COMMON, *SIZES]),
            "dpo": Job("dpo", model_dir, root / "dpo", [*COMMON, *SIZES, "algorithm.beta=0.5"])}
    run_jobs(*jobs.values())
    return {name: (j.summary(), j.out, model_dir) for name, j in jobs.items()}


def test_sft_learns_checkpoints_resumes_and_exports(first_runs, tmp_path):
    s, out, model_dir = first_runs["sft"]
    losses = [h["loss"] for h in s["history"]]
    assert len(losses) == 3 and losses[0] > losses[1] > losses[2]  # same 8 examples each step
    assert s["heldout_before"]["loss"] > 8.0  # a random model: about ln(49152) = 10.8 nats
    assert (out / "checkpoints" / "step_3" / "metadata.json").exists()
    # the resolved config travels with the run and with every checkpoint
    import yaml

    saved = yaml.safe_load((out / "checkpoints" / "step_3" / "config.yaml").read_text())
    assert saved == yaml.safe_load((out / "config.yaml").read_text())
    assert saved["output_dir"] == str(out) and saved["trainer"]["epochs"] == 3 and saved["algorithm"]["name"] == "sft"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "hf")
    # A longer run in the same directory resumes at step 3 and continues the same schedule.
    s2, _ = job(tmp_path, "sft", *SIZES[:-1], "trainer.epochs=4", out=out, model_dir=model_dir)
    assert s2["start_step"] == 3 and len(s2["history"]) == 1
    assert s2["history"][0]["loss"] < losses[2]


def test_reward_model_trains_and_exports_a_sequence_classifier(first_runs):
    s, out, _ = first_runs["rm"]
    losses = [h["loss"] for h in s["history"]]
    assert losses[0] > losses[1] > losses[2]
    # The HF export is a LlamaForSequenceClassification whose own pooled scores give the
    # same held-out accuracy and margin as the Megatron evaluation.
    check_export_scores(out, s["heldout_after"])


def check_export_scores(out, after: dict, pairs: int = 8) -> None:
    """The exported reward model, scored by transformers' own sequence-classifier pooling on the
    held-out pairs, has the held-out accuracy and mean margin the Megatron evaluation reported."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from alignment.data.chat_data import encode_example, load_preference_pairs

    hf = AutoModelForSequenceClassification.from_pretrained(out / "hf").eval()
    tok = AutoTokenizer.from_pretrained(out / "hf")
    correct, margins = 0, []
    for p in load_preference_pairs("heldout", pairs):
        scores = []
        for resp in (p.chosen, p.rejected):
            ids, _ = encode_example(tok, p.messages, resp, 64, 32)
            with torch.no_grad():
                scores.append(hf(torch.tensor([ids])).logits[0, 0].item())
        correct += scores[0] > scores[1]
        margins.append(scores[0] - scores[1])
    assert abs(after["accuracy"] - correct / pairs) < 1e-9
    assert abs(after["margin"] - sum(margins) / pairs) < 1e-4


def test_dpo_starts_at_log2_and_learns(first_runs):
    s, _, _ = first_runs["dpo"]
    # policy == reference before training: every implicit reward is 0, the loss is log 2
    assert abs(s["heldout_before"]["loss"] - math.log(2)) < 1e-6
    assert s["heldout_before"]["margin"] == 0.0 and s["heldout_before"]["accuracy"] == 0.0
    losses = [h["loss"] for h in s["history"]]
    assert abs(losses[0] - math.log(2)) < 1e-6 and losses[0] > losses[1] > losses[2]
    assert s["history"][2]["accuracy"] == 1.0  # the 8 training pairs are separated


@pytest.mark.heavy(cheap="tests/test_offline_e2e.py::test_dpo_starts_at_log2_and_learns")
def test_reference_free_variants_run(tmp_path):
    """SimPO, ORPO, IPO and KTO learn (2 processes, DP=2); ORPO reports its token-level NLL, and
    KTO's reference point from mismatched pairs is 0 while the policy equals the reference
    (before training, first step; the value by hand is in test_losses.py)."""
    model_dir = save_tiny_hf_dir(tmp_path / "tiny")
    loss_types = ("simpo", "orpo", "ipo", "kto")
    summaries = run_jobs(*(Job("dpo", model_dir, tmp_path / f"dpo_{loss_type}",
                               [*COMMON, "data.train_size=4", "data.heldout_size=4", "trainer.global_batch_size=4",
                                "trainer.micro_batch_size=2", "trainer.epochs=2", f"algorithm.loss_type={loss_type}",
                                "trainer.save_checkpoint=false", "trainer.export_hf=false"]) for loss_type in loss_types))
    for loss_type, s in zip(loss_types, summaries):
        losses = [h["loss"] for h in s["history"]]
        assert losses[1] < losses[0], (loss_type, losses)
        if loss_type == "orpo":
            assert 0 < s["history"][0]["nll"] < losses[0]
        if loss_type == "kto":
            assert 0.0 <= s["heldout_before"]["kl"] < 1e-6 and 0.0 <= s["history"][0]["kl"] < 1e-6
            assert s["history"][1]["kl"] >= 0.0 and s["heldout_after"]["kl"] >= 0.0


@pytest.mark.heavy(cheap="tests/test_offline_e2e.py::test_sft_learns_checkpoints_resumes_and_exports")
def test_balanced_global_batch_trains_the_same_model(tmp_path):
    """trainer.balance_batch deals each global batch over the 2 DP ranks by token count: the
    token-mean loss over the global batch does not depend on who holds which example, so the
    losses equal the contiguous split's, while the ranks' token counts even out."""
    model_dir = save_tiny_hf_dir(tmp_path / "tiny")
    balances = ("false", "true")
    summaries = run_jobs(*(Job("sft", model_dir, tmp_path / f"b_{balance}", [
        *COMMON, "data.train_size=16", "data.heldout_size=8", "trainer.global_batch_size=8",
        "trainer.micro_batch_size=2", "trainer.steps=2", "trainer.save_checkpoint=false", "trainer.export_hf=false",
        "data.max_length=256", "data.max_prompt_length=128", f"trainer.balance_batch={balance}"])
        for balance in balances))  # one launch
    runs = {balance: s["history"] for balance, s in zip(balances, summaries)}
    for plain, balanced in zip(runs["false"], runs["true"]):
        assert abs(plain["loss"] - balanced["loss"]) <= 1e-5 * abs(plain["loss"])
        assert balanced["dp_token_imbalance"] <= plain["dp_token_imbalance"]
    plain, balanced = ([h["dp_token_imbalance"] for h in runs[b]] for b in ("false", "true"))
    print("DP token imbalance (max rank / mean), contiguous vs balanced:", plain, balanced)
    assert max(balanced) < max(plain)  # measured: 1.248, 1.116 contiguous -> 1.008, 1.097 balanced


@pytest.mark.heavy(cheap="tests/test_families.py::test_two_rank_layouts_and_gradients")
def test_qwen3_moe_reward_model_and_dpo_with_expert_parallelism(tmp_path):
    """The offline jobs on a tiny random Qwen3-MoE, experts over both ranks (EP=2): the reward
    model learns and exports a ``Qwen3MoeForSequenceClassification`` whose own pooling reproduces
    the held-out accuracy and margin; DPO starts at exactly log 2 and learns."""
    from tests.dist.tiny_models import save_tiny_dir

    model_dir = save_tiny_dir(tmp_path / "moe", "qwen3_moe")
    common = ["data.train_size=8", "data.heldout_size=8", "trainer.global_batch_size=8", "trainer.micro_batch_size=2",
              "trainer.epochs=3", "parallel.expert_model_parallel_size=2"]
    out = tmp_path / "rm"
    s, dpo = run_jobs(Job("rm", model_dir, out, [*COMMON, *common]),  # one launch
                      Job("dpo", model_dir, tmp_path / "dpo", [*COMMON, *common, "algorithm.beta=0.5",
                                                               "trainer.export_hf=false"]))
    losses = [h["loss"] for h in s["history"]]
    assert losses[0] > losses[1] > losses[2], losses
    assert all(h["moe/load_imbalance"] >= 1.0 for h in s["history"])  # routing statistics logged per step
    exported = json.loads((out / "hf" / "config.json").read_text())
    assert exported["architectures"] == ["Qwen3MoeForSequenceClassification"]
    check_export_scores(out, s["heldout_after"])
    losses = [h["loss"] for h in dpo["history"]]
    assert abs(losses[0] - math.log(2)) < 1e-6 and losses[0] > losses[1] > losses[2], losses


@pytest.mark.heavy(cheap="tests/test_resume.py::test_resumed_training_equals_uninterrupted_and_nan_updates_are_skipped")
def test_diverging_run_skips_nan_updates_then_stops_with_a_checkpoint(tmp_path):
    """lr 1e30: the first update sends the weights to ~1e30, every later forward overflows, every later
    gradient is NaN; those updates are skipped (Adam untouched) and after trainer.max_bad_steps=2
    consecutive bad steps the run stops with a message naming the steps, the checkpoint and the fixes;
    trainer.warn_on prints warnings, trainer.stop_on stops a run at the step that crosses its bound."""
    model_dir = tmp_path / "tiny"
    save_tiny_hf_dir(model_dir)
    out, result = tmp_path / "sft", tmp_path / "sft.json"
    log = run_torchrun("offline_e2e_worker.py", "sft", str(model_dir), str(out), *COMMON[:-1], "trainer.lr=1e30",
                       "data.train_size=8", "data.heldout_size=8", "trainer.global_batch_size=4",
                       "trainer.micro_batch_size=2", "trainer.epochs=3", "trainer.max_bad_steps=2",
                       "trainer.eval_before=false", "trainer.warn_on=[{metric: loss, below: 100}]", str(result),
                       timeout=900, expect_failure=True)
    assert "steps 2-3: 2 consecutive steps had NaN/inf gradients and their updates were skipped" in log, log[-3000:]
    assert "warning: step 1: loss = " in log and "is below 100 (trainer.warn_on)" in log  # NaN at 2, 3 too
    assert "Lower trainer.lr" in log and not result.exists()
    ckpt = out / "checkpoints" / "step_3"
    assert (ckpt / "metadata.json").exists() and str(ckpt) in log
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(out / "tensorboard"))
    ea.Reload()
    skipped = [e.value for e in ea.Scalars("train/health/skipped_updates")]
    assert skipped == [0.0, 1.0, 1.0]  # step 1 applied, steps 2 and 3 skipped

    # trainer.stop_on: a bound crossed at step 1 stops the run there, with its checkpoint
    out = tmp_path / "sft_stop"
    log = run_torchrun("offline_e2e_worker.py", "sft", str(model_dir), str(out), *COMMON, "data.train_size=8",
                       "data.heldout_size=8", "trainer.global_batch_size=4", "trainer.micro_batch_size=2",
                       "trainer.eval_before=false", "trainer.stop_on=[{metric: loss, below: 100}]", str(result),
                       timeout=900, expect_failure=True)
    assert "TrainingStopped: step 1: loss = " in log and "is below 100 (trainer.stop_on), so the run stopped" in log
    assert (out / "checkpoints" / "step_1" / "metadata.json").exists() and not (out / "checkpoints" / "step_2").exists()


# heavy: one more launch pair; resume at another layout runs in tests/test_resume.py
@pytest.mark.heavy(cheap="tests/test_resume.py::test_resumed_training_equals_uninterrupted_and_nan_updates_are_skipped")
def test_a_checkpoint_rewritten_for_any_layout_resumes_at_tp2(tmp_path):
    """The distributed optimizer's checkpoint of an SFT run at DP 2, rewritten once at that layout
    (``trainer.reshard_checkpoint=true``: Megatron's fully_reshardable format, nothing trained),
    resumes at TP 2 with its Adam state, step and data position: steps 3 and 4 have the losses of
    the run that never changed layout, within fp32 reduction-order noise (step 4's depends on the
    Adam moments; PP 2 is resumed in test_resume.py). Without the rewrite, the launch at another
    layout is refused before start, naming the sizes and the fix."""
    from hydra import compose, initialize_config_dir
    from transformers import AutoConfig

    from alignment.config import register
    from alignment.schema import ConfigError
    from launchers.input_checks import check_resume
    from tests.conftest import ROOT

    model_dir = save_tiny_hf_dir(tmp_path / "tiny")
    base = [*COMMON, *SIZES[:-1], "trainer.epochs=4", "trainer.use_distributed_optimizer=true", "trainer.save_every=2"]
    reference = Job("sft", model_dir, tmp_path / "straight", base)
    layouts = {"tp2": "parallel.tensor_model_parallel_size=2"}
    jobs = [reference]
    for name, layout in layouts.items():
        out = tmp_path / name
        jobs += [Job("sft", model_dir, out, [*base, "trainer.steps=2"], result=tmp_path / f"{name}_first.json"),
                 Job("sft", model_dir, out, [*base, "trainer.reshard_checkpoint=true"],
                     result=tmp_path / f"{name}_rewrite.json"),
                 Job("sft", model_dir, out, [*base, layout], result=tmp_path / f"{name}_resumed.json")]
    summaries = run_jobs(*jobs)
    straight = [h["loss"] for h in summaries[0]["history"]]
    assert len(straight) == 4 and straight[3] < straight[2] < straight[1]
    for i, name in enumerate(layouts):
        first, rewrite, resumed = summaries[1 + 3 * i : 4 + 3 * i]
        assert [h["loss"] for h in first["history"]] == straight[:2]  # the same run up to the checkpoint
        assert rewrite == {"resharded": str(tmp_path / name / "checkpoints" / "step_2"), "step": 2}
        assert resumed["start_step"] == 2 and len(resumed["history"]) == 2
        assert [h["loss"] for h in resumed["history"]] == pytest.approx(straight[2:], rel=1e-5), name

    # the TP 2 run's last checkpoint (the usual format, at TP 2) at TP 1: refused, the fix named
    register()
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = compose("sft", overrides=[f"model.path={model_dir}", f"output_dir={tmp_path / 'tp2'}", *base])
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=2 \(now 1\).*trainer.reshard_checkpoint=true"):
        check_resume(cfg, AutoConfig.from_pretrained(model_dir))
