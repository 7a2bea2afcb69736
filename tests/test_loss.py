"""model.lm_head_loss, the chunked LM head + cross-entropy: equal to the plain loss, and it
keeps no (B, T, V) fp32 tensor for the backward."""

import pytest
import torch
import torch.nn.functional as F

from model import GPT, GPTConfig, lm_head_loss
from perf import step


def case(seed=0, V=50):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 7, 16, dtype=torch.float64, generator=g)
    w = 0.3 * torch.randn(V, 16, dtype=torch.float64, generator=g)
    t = torch.randint(0, V, (3, 7), generator=g)
    t[0, 2] = t[2, 6] = -1  # ignored positions
    return x, w, t


def run(x, w, t, dtype, autocast, fused, chunk=5):
    x, w = x.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
    with torch.autocast('cpu', torch.bfloat16, enabled=autocast):
        if fused:
            logits, loss = lm_head_loss(x, w, t, chunk=chunk)
        else:
            logits = F.linear(x, w)
            loss = F.cross_entropy(logits.to(torch.promote_types(dtype, torch.float32)).flatten(0, 1), t.flatten(),
                                   ignore_index=-1)
    return [loss, logits] + list(torch.autograd.grad(loss, (x, w)))


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize('chunk', [1, 5, 21, 64])
def test_equals_the_plain_loss_in_fp64(chunk):
    x, w, t = case()
    for a, b in zip(run(x, w, t, torch.float64, False, True, chunk), run(x, w, t, torch.float64, False, False)):
        assert rel(a, b) < 1e-13


def test_bf16_autocast_no_further_from_fp64_than_the_plain_loss():
    """Under bf16 autocast both round the products to bf16, at different points; the chunked
    loss's error against fp64 (loss, logits, both gradients) is at most twice the plain loss's."""
    x, w, t = case(1)
    exact = run(x, w, t, torch.float64, False, False)
    plain = run(x, w, t, torch.float32, True, False)
    fused = run(x, w, t, torch.float32, True, True)
    for name, f, p, e in zip(('loss', 'logits', 'grad x', 'grad w'), fused, plain, exact):
        assert rel(f, e) <= 2 * rel(p, e), name
    assert fused[1].dtype == torch.bfloat16 and fused[0].dtype == torch.float32


def test_no_grad_gives_the_loss_alone():
    x, w, t = case(2)
    with torch.no_grad():
        logits, loss = lm_head_loss(x, w, t, chunk=4)
    ref = F.cross_entropy(F.linear(x, w).flatten(0, 1), t.flatten(), ignore_index=-1)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-13) and not loss.requires_grad


def test_gpt_loss_is_the_head_cross_entropy():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16, residual='attnres'))
    idx, tgt = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    logits, loss = model(idx, tgt)
    ref = F.cross_entropy(model(idx)[0].flatten(0, 1), tgt.flatten())
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    torch.testing.assert_close(logits, model(idx)[0])


def test_the_step_saves_no_fp32_logits():
    """A training step's saved bytes stay below the (B, T, V) fp32 log-probabilities alone."""
    B, T, V = 4, 32, 8192
    cfg = GPTConfig(n_layer=1, n_embd=32, n_head=2, vocab_size=V, block_size=T)
    c = step.count_step(cfg, B, T, fast_paths='off')
    assert c['saved'] < B * T * V * 4
