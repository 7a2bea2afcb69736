"""
Regional compilation, `GPT.compile_regions` ("compile the block, not the model"): every
block's branches and the scheme's `regions` are compiled on their own. The compiled model
gives the eager loss and gradients for every scheme, with no graph break; the number of
compiled graphs does not grow with depth; a region that a fast path replaced is not compiled;
a plain torch.compile(model) gets the regional compile, with one warning naming model.compile().
Backend aot_eager (traced as inductor traces, then run eagerly: seconds, no C++ compiler),
and one inductor run (slow).

    python -m pytest tests/test_compile.py -q
"""

import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fast  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from residuals import RESIDUALS  # noqa: E402

GROWING = ('preln', 'attnres', 'blockattnres', 'hc', 'mhc', 'moda')  # the schemes of the depth study


def make(residual, L=3, **kw):
    """A tiny fp32 model with every parameter random (zero queries or identity routing would
    hide a region that computes the wrong thing); Block AttnRes in blocks of 2 sublayers."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=L, n_embd=32, n_head=2, residual=residual,
                          attnres_blocks=L, **kw))
    fast.randomise(model)
    return model.float()


def tokens(seed=0):
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(seed))


def step(model, idx):
    """A training step's loss and gradients (by parameter name)."""
    model.zero_grad(set_to_none=True)
    loss = model(idx, idx)[1]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def graphs():
    return counters['stats']['unique_graphs']


def breaks():
    """Graph breaks: unsupported calls, and data-dependent branches (counted apart)."""
    return sum(counters['graph_break'].values()) + sum(counters['unimplemented'].values())


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def assert_same_step(have, want, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(have[0], want[0], rtol=rtol, atol=atol)
    assert have[1].keys() == want[1].keys()
    for n in want[1]:
        torch.testing.assert_close(have[1][n], want[1][n], rtol=rtol, atol=atol, msg=lambda m: f"{n}: {m}")


def compiled_step_is_eager(model, idx):
    """compile_regions, then: loss and every gradient as eager, no graph break, no recompile
    (in the first step, where each block calls the same regions with more and more sources,
    nor in the second), and the eager logits under no_grad (evaluation, sampling). Returns
    the number of graphs compiled."""
    eager = step(model, idx)
    with torch.no_grad():
        eager_logits = model(idx)[0]
    model.compile_regions(backend='aot_eager')
    with torch._dynamo.config.patch(error_on_recompile=True):  # each region compiles once, for every block
        assert_same_step(step(model, idx), eager)
    n = graphs()
    assert n >= 2 and breaks() == 0  # at least the attention and the MLP
    assert_same_step(step(model, idx), eager)
    assert graphs() == n  # the second step reuses every graph
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], eager_logits, rtol=1e-5, atol=1e-6)
    assert breaks() == 0
    return n


@pytest.mark.parametrize('residual', [r for r in RESIDUALS if r not in GROWING])
def test_regional_compile_gives_the_eager_step(residual):
    compiled_step_is_eager(make(residual, L=3), tokens())


@pytest.mark.parametrize('residual', GROWING)
def test_regional_compile_gives_the_eager_step_and_does_not_grow_with_depth(residual):
    """As above, at L = 2 and L = 6: one compile per region serves every block, so both
    depths compile the same graphs (the regions' growing dims, e.g. AttnRes's number of
    sources, are dynamic)."""
    counts = []
    for L in (2, 6):
        torch._dynamo.reset()
        counters.clear()
        counts.append(compiled_step_is_eager(make(residual, L), tokens()))
    assert counts[0] == counts[1], counts


def test_the_compiler_builds_one_sinkhorn_round_not_twenty():
    """mHC's region holds one Sinkhorn round (two sums) called 19 times, not 19 unrolled
    rounds: unrolled, inductor fuses them into one large kernel, and mHC compiles in 2x Pre-LN's time."""
    import residuals
    gms = []
    rounds = torch.compile(residuals.sinkhorn_rounds, fullgraph=True,
                           backend=lambda gm, example: gms.append(gm) or gm.forward)
    P = torch.rand(2, 3, 4, 4)
    torch.testing.assert_close(rounds(P, 19, -2, -1, 1e-6), residuals.sinkhorn_rounds(P, 19, -2, -1, 1e-6))
    gm, = gms
    calls = [n for n in gm.graph.nodes if 'invoke_subgraph' in str(n.target)]
    sums = lambda g: sum(1 for n in g.graph.nodes if str(n.target) == 'sum')  # noqa: E731
    assert len(calls) == 19 and sums(gm) == 0
    assert [sums(m) for _, m in gm.named_children()] == [2]  # one body, one round


