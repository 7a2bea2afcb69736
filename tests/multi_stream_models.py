"""Tiny GPTs of HC, mHC and Block AttnRes for tests/test_hyper_connections.py and
tests/test_attnres.py: vocabulary 128, 4 blocks of width 64, routing moved off its init, and a
Pre-LN twin with the same backbone weights."""

import torch

from model import GPT, GPTConfig


V = 128          # vocabulary of the tiny test models


def make(residual, n_layer=4, n_embd=64, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=V, block_size=32, n_layer=n_layer, n_head=4, n_embd=n_embd,
                    residual=residual, **kw)
    return GPT(cfg)


def tokens(B=2, T=16, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def perturb(model, std=0.3, seed=3):
    """Adds noise to every scheme parameter, so that no test passes only because the
    routing is at its (Pre-LN-like) init."""
    g = torch.Generator().manual_seed(seed)
    for p in model.residual.parameters():
        p.add_(std * torch.randn(p.shape, generator=g))


def max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def pair(residual, **kw):
    """(scheme model, Pre-LN model) with identical backbone weights and pre-norms. The
    tiny norm eps makes RMSNorm exactly scale invariant: the schemes' readouts are
    rescaled Pre-LN states (m h for the stream sum, h / n for a mean of n sources)."""
    pre = make('preln', norm_eps=1e-12)
    with torch.no_grad():  # non-trivial norm gains, so that they must be loaded correctly
        for n, p in pre.named_parameters():
            if n.endswith('norm.weight') or n == 'norm_f.weight':
                p.add_(0.2 * torch.randn_like(p))
    model = make(residual, norm_eps=1e-12, attnres_eps=1e-12, seed=7, **kw)
    missing, unexpected = model.load_state_dict(pre.state_dict(), strict=False)
    assert not unexpected
    assert all(k.startswith('residual.') for k in missing)
    return model.eval(), pre.eval()
