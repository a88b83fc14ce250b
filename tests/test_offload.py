"""Offload of idle models (alignment/training/offload.py): the unit rules in one process, and
bitwise-identical training with offload between every phase under torchrun (Megatron DDP,
distributed optimizer, TP=2)."""

from __future__ import annotations

import pytest
import torch

from alignment.training.offload import DevicePlacement, offload_enabled, trainable


def _model_and_adam():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def _step(model, opt):
    opt.zero_grad()
    model(torch.ones(5, 3)).pow(2).sum().backward()
    opt.step()


def test_disabled_placement_is_a_no_op():
    model, opt = _model_and_adam()
    place = DevicePlacement(enabled=False)
    place.add_model("policy", model, opt)
    place.keep()  # would offload everything if enabled
    assert all(p.untyped_storage().nbytes() == 4 * p.numel() for p in model.parameters())
    assert place.units == {} and place.pop_stats() == {}


def test_offload_frees_storage_and_reload_restores_values():
    model, opt = _model_and_adam()
    _step(model, opt)  # Adam state exists now
    before = [p.detach().clone() for p in model.parameters()]
    moments = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    place = DevicePlacement(enabled=True, pin_memory=False)
    place.add_model("policy", model, opt)
    # 4*3 + 4 + 2*4 + 2 = 26 parameters: 104 bytes of weights; Adam: 2 x 104 bytes of moments + 4 step counters
    assert place.resident_bytes() == {"policy": 104, "policy.optimizer": 2 * 104 + 4 * 4}
    place.keep()
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert all(opt.state[p]["exp_avg"].untyped_storage().nbytes() == 0 for p in model.parameters())
    assert place.resident_bytes() == {"policy": 0, "policy.optimizer": 0}
    place.keep("policy")  # weights back, optimizer stays out
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert opt.state[next(model.parameters())]["exp_avg"].untyped_storage().nbytes() == 0
    place.keep(*trainable("policy"))  # ".grads" of a model without main_grad buffers is accepted
    assert all(torch.equal(opt.state[p]["exp_avg"], m) for p, m in zip(model.parameters(), moments))
    stats = place.pop_stats()
    assert stats["offload/gb_moved"] * 2**30 == 2 * (104 + 2 * 104 + 16)  # out and back, bytes
    assert place.pop_stats()["offload/gb_moved"] == 0.0


def test_training_with_offload_equals_training_without():
    runs = []
    for offload in (False, True):
        model, opt = _model_and_adam()
        place = DevicePlacement(enabled=offload, pin_memory=False)
        place.add_model("policy", model, opt)  # before the first step: Adam state is created later
        for _ in range(3):
            place.keep()
            place.keep(*trainable("policy"))
            _step(model, opt)
        runs.append([p.detach().clone() for p in model.parameters()])
        if offload:  # the lazily created Adam state was followed and offloaded too
            place.keep()
            assert all(opt.state[p]["exp_avg_sq"].untyped_storage().nbytes() == 0 for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_shared_storage_belongs_to_the_first_unit():
    model, opt = _model_and_adam()
    alias = torch.nn.Module()
    alias.w = torch.nn.Parameter(model[0].weight.detach().view(-1)[:5])  # a view of policy's storage
    place = DevicePlacement(enabled=True, pin_memory=False)
    place.add_model("policy", model)
    place.add_model("alias", alias)
    assert place.resident_bytes()["alias"] == 0
    place.keep("alias")  # offloads "policy", which owns the shared storage
    assert model[0].weight.untyped_storage().nbytes() == 0


def test_unknown_units_are_refused_and_absent_models_accepted():
    model, _ = _model_and_adam()
    place = DevicePlacement(enabled=True, pin_memory=False)
    place.add_model("policy", model)
    place.add_model("reference", None)  # kl_coef = 0: no reference model
    place.keep("reference", "policy.optimizer")  # accepted: absent model, frozen model's optimizer
    with pytest.raises(KeyError, match="polcy"):
        place.keep("polcy")
    with pytest.raises(ValueError, match="registered twice"):
        place.add_model("policy", model)


def test_a_lora_reference_keeps_the_policy_it_runs_resident():
    """A LoRA job's reference (FrozenBase) owns no weights: keeping it keeps the policy's."""
    from parallel.lora import FrozenBase, LoRAAdapter, LoRASpec

    model, opt = _model_and_adam()
    model[0].lora = LoRAAdapter("column", 3, 4, LoRASpec(rank=2), tp_size=1, tp_rank=0, stride=1,
                                init_a=torch.zeros(2, 3), dtype=torch.float32, device="cpu", sequence_parallel=False)
    other = torch.nn.Linear(3, 3)
    place = DevicePlacement(enabled=True, pin_memory=False)
    with pytest.raises(ValueError, match="register the model this FrozenBase runs first"):
        place.add_model("reference", FrozenBase(model))
    place.add_model("policy", model, opt)
    place.add_model("reference", FrozenBase(model))
    place.add_model("critic", other)
    place.keep("reference")
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
    assert all(p.untyped_storage().nbytes() == 0 for p in other.parameters())
    with pytest.raises(ValueError, match="registered twice"):
        place.add_model("reference", None)


def test_offload_enabled_only_where_it_saves_memory(monkeypatch):
    monkeypatch.delenv("MEGALIGN_OFFLOAD_ON_CPU", raising=False)
    assert offload_enabled(False) is False
    assert offload_enabled(True) is torch.cuda.is_available()
    monkeypatch.setenv("MEGALIGN_OFFLOAD_ON_CPU", "1")
    assert offload_enabled(True) is True


@pytest.mark.slow
def test_megatron_training_with_offload_is_bitwise_identical(torchrun_json):
    r = torchrun_json("offload_worker.py", timeout=600)
    for name, c in r.items():
        assert c["equal"] and c["trained"], (name, c)  # same logprobs, losses, grad norms and weights
        assert c["freed"] and c["offloaded_bytes"] == 0, (name, c)  # rollout phase: nothing resident
        assert c["reference_bytes"] == 0, (name, c)  # the reference is out while the policy trains
        assert c["moved_gb"] > 0, (name, c)
    for name in ("dp2", "tp2"):  # fp32: weights and fp32 grads 4 bytes per parameter
        c = r[name]
        assert c["policy_bytes"] == 4 * c["params"] == c["policy_grads_bytes"], (name, c)
        # Adam's two moments (the main parameters ARE the fp32 weights) + step counters
        assert 0 <= c["policy_optimizer_bytes"] - 8 * c["params"] < 1024, (name, c)
    d = r["dp2_distributed_optimizer"]  # weights and grads padded in the buffer; moments sharded over DP=2
    assert 4 * d["params"] <= d["policy_bytes"] == d["policy_grads_bytes"] < 4 * d["params"] + 4096
    assert 0 <= d["policy_optimizer_bytes"] - d["policy_bytes"] < 1024, d