@pytest.mark.parametrize('residual,region,methods', [('mhc', 'sinkhorn_rounds', ['block']),
                                                     ('moda', 'attention', ['block', 'attention'])])
def test_a_region_replaced_by_a_fast_path_is_not_compiled(residual, region, methods):
    """fast.setup, then compile_regions: the fast path stays in place (not wrapped by the compiler)
    and the scheme's region is not compiled (mHC's Sinkhorn rounds: the fast block computes them
    itself; MoDA's joint softmax: replaced), so one graph fewer is compiled, and the step is the
    eager fast step."""
    model, idx = make(residual), tokens()
    plain = make(residual).compile_regions(backend='aot_eager')
    step(plain, idx)
    n_plain = graphs()
    torch._dynamo.reset()
    counters.clear()
    paths = fast.setup(model, True, 'cpu')
    assert [p.method for p in paths] == methods
    eager = step(model, idx)
    model.compile_regions(backend='aot_eager')
    assert all(getattr(model.residual, p.method).__func__ is p.impl for p in paths)
    assert_same_step(step(model, idx), eager)
    assert graphs() == n_plain - 1 and breaks() == 0


@pytest.mark.slow  # inductor compiles C++ kernels: about 30 s on 2 cores
def test_inductor_compiles_the_growing_attnres_read():
    """The default backend (what train.py --compile=True uses) on Full AttnRes, whose depth
    read has a dynamic number of sources: the eager step, no graph break."""
    model, idx = make('attnres', L=2), tokens()
    eager = step(model, idx)
    model.compile_regions()
    assert_same_step(step(model, idx), eager, rtol=1e-4, atol=1e-5)
    assert breaks() == 0


def test_model_compile_is_the_regional_compile():
    """model.compile() (nn.Module.compile, what a reader of nanoGPT calls) compiles the
    regions, not the whole model: the branches and the scheme's regions are wrapped, the
    model's own forward is not. Nothing is compiled until a forward runs, so this is cheap."""
    model = make('attnres', L=2)
    assert model.compile(backend='aot_eager') is model
    assert model._compiled_call_impl is None  # not one graph of the whole model
    assert all(blk.attn._compiled_call_impl is not None and blk.mlp._compiled_call_impl is not None
               for blk in model.blocks)
    assert 'mix' in vars(model.residual)  # AttnRes's region, compiled on its own


def compiled_step(compiled, model, idx):
    """`step` through torch.compile(model)'s wrapper, gradients read from the model."""
    model.zero_grad(set_to_none=True)
    loss = compiled(idx, idx)[1]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize('residual', ['attnres', 'moda'])
def test_a_plain_torch_compile_gets_the_regional_compile_with_one_warning(residual, monkeypatch):
    """nanoGPT's `model = torch.compile(model)`: the first call warns once, naming
    model.compile(), and compiles the regions (not one graph of every block): the eager step,
    the same graphs as model.compile() at L = 2 and at L = 4 (flat in depth), no second
    warning, no recompile on the second step."""
    import warnings
    monkeypatch.setattr(GPT.compile_regions, '__defaults__', ('aot_eager',))  # inductor needs a C++ compiler: slow
    counts = []
    for L in (2, 4):
        torch._dynamo.reset()
        counters.clear()
        model, idx = make(residual, L), tokens()
        eager = step(model, idx)
        compiled = torch.compile(model, backend='aot_eager')
        with pytest.warns(UserWarning, match=r"model\.compile\(\)") as caught:
            assert_same_step(compiled_step(compiled, model, idx), eager)
        assert len([w for w in caught if 'torch.compile(model)' in str(w.message)]) == 1
        assert model.regions_compiled and all(blk.attn._compiled_call_impl is not None for blk in model.blocks)
        n = graphs()
        with warnings.catch_warnings():
            warnings.simplefilter('error')  # a second warning would raise
            with torch._dynamo.config.patch(error_on_recompile=True):
                assert_same_step(compiled_step(compiled, model, idx), eager)
        assert graphs() == n
        counts.append(n)
        torch._dynamo.reset()
        counters.clear()
        regional = make(residual, L).compile(backend='aot_eager')
        step(regional, idx)
        assert graphs() == n, (graphs(), n)  # what model.compile() compiles
    assert counts[0] == counts[1], counts
