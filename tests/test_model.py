"""Backbone tests: parameter counts, the LM-head init, causality, block orders, MFU.
Run: python -m pytest tests/test_model.py -q"""

import math

import pytest
import torch

import model
from model import GPT, GPTConfig, apply_rope, ffn_hidden_size, rope_cache
from small_models import TINY, tiny


def preln_formula(L, d, V, d_ff):
    """Paper Sec. 2.2: L(4d^2 + 3 d d_ff + 2d) + 2Vd + d."""
    return L * (4 * d * d + 3 * d * d_ff + 2 * d) + 2 * V * d + d


@pytest.mark.parametrize('L,d,total_m,backbone_m', [
    (16, 1216, 407, 284), (20, 1120, 414, 301), (24, 1024, 405, 302), (28, 960, 406, 310),
    (32, 896, 399, 309), (42, 800, 404, 324), (70, 640, 409, 345)])
def test_preln_param_count_main_family(L, d, total_m, backbone_m):
    """Every main-family shape (paper Table 3) on the meta device: the instantiated model equals
    the formula, and the formula gives the paper's rounded totals."""
    with torch.device('meta'):
        model = GPT(GPTConfig(n_layer=L, n_embd=d, block_size=16))
    V, d_ff = 50280, ffn_hidden_size(d)
    n = model.num_params()
    assert n == preln_formula(L, d, V, d_ff)
    assert round(n / 1e6) == total_m
    assert round((n - 2 * V * d - d) / 1e6) == backbone_m
    if (L, d) == (24, 1024):
        assert round(n / 1e6, 2) == 405.41


@pytest.mark.parametrize('shape', [dict(n_layer=1, n_embd=32, n_head=2), dict(n_layer=3, n_embd=48, n_head=4, ffn_hidden=100),
                                   dict(n_layer=2, n_embd=64, n_head=8, vocab_size=257)])
def test_preln_param_count_small(shape):
    cfg = GPTConfig(block_size=16, **shape)
    assert GPT(cfg).num_params() == preln_formula(cfg.n_layer, cfg.n_embd, cfg.vocab_size, cfg.ffn_hidden)


def test_ffn_hidden():
    assert ffn_hidden_size(896) == 16 * math.ceil(8 * 896 / 3 / 16) == 2400
    assert ffn_hidden_size(1216) == 3248


def test_config_errors():
    with pytest.raises(ValueError, match='not divisible by n_head'):
        GPTConfig(n_embd=100, n_head=16)
    with pytest.raises(ValueError, match='n_kv_head'):
        GPTConfig(n_embd=64, n_head=4, n_kv_head=3)
    with pytest.raises(ValueError, match='unknown residual'):
        GPT(GPTConfig(residual='nope', **TINY))


def test_rope_rotation_is_relative():
    """q.k after RoPE depends only on the position difference."""
    cos, sin = rope_cache(16, 8)
    q, k = torch.randn(8), torch.randn(8)
    def dot(i, j):
        qi = apply_rope(q.view(1, 1, 1, 8).expand(1, 1, 16, 8), cos, sin)[0, 0, i]
        kj = apply_rope(k.view(1, 1, 1, 8).expand(1, 1, 16, 8), cos, sin)[0, 0, j]
        return (qi @ kj).item()
    assert dot(5, 3) == pytest.approx(dot(12, 10), abs=1e-5)
    assert dot(5, 3) != pytest.approx(dot(5, 4), abs=1e-3)


@pytest.mark.parametrize('residual', ['preln', 'hc'])
def test_lm_head_and_embedding_start_at_the_documented_init(residual):
    """normal(0, 0.02) truncated at +-3 std (model.py): torch's default Linear init would give
    std 1/sqrt(3 d) = 0.072 at d = 64, the embedding's default std 1."""
    model = tiny(residual)
    for name in ('lm_head', 'wte'):
        w = getattr(model, name).weight
        assert w.std().item() == pytest.approx(0.02 * 0.9866, rel=0.05), name  # std of the cut normal
        assert w.abs().max().item() <= 0.06 + 1e-7 and abs(w.mean().item()) < 2e-3, name


def perturbed(model):
    """Random non-trivial scheme parameters, so that the tests do not pass by a zero init."""
    with torch.no_grad():
        for n, p in model.residual.named_parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


@pytest.mark.parametrize('residual', ['preln', 'attnres'])
def test_causality(residual):
    torch.manual_seed(1)
    m = perturbed(GPT(GPTConfig(residual=residual, **TINY))).eval()
    idx = torch.randint(0, 101, (2, 32))
    idx2 = idx.clone()
    idx2[:, 20:] = torch.randint(0, 101, (2, 12))
    a, b = m(idx)[0], m(idx2)[0]
    torch.testing.assert_close(a[:, :20], b[:, :20])
    assert (a[:, 20:] - b[:, 20:]).abs().max() > 1e-4


