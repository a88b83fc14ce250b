"""Megatron GPTModel loaded from HF weights gives transformers' logits, for TP=1, TP=2
and PP=2 (tied and untied embeddings), and the HF export returns the HF tensors."""

from __future__ import annotations


def test_logits_match_transformers_for_tp_and_pp(torchrun_json):
    results = torchrun_json("parity_worker.py")
    assert set(results) == {"tp1", "tp2", "pp2", "tp1_tied", "tp2_tied", "pp2_tied"}
    for name, r in results.items():
        assert r["ref_logit_std"] > 0.5, name  # logits far from zero: the comparison has teeth
        assert r["max_abs_diff"] <= 1e-4, (name, r)
        assert r["export_max_abs_diff"] == 0.0, (name, r)
        assert r["export_missing"] == [], (name, r)
