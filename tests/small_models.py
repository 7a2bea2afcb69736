"""Small GPTs shared by several test files: `small_model` (3 blocks of width 16, eval mode,
norm eps 1e-6) with `small_tokens` and `move_off_init`; `tiny` (2 blocks of width 64); and
`TINY`, the config of tests/test_model.py."""

import torch

from model import GPT, GPTConfig

EPS = 1e-6
TINY = dict(n_layer=3, n_embd=64, n_head=4, vocab_size=101, block_size=32)


def small_model(residual, L=3, d=16, seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=L, n_embd=d, n_head=2, norm_eps=EPS,
                         residual=residual, **kw)).eval()


@torch.no_grad()
def move_off_init(model, seed=1):
    """Every scheme parameter moved off its init (zero queries would make every read a mean)."""
    g = torch.Generator().manual_seed(seed)
    for p in model.residual.parameters():
        p.copy_((1 if p.dim() == 1 and (p == 1).all() else 0) + 0.5 * torch.randn(p.shape, generator=g))
    return model


def small_tokens(B=2, T=12, seed=0, vocab=64):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def tiny(residual, **kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=64, residual=residual, **kw))