@pytest.mark.parametrize('residual', ['preln', 'attnres'])
def test_orders(residual):
    """Skip, swap and drop are other orders of the same blocks; weights travel with the block index."""
    torch.manual_seed(2)
    m = perturbed(GPT(GPTConfig(residual=residual, **TINY))).eval()
    idx = torch.randint(0, 101, (2, 16))
    full = m(idx)[0]
    torch.testing.assert_close(m(idx, order=[0, 1, 2])[0], full)
    swapped, dropped, skipped = m(idx, order=[0, 2, 1])[0], m(idx, order=[0, 2])[0], m(idx, skip={1})[0]
    for other in (swapped, dropped, skipped):
        assert other.shape == full.shape and (other - full).abs().max() > 1e-4
    record = []
    m.hidden(idx, skip={1}, record=record)
    assert len(record) == 4  # z_0 .. z_L
    if residual == 'preln':  # a skipped Pre-LN block is the identity, and skip == drop
        torch.testing.assert_close(record[2][0], record[1][0])
        torch.testing.assert_close(skipped, dropped)


def test_configure_optimizers_groups():
    m = GPT(GPTConfig(residual='attnres', **TINY))
    # the study's optimizer (default): one decayed group over every AttnRes-model parameter
    decay, other = m.configure_optimizers(0.1, 1e-3, (0.9, 0.95)).param_groups
    assert decay['weight_decay'] == 0.1 and other['weight_decay'] == 0.0
    assert sum(p.numel() for p in decay['params']) == m.num_params() and not other['params']
    # nanoGPT's: matrices only
    opt = m.configure_optimizers(0.1, 1e-3, (0.9, 0.95), decay_on='matrices')
    decay, other = opt.param_groups
    assert all(p.dim() >= 2 for p in decay['params']) and all(p.dim() < 2 for p in other['params'])
    assert sum(p.numel() for g in opt.param_groups for p in g['params']) == m.num_params()
    with pytest.raises(ValueError, match='decay_on'):
        m.configure_optimizers(0.1, 1e-3, (0.9, 0.95), decay_on='vectors')


def test_old_checkpoint_configs_keep_their_readout():
    # model_args saved before hc_readout / attnres_eps existed load with the values they trained with
    # (and mhc_sinkhorn: rows then columns, no eps)
    old = {k: v for k, v in vars(GPTConfig(residual='hc', **TINY)).items()
           if k not in ('hc_readout', 'attnres_eps', 'mhc_sinkhorn')}
    cfg = GPTConfig.from_dict(old)
    assert cfg.hc_readout == 'sum' and cfg.attnres_eps == cfg.norm_eps and cfg.mhc_sinkhorn == 'plain'
    new = GPTConfig.from_dict(vars(GPTConfig(residual='hc', **TINY)))
    assert new.hc_readout == 'auto' and new.attnres_eps == 1e-5 and new.mhc_sinkhorn == 'liger'


def test_mfu_is_none_on_cpu():
    from model import estimate_mfu
    assert estimate_mfu(GPT(GPTConfig(**TINY)), 1000.0, 32, 'cpu') is None


@pytest.mark.parametrize('name, peak', [
    ('NVIDIA H100 80GB HBM3', 989e12), ('NVIDIA H100 PCIe', 756e12), ('NVIDIA H100 NVL', 835e12),
    ('NVIDIA H200', 989e12), ('NVIDIA H200 NVL', 835e12), ('NVIDIA GH200 480GB', 989e12),
    ('NVIDIA A100-SXM4-80GB', 312e12), ('NVIDIA A100 80GB PCIe', 312e12), ('NVIDIA B200', 2250e12),
    ('NVIDIA L40S', 362e12), ('NVIDIA L4', 121e12), ('NVIDIA A10', 125e12),
    ('NVIDIA GB200', None), ('NVIDIA A10G', None), ('NVIDIA H20', None), ('Tesla V100-SXM2-32GB', None),
    ('NVIDIA RTX PRO 6000 Blackwell', None), ('Some Future GPU', None),
])
def test_mfu_peak_per_device_name(name, peak, monkeypatch):
    """The dense bf16 peak of each name (a variant before its family: H100 PCIe is not an
    H100 SXM, GB200 is not a B200), and None, hence no MFU, for one the table does not know."""
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda device=None: name)
    assert model.peak_flops('cuda') == peak
    gpt = model.GPT(model.GPTConfig(n_layer=1, n_embd=32, n_head=2, vocab_size=64, block_size=16))
    mfu = model.estimate_mfu(gpt, 1e6, 16, 'cuda')
    assert (mfu is None) == (peak is None)
    if peak:
        assert mfu == pytest.approx(gpt.flops_per_token(16) * 1e6 / peak)
    assert model.peak_flops('cpu') is None
