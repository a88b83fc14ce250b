"""SFT, reward-model, DPO and process-reward-model (step-level BCE) gradients through Megatron equal single-process autograd on
the HF model, for any micro-batch split and layout (packed sequences and context
parallelism, ring and Ulysses, included); the reward model's scores equal HF
``LlamaForSequenceClassification``'s."""

from __future__ import annotations

import pytest

from tests.dist.offline_invariance_worker import CASES

pytestmark = pytest.mark.slow  # launches processes: the full suite only (CONTRIBUTING.md, test tiers)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import json

    from tests.conftest import run_torchrun

    path = tmp_path_factory.mktemp("offline") / "r.json"
    run_torchrun("offline_invariance_worker.py", str(path))
    return json.loads(path.read_text())


@pytest.mark.parametrize("kind", ["sft", "rm", "dpo", "prm"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gradients_equal_single_process(results, kind, case):
    r = results[kind]
    assert r["reference_max_grad"] > 1e-3
    assert abs(r[case]["loss"] - r["reference_loss"]) <= 1e-5 * max(1.0, abs(r["reference_loss"])), r[case]
    assert r[case]["max_grad_diff"] <= 1e-5 * r["reference_max_grad"] + 1e-7, r[case]


@pytest.mark.parametrize("case", sorted(CASES))
def test_reward_scores_equal_hf_sequence_classifier(results, case):
    assert results["hf_score_std"] > 0.05  # scores differ between sequences
    assert results["rm"][case]["max_score_diff"] <= 2e-5, results["rm"][case]
