"""Megatron DDP's gradient accumulation on CPU in pieces (parallel/cpu_compat.accumulate_grads_in_chunks): the same
bits as its whole-tensor ``main_grad.add_(grad)``, with no whole-size fp32 temporary."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from parallel import cpu_compat


@pytest.mark.parametrize("chunk", [7, 64, 1 << 17])
def test_accumulate_in_chunks_gives_the_bits_of_add(chunk):
    gen = torch.Generator().manual_seed(0)
    main = torch.randn(300, 7, generator=gen)
    grad = (torch.randn(300, 7, generator=gen) * 1e-3).bfloat16()
    expected = main.clone().add_(grad)
    cpu_compat.accumulate_in_chunks(main, grad, chunk)
    assert torch.equal(main, expected)


def _hooked(param):
    """Megatron's backward hook for ``param`` (patched), on a stand-in DDP holding only what the hook reads."""
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel

    cpu_compat.accumulate_grads_in_chunks()
    cpu_compat.accumulate_grads_in_chunks()  # idempotent: one wrapper, not two
    ddp = SimpleNamespace(param_to_bucket_group={param: None}, ddp_config=SimpleNamespace(overlap_grad_reduce=False),
                          force_all_reduce=False)
    return DistributedDataParallel._make_backward_post_hook(ddp, param)


def test_ddp_hook_accumulates_bf16_micro_batches_in_pieces(monkeypatch):
    monkeypatch.setattr(cpu_compat, "ACCUMULATE_CHUNK", 64)  # 2,100 elements: 33 pieces
    calls = []
    chunks = cpu_compat.accumulate_in_chunks
    monkeypatch.setattr(cpu_compat, "accumulate_in_chunks", lambda *a: (calls.append(a[2]), chunks(*a)))
    gen = torch.Generator().manual_seed(1)
    param = torch.nn.Parameter(torch.randn(300, 7, generator=gen).bfloat16())
    param.main_grad, param.grad_added_to_main_grad = torch.zeros(300, 7), False
    hook = _hooked(param)
    grads = [torch.randn(300, 7, generator=gen).bfloat16() for _ in range(3)]
    expected = torch.zeros(300, 7)
    for g in grads:  # three micro-batches, as Megatron's own add_ accumulates them
        expected.add_(g)
        param.grad = g.clone()
        hook()
        assert param.grad is None and param.grad_added_to_main_grad is False  # dropped, flag untouched
    assert torch.equal(param.main_grad, expected)
    assert param.main_grad.abs().sum() > 0 and calls == [64] * 3  # in pieces, not Megatron's whole add_


def test_ddp_hook_leaves_fp32_and_fused_gradients_to_megatron():
    param = torch.nn.Parameter(torch.randn(4, 3))
    param.main_grad, param.grad_added_to_main_grad = torch.zeros(4, 3), False
    hook = _hooked(param)
    g = torch.randn(4, 3)
    param.grad = g.clone()
    hook()  # fp32: Megatron's own add_
    assert torch.equal(param.main_grad, g) and param.grad is None
    # a bf16 gradient already accumulated by a fused weight-gradient GEMM is not added again
    fused = torch.nn.Parameter(torch.randn(4, 3).bfloat16())
    fused.main_grad, fused.grad_added_to_main_grad = g.clone(), True
    hook = _hooked(fused)
    fused.grad = torch.ones(4, 3).bfloat16()
    hook()
    assert torch.equal(fused.main_grad, g) and fused.grad is None and fused.grad_added_to_main_grad is True
    # ... unless it is a shared embedding's (zero_out_wgrad): then Megatron adds it, and so do the chunks, once
    fused.zero_out_wgrad = True
    fused.grad = torch.ones(4, 3).bfloat16()
    hook()
    assert torch.equal(fused.main_grad, g + 1) and fused.grad is None
