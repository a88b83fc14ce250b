"""Your own advantage estimator or policy loss, by import path (verl's ``register_adv_est`` /
``register_policy_loss``, as config values): ``algorithm.advantage_estimator=my_pkg.advantages:median_baseline``,
``algorithm.policy_loss=my_pkg.losses:my_loss``. The module is imported from the job's working directory
(or anywhere on ``PYTHONPATH``), and each hook is called once on a small probe before any process group
starts, so a wrong signature or shape is one line naming the field, not a failure at step 1.

The contracts (the built-in ones keep them too):

- an **advantage estimator** is ``fn(rewards, group_size) -> advantages``: ``rewards`` ``[batch]`` float32,
  one scalar reward per response, ``batch`` a multiple of ``group_size``, each prompt's ``group_size``
  responses consecutive (the order of vLLM's ``SamplingParams(n=group_size)``); returns ``[batch]``
  float advantages, one per response, applied to every token of it
  (:func:`alignment.algorithms.advantages.grpo_advantages` is the model);
- a **policy loss** is ``fn(logprobs, old_logprobs, advantages, response_mask, clip_ratio_low, clip_ratio_high)
  -> (per_token_loss, is_clipped)``: ``logprobs`` / ``old_logprobs`` ``[batch, seq]`` (nats; the gradient
  flows through ``logprobs``), ``advantages`` ``[batch]`` or ``[batch, seq]``, ``response_mask`` ``[batch, seq]``
  (1 on response tokens), the two clip ratios (``algorithm.clip_ratio`` / ``clip_ratio_high``); returns the
  loss to minimise per token and where a clip took the gradient away, both ``[batch, seq]`` (the second bool).
  The job masks and aggregates them (``algorithm.loss_agg_mode``), and adds the KL and entropy terms
  (:func:`alignment.algorithms.policy_loss.ppo_policy_loss` is the model).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch

from alignment.schema import ConfigError

#: the rewards (2 groups of 3) an advantage estimator is called on before start
PROBE_REWARDS = (1.0, 0.0, 0.5, 2.0, 1.0, 1.0)


def is_import_path(value: str) -> bool:
    """Whether a config value names a function by import path (``module.path:function``)."""
    return ":" in str(value)


def load(path: str, field: str) -> Callable[..., Any]:
    """The function ``path`` (``module.path:function``) names.

    Raises:
        ConfigError: naming ``field``: a malformed path, a module that does not import (with its error),
            a missing or non-callable attribute."""
    module_name, _, attr = str(path).partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{field}={path}: give module.path:function, e.g. my_pkg.advantages:median_baseline")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # the user's module: any error it raises on import
        raise ConfigError(f"{field}={path}: module {module_name} does not import ({type(e).__name__}: {e}); it is "
                          "imported from the job's working directory or PYTHONPATH") from e
    fn: Callable[..., Any] | None = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{field}={path}: {module_name} has no function {attr}")
    return fn


def advantage_estimator(path: str, field: str = "algorithm.advantage_estimator") -> Callable[..., Any]:
    """The estimator ``path`` names, checked on a probe of 2 groups of 3 (module docstring's contract).

    Raises:
        ConfigError: naming ``field``: :func:`load`'s errors, an exception on the probe, or a result that is
            not a finite float ``[batch]`` tensor."""
    fn = load(path, field)
    rewards = torch.tensor(PROBE_REWARDS)
    contract = "fn(rewards [batch], group_size) -> advantages [batch]"
    try:
        out = fn(rewards.clone(), 3)
    except Exception as e:
        raise ConfigError(f"{field}={path}: failed on rewards [6], group_size=3 ({type(e).__name__}: {e}); the "
                          f"contract is {contract}") from e
    if not isinstance(out, torch.Tensor) or out.shape != rewards.shape or not out.is_floating_point() \
            or not torch.isfinite(out).all():
        got = f"shape {tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(f"{field}={path}: returned {got} for rewards [6], group_size=3; the contract is {contract}, "
                          "finite floats")
    return fn


def policy_loss(path: str, field: str = "algorithm.policy_loss") -> Callable[..., Any]:
    """The policy loss ``path`` names, checked on a probe of ``[2, 3]`` tokens (module docstring's contract): it
    returns ``(per_token_loss, is_clipped)`` of that shape, and its loss has a gradient through ``logprobs``.

    Raises:
        ConfigError: naming ``field``: :func:`load`'s errors, an exception on the probe, or a result off the
            contract."""
    fn = load(path, field)
    logprobs = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -1.2, -0.7]], requires_grad=True)
    old = torch.tensor([[-1.1, -0.5, -1.5], [-0.3, -1.0, -0.9]])
    contract = ("fn(logprobs, old_logprobs, advantages, response_mask, clip_ratio_low, clip_ratio_high) -> "
                "(per_token_loss, is_clipped), both [batch, seq]")
    try:
        out = fn(logprobs, old, torch.tensor([1.0, -1.0]), torch.ones(2, 3), 0.2, 0.2)
    except Exception as e:
        raise ConfigError(f"{field}={path}: failed on logprobs [2, 3] ({type(e).__name__}: {e}); the contract is "
                          f"{contract}") from e
    if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)
            and all(t.shape == logprobs.shape for t in out) and out[1].dtype == torch.bool):
        raise ConfigError(f"{field}={path}: returned {_describe(out)} for logprobs [2, 3]; the contract is {contract}, "
                          "the second bool")
    if not out[0].requires_grad:
        raise ConfigError(f"{field}={path}: its loss has no gradient through logprobs (detached?); the policy "
                          "would not train")
    return fn


def _describe(out: object) -> str:
    if isinstance(out, torch.Tensor):
        return f"a tensor of shape {tuple(out.shape)}"
    if isinstance(out, tuple):
        return "(" + ", ".join(f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                               for t in out) + ")"
    return type(out).__name__
