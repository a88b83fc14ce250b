"""parallel.vocab_logprobs against torch's log_softmax in float64: values, entropy and gradient,
for fp32 and bf16 logits, a temperature, Megatron's vocabulary padding and chunks that do not
divide the tokens. (Tensor-parallel slices: tests/dist/grpo_invariance_worker.py and the
parity workers run it at TP=2 against the single-process model.)"""

import pytest
import torch

from parallel.vocab_logprobs import chunk_tokens, default_chunk, vocab_parallel_logprobs


def _reference(logits, target, vocab, temperature):
    x = logits[..., :vocab].double() / temperature
    logp = torch.log_softmax(x, -1)
    lp = logp.gather(-1, target[..., None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return lp, entropy


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-5)])
@pytest.mark.parametrize("chunk", [3, 1000])
def test_matches_log_softmax(dtype, tol, chunk):
    torch.manual_seed(0)
    vocab, padded = 50, 64  # Megatron pads the vocabulary: columns 50..63 must not count
    logits = (torch.randn(2, 7, padded) * 3).to(dtype)
    logits[..., vocab:] = 100.0  # would dominate the softmax if it were not left out
    target = torch.randint(0, vocab, (2, 7))
    logits.requires_grad_(True)
    lp, ent = vocab_parallel_logprobs(logits, target, vocab, temperature=0.7, chunk=chunk)
    assert lp.dtype == torch.float32 and lp.shape == (2, 7) and not ent.requires_grad
    ref_in = logits.detach().double().requires_grad_(True)
    ref_lp, ref_ent = _reference(ref_in, target, vocab, 0.7)
    # the same bf16 values upcast: the math in fp32 matches float64 closely
    torch.testing.assert_close(lp.double(), ref_lp, atol=tol, rtol=tol)
    torch.testing.assert_close(ent.double(), ref_ent, atol=tol, rtol=tol)
    w = torch.randn(2, 7)
    (lp * w).sum().backward()
    (ref_lp * w).sum().backward()
    assert logits.grad.dtype == dtype
    assert torch.all(logits.grad[..., vocab:] == 0)
    gtol = 1e-6 if dtype == torch.float32 else 1e-2  # the gradient is rounded to bf16
    torch.testing.assert_close(logits.grad.double(), ref_in.grad, atol=gtol, rtol=gtol)


def test_gradient_sums_to_zero_and_one_hot_sign():
    """d logprob_t / d logits = (onehot(t) - softmax) / T: sums to 0 over the vocabulary, positive
    only at the target."""
    logits = torch.randn(1, 4, 10, requires_grad=True)
    target = torch.tensor([[1, 2, 3, 4]])
    lp, _ = vocab_parallel_logprobs(logits, target, 10, temperature=2.0, chunk=2)
    lp.sum().backward()
    g = logits.grad[0]
    torch.testing.assert_close(g.sum(-1), torch.zeros(4), atol=1e-7, rtol=0)
    assert torch.all((g > 0) == torch.nn.functional.one_hot(target[0], 10).bool())


def test_bad_input():
    logits = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="temperature=0"):
        vocab_parallel_logprobs(logits, torch.zeros(2, 3, dtype=torch.long), 8, temperature=0)
    with pytest.raises(ValueError, match="target's shape"):
        vocab_parallel_logprobs(logits, torch.zeros(2, 4, dtype=torch.long), 8)


def test_chunk_size():
    assert chunk_tokens(49152) == (64 << 20) // (4 * 49152)  # 341 tokens of SmolLM2's vocabulary
    assert chunk_tokens(10**9) == 1


def test_cache_sized_chunks_on_cpu_give_the_same_bits():
    """On a CPU the default chunk is 4 MiB of fp32 (21 tokens of SmolLM2's vocabulary) so that each pass stays in
    cache; every token's statistics are computed alone, so logprobs, entropy and gradient equal those of one
    64 MiB chunk bit for bit."""
    torch.manual_seed(0)
    vocab = 1000
    logits = (torch.randn(3, 50, vocab) * 3).to(torch.bfloat16)
    assert default_chunk(logits) == (4 << 20) // (4 * vocab) == 1048
    assert default_chunk(torch.empty(2, 49152)) == 21
    target = torch.randint(0, vocab, (3, 50))
    out = []
    for chunk in (7, None, 150):  # small chunks, the default, the whole batch in one
        x = logits.clone().requires_grad_(True)
        lp, ent = vocab_parallel_logprobs(x, target, vocab, temperature=0.7, chunk=chunk)
        lp.sum().backward()
        out.append((lp, ent, x.grad))
    for other in out[1:]:
        for a, b in zip(out[0], other):
            assert torch.equal(a, b)
