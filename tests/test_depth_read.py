"""
The grouped AttnRes depth read (fast/depth_read.py) in its torch form, fp64, against the plain
code of residuals.py wherever a read can happen: the model's order and others (a probe's swaps,
skips, dropped blocks), a retained graph run backward twice, gradients asked for a few
parameters only (the reads' shares formed without autograd asking for their sources), the
jacobian probe's pattern (a state continued twice), group sizes 1, 3 and 8; and nothing of a
step kept after it.

    python -m pytest tests/test_depth_read.py -q
"""

import gc
import sys
import weakref
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fast  # noqa: E402
from fast import depth_read as dr  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

ORDERS = {'model': dict(), 'swap': dict(order=[0, 2, 1, 3, 4, 5]), 'skip': dict(skip=(2,)),
          'swap+skip': dict(order=[0, 1, 2, 3, 5, 4], skip=(1,)), 'dropped': dict(order=[0, 1, 2])}
SCHEMES = [('attnres', {}), ('blockattnres', dict(attnres_blocks=4)), ('blockattnres', dict(attnres_blocks=2)),
           ('blockattnres', dict(attnres_blocks=12))]  # blocks of 3, 6 and 1 sublayers


def model_of(residual, kw, fast_on):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=6, n_embd=32, n_head=4, residual=residual, **kw))
    fast.randomise(model)
    model = model.double()
    if fast_on:
        fast.enable(model, [p for p in fast.FAST_PATHS if not p.cuda_only and isinstance(model.residual, p.scheme)
                            and p.applies(model.config) and p.method in ('read', 'read_at', 'block')])
    return model


def step(model, idx, twice=False, order=None, skip=()):
    """Logits and every gradient (None where none) of a loss on the readout after `order`/`skip`."""
    model.zero_grad(set_to_none=True)
    h = model.hidden(idx, order=order, skip=skip)
    y = model.residual.readout(h, model.norm_f)
    loss = (y * torch.linspace(-1, 1, y.size(-1), dtype=y.dtype)).square().mean()
    loss.backward(retain_graph=twice)
    if twice:
        loss.backward()
    return [y.detach()] + [p.grad for p in model.parameters()]


def same(have, want, tol=1e-12):
    assert len(have) == len(want)
    for i, (h, w) in enumerate(zip(have, want)):
        assert (h is None) == (w is None), f"tensor {i}: a gradient in one form only"
        if w is not None:
            err = ((h - w).abs().max() / w.abs().max().clamp_min(1e-300)).item()
            assert err <= tol, f"tensor {i}: relative error {err:.1e}"


@pytest.mark.parametrize('order,G', [(o, 3) for o in ORDERS] + [('model', 1), ('model', 8)])
@pytest.mark.parametrize('residual,kw', SCHEMES, ids=['full', 'block3', 'block6', 'block1'])
def test_the_grouped_read_is_the_plain_read_in_any_order(residual, kw, order, G, monkeypatch):
    monkeypatch.setattr(dr, 'G_MAX', G)
    idx = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    same(step(model_of(residual, kw, True), idx, **ORDERS[order]), step(model_of(residual, kw, False), idx,
                                                                       **ORDERS[order]))


@pytest.mark.parametrize('residual,kw', SCHEMES[:2], ids=['full', 'block3'])
def test_a_retained_graph_run_twice(residual, kw):
    """Each backward pass forms its own sums (keyed by autograd's graph task): twice the gradient."""
    idx = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    same(step(model_of(residual, kw, True), idx, twice=True), step(model_of(residual, kw, False), idx, twice=True))


