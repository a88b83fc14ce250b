"""Advantage estimators and a policy loss for tests/test_algorithm_hooks.py's jobs, given by import path
(``algorithm.advantage_estimator=tests.recording_hooks:...``): each call's rewards and advantages (the loss: its
input's shape) are appended, one JSON line, to ``$MEGALIGN_HOOK_RECORD.<rank>``, for the test to check by hand."""

from __future__ import annotations

import json
import os

import torch

from examples.custom_algorithm.advantages import median_baseline
from examples.custom_algorithm.losses import unclipped_surrogate


def _write(record: dict) -> None:
    path = os.environ.get("MEGALIGN_HOOK_RECORD")
    if path:
        with open(f"{path}.{os.environ.get('RANK', '0')}", "a") as f:
            f.write(json.dumps(record) + "\n")


def _record(rewards: torch.Tensor, group_size: int, advantages: torch.Tensor) -> torch.Tensor:
    _write({"rewards": rewards.tolist(), "group_size": group_size, "advantages": advantages.tolist()})
    return advantages


def mean_baseline(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``r_i - mean(r_group)``, written out here: Dr. GRPO's ``grpo_no_std``, by hand."""
    grouped = rewards.reshape(-1, group_size)
    return _record(rewards, group_size, (grouped - grouped.sum(dim=1, keepdim=True) / group_size).reshape(-1))


def recorded_median_baseline(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """examples/custom_algorithm's :func:`median_baseline`, recorded."""
    return _record(rewards, group_size, median_baseline(rewards, group_size))


def recorded_unclipped_surrogate(logprobs, old_logprobs, advantages, response_mask, clip_ratio_low, clip_ratio_high):
    """examples/custom_algorithm's :func:`unclipped_surrogate`, its calls recorded (``logprobs``' shape)."""
    _write({"loss_input": list(logprobs.shape)})
    return unclipped_surrogate(logprobs, old_logprobs, advantages, response_mask, clip_ratio_low, clip_ratio_high)
