"""Model values a training run's results depend on, each against its formula with the
inputs that expose a wrong scale: AttnRes depth scores with non-zero pseudo-queries (zero
queries give uniform weights whatever the score scale), the mHC Sinkhorn default of the
training script, and the initial LM-head weights.
Run: python -m pytest tests/test_formulas.py -q"""

import ast
import math
from pathlib import Path

import pytest
import torch

from model import GPT, GPTConfig

REPO = Path(__file__).resolve().parents[1]


def tiny(residual, **kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=64, residual=residual, **kw))


@torch.no_grad()
def test_attnres_depth_scores_follow_the_formula_with_nonzero_queries():
    """e_i = w . (g * v_i) / rms(v_i) (no 1/sqrt(d), temperature 1), a = softmax_i e,
    mix = sum_i a_i v_i, for the output-side read of block 0 (sources: embedding, attention
    and MLP outputs of block 0), with a random query of unit-scale scores."""
    model = tiny('attnres')
    d, eps = 64, model.config.attnres_eps
    g = torch.Generator().manual_seed(1)
    layer = model.residual.layers[0]
    layer.out_mix.query.copy_(torch.randn(d, generator=g))
    layer.out_mix.key_norm.weight.copy_(1 + 0.3 * torch.randn(d, generator=g))
    idx = torch.randint(0, 64, (2, 8), generator=g)
    res = model.residual
    rope = (model.rope_cos[:8], model.rope_sin[:8])
    sources, mix = res.block(res.begin(model.wte(idx)), 0, model.blocks[0], rope)
    assert len(sources) == 3
    V = torch.stack(sources).double()                                  # (3, B, T, d)
    w, gain = layer.out_mix.query.double(), layer.out_mix.key_norm.weight.double()
    e = (V * gain * w).sum(-1) / V.pow(2).mean(-1).add(eps).sqrt()    # (3, B, T)
    a = torch.softmax(e, dim=0)
    assert a.max() - a.min() > 0.5  # far from uniform: the score scale decides the weights
    expected = (a.unsqueeze(-1) * V).sum(0)
    torch.testing.assert_close(mix.double(), expected, rtol=1e-5, atol=1e-6)
    # the same with 1/sqrt(d) on the scores would be far off
    a_scaled = torch.softmax(e / math.sqrt(d), dim=0)
    assert (a_scaled - a).abs().max() > 0.1


def test_mhc_sinkhorn_iterations_default_to_20_in_training():
    """Paper Appendix A, docs/schemes.md: 20 Sinkhorn-Knopp iterations; the training script's default
    (a literal in train.py) and GPTConfig's agree, and the built model uses them."""
    tree = ast.parse((REPO / 'train.py').read_text())
    defaults = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Name)}
    assert ast.literal_eval(defaults['mhc_sinkhorn_iters']) == 20
    assert GPTConfig().mhc_sinkhorn_iters == 20
    model = tiny('mhc')
    assert model.config.mhc_sinkhorn_iters == 20


@pytest.mark.parametrize('residual', ['preln', 'hc'])
def test_lm_head_and_embedding_start_at_the_documented_init(residual):
    """normal(0, 0.02) truncated at +-3 std (model.py): torch's default Linear init would give
    std 1/sqrt(3 d) = 0.072 at d = 64, the embedding's default std 1."""
    model = tiny(residual)
    for name in ('lm_head', 'wte'):
        w = getattr(model, name).weight
        assert w.std().item() == pytest.approx(0.02 * 0.9866, rel=0.05), name  # std of the cut normal
        assert w.abs().max().item() <= 0.06 + 1e-7 and abs(w.mean().item()) < 2e-3, name