@pytest.mark.parametrize('residual', ['attnres', 'blockattnres'])
def test_the_gradient_of_a_few_pseudo_queries(residual, monkeypatch):
    """torch.autograd.grad of the loss w.r.t. two pseudo-queries and a key gain of one group, the
    sources leaves: autograd never asks for the sources' gradients, so phase 1's backward forms
    the intra sources' shares itself (the u gradients need them)."""
    monkeypatch.setattr(dr, 'G_MAX', 3)
    res = model_of(residual, dict(attnres_blocks=1), False).residual
    g = torch.Generator().manual_seed(2)
    srcs = [torch.randn(2, 5, 32, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(9)]
    order = dr.read_order(res)
    wanted = [order[3].query, order[4].query, order[4].key_norm.weight]
    called = []
    form = dr.Group.form
    monkeypatch.setattr(dr.Group, 'form', lambda self, *a, **k: called.append(k.get('final', False)) or
                        form(self, *a, **k))

    def grads(fn):
        zs, sources, partial = [], [srcs[0]], None
        for k in range(1, 9):
            if residual == 'attnres':
                sources.append(srcs[k])
                zs.append(fn(res, sources, order[k - 1])[0])
            else:
                partial = srcs[k]
                sources, partial, z, _ = fn(res, tuple(sources), partial, k, order[k - 1], k // 2, 1 - k % 2)
                zs.append(z)
        return torch.autograd.grad(sum((z * z).sum() for z in zs), wanted)
    plain = type(res).read if residual == 'attnres' else type(res).read_at
    have = grads((dr.read if residual == 'attnres' else dr.read_at)(dr.TorchOps))
    same(list(have), list(grads(plain)))
    assert False in called  # a share formed in phase 1's backward, into the sink


def test_the_jacobian_probe_of_a_block():
    """probes.analysis.jacobian_deviation: a block's map differentiated several times over one
    graph (retain_graph), from a state computed without gradients (the fused stream steps of HC
    and mHC too: their backward runs again on the same saved tensors)."""
    from probes.analysis import jacobian_deviation
    win = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    for residual, kw in SCHEMES[:2] + [('hc', {}), ('mhc', {})]:
        want = jacobian_deviation(model_of(residual, kw, False).float(), win, n_probes=3, batch_size=2)
        have = jacobian_deviation(model_of(residual, kw, True).float(), win, n_probes=3, batch_size=2)
        assert have['deviation'] == pytest.approx(want['deviation'], rel=1e-5)


@pytest.mark.parametrize('residual', ['attnres', 'blockattnres'])
def test_nothing_of_a_step_is_kept_after_it(residual):
    """After a training step, and after a forward without gradients, no group is alive (the
    autograd graph held them), no source is aliased, no group is open: nothing grows step by step."""
    model = model_of(residual, dict(attnres_blocks=2), True)
    idx = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    groups = []
    init = dr.Group.__init__

    def record(self, *a, **k):
        init(self, *a, **k)
        groups.append(weakref.ref(self))
    dr.Group.__init__ = record
    try:
        for _ in range(2):
            model(idx, idx)[1].backward()
            with torch.no_grad():
                model(idx)
    finally:
        dr.Group.__init__ = init
    gc.collect()
    state = dr._STATE[model.residual]
    assert len(groups) >= 4 and not any(r() for r in groups)
    assert state['open'] is None and not state['bank'].entries


@pytest.mark.parametrize('residual, blocks, want', [
    ('attnres', 8, [(1, 8), (9, 16)]),                                  # G_MAX = 8 reads a group
    ('blockattnres', 2, [(1, 7), (8, 15), (16, 16)]),                   # blocks of 8: boundaries at reads 8, 16
    ('blockattnres', 4, [(1, 3), (4, 7), (8, 11), (12, 15), (16, 16)]),  # blocks of 4: at 4, 8, 12, 16
    ('blockattnres', 16, [(1, 8), (9, 16)])])                           # blocks of 1 sublayer: Full AttnRes
def test_groups_end_before_a_block_boundary(residual, blocks, want):
    """Bug caught: a group across a Block AttnRes boundary (P frozen as a source inside it: the
    group is dropped there and its later reads scored again, right but twice the traffic). The
    reads 1 .. 2L = 16 of L = 8, walked group by group; the spans worked by hand from
    boundary(k) = k % S == 0 and G_MAX = 8."""
    cfg = GPTConfig(n_layer=8, n_embd=32, n_head=2, block_size=16, vocab_size=64, residual=residual,
                    attnres_blocks=blocks)
    res = GPT(cfg).residual
    order, k, spans = dr.read_order(res), 1, []
    while k <= len(order):
        group = dr.plan(res, order[k - 1], k)
        spans.append((k, k + len(group) - 1))
        k += len(group)
    assert dr.G_MAX == 8 and spans == want
