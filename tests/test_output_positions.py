"""The output layer on selected positions (alignment.training.output_positions): index
bookkeeping by hand, and the layer sees only the selected rows. Gradient parity through Megatron
at DP/TP/SP/PP/CP/Ulysses and packing: test_grpo_invariance.py, test_context_parallel.py."""

from __future__ import annotations

import torch

from alignment.training.output_positions import OutputPositions, output_on


def test_positions_are_sequence_major_and_put_inverts_take():
    mask = torch.tensor([[0, 1, 1, 0],
                         [1, 0, 0, 1]])  # [b=2, s=4]
    sel = OutputPositions.from_mask(mask)
    # Megatron's hidden states are [s, b, h]: flat index = s * b + row
    assert sel.index.tolist() == [1, 2, 4, 7]
    values = torch.arange(8.0).view(2, 4) * 10  # row 0: 0 10 20 30; row 1: 40 50 60 70
    assert sel.take(values).tolist() == [[40.0, 10.0, 20.0, 70.0]]
    back = sel.put(sel.take(values))
    assert torch.equal(back, values * mask)
    with_dim = sel.put(torch.ones(1, 4, 3))  # trailing dims (e.g. vocabulary) follow
    assert with_dim.shape == (2, 4, 3) and torch.equal(with_dim[..., 0], mask.float())


def test_empty_mask_keeps_one_position():
    sel = OutputPositions.from_mask(torch.zeros(2, 3))
    assert sel.index.tolist() == [0]


class _Toy(torch.nn.Module):
    """Calls ``output_layer`` on ``[s, b, h]`` hidden states and transposes, as GPTModel does."""

    def __init__(self):
        super().__init__()
        self.output_layer = torch.nn.Linear(4, 6)

    def forward(self, hidden):
        return self.output_layer(hidden).transpose(0, 1)


class _Wrapper(torch.nn.Module):  # like Megatron's DDP: the model under .module
    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


def test_output_on_runs_the_layer_on_selected_rows_only_and_matches_full_outputs():
    torch.manual_seed(0)
    model = _Wrapper(_Toy())
    hidden = torch.randn(5, 2, 4, requires_grad=True)  # [s, b, h]
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]])
    seen = []
    model.module.output_layer.register_forward_hook(lambda m, args, out: seen.append(args[0].shape))
    full = model(hidden)  # [b, s, 6]
    sel = OutputPositions.from_mask(mask)
    with output_on(model, sel):
        part = model(hidden)
    assert seen == [(5, 2, 4), (5, 1, 4)]  # full, then the 5 selected positions as [n, 1, h]
    assert part.shape == (1, 5, 6)
    placed = sel.put(part)
    assert torch.allclose(placed[mask.bool()], full[mask.bool()])
    after = model(hidden)  # the hook is gone after the block
    assert seen[-1] == (5, 2, 4) and torch.equal(after, full)
    # gradients reach only the selected hidden states
    placed.sum().backward()
    touched = hidden.grad.abs().sum(-1).transpose(0, 1) > 0  # [b, s]
    assert torch.equal(touched, mask.bool())
