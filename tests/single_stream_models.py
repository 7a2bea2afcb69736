"""Tiny GPTs of the single-stream schemes and MoDA for tests/test_single_stream.py and
tests/test_moda.py: vocabulary 64, norm eps 1e-6, scheme parameters moved off their init."""

import torch

from model import GPT, GPTConfig


VOCAB = 64


EPS = 1e-6


def make(residual, L=3, d=32, H=4, kv=None, seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=32, n_layer=L, n_embd=d, n_head=H,
                         n_kv_head=kv, norm_eps=EPS, residual=residual, **kw))


@torch.no_grad()
def randomize_scheme(model, seed=1):
    """Moves every scheme parameter away from its init (gains 1, gates 0, scales 1e-4), so
    that a wrong use of any of them shows in the output."""
    g = torch.Generator().manual_seed(seed)
    for p in model.residual.parameters():
        if p.dim() >= 2:  # MoDA's W_kv: a projection, keep its scale
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
    return model


def tokens(B=2, T=16, seed=0):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def close(a, b, atol=1e-5):
    return torch.allclose(a, b, rtol=1e-5, atol=atol)
