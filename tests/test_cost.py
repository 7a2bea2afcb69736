"""
Tests of cost.py: the FLOP formulas against torch.utils.flop_counter for every
registered scheme, the closed-form parameter counts against the instantiated models,
KV-cache bytes, the study's published cost numbers (paper Sec. 4.4, Fig. 11; docs/cost.md), and a tiny
measured prefill on the CPU.
Run: python -m pytest tests/test_cost.py -q
"""

import itertools
import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cost  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from residuals import RESIDUALS  # noqa: E402

SCHEMES = list(RESIDUALS)
# tiny shapes: MHA; GQA with 16 query / 8 KV heads; an odd FFN width, vocab, 2 KV heads
TINY = [dict(n_layer=4, n_embd=64, n_head=4, vocab_size=100),
        dict(n_layer=4, n_embd=64, n_head=16, n_kv_head=8, vocab_size=100),
        dict(n_layer=8, n_embd=48, n_head=4, n_kv_head=2, ffn_hidden=80, vocab_size=37)]
TINY_IDS = ['mha', 'gqa16/8', 'L8-odd']


def config(scheme, **kw):
    return GPTConfig(**{'block_size': 64, **kw}, residual=scheme)


def sources_read(cfg, T):
    """Total number of sources mixed by the depth reads of an AttnRes-family model, from
    its trace (each read records weights of shape (n_sources, B, T))."""
    with torch.device('meta'):
        model = GPT(cfg)
        idx = torch.zeros(1, T, dtype=torch.long)
    with torch.no_grad(), model.residual.trace() as tape:
        model(idx)
    return sum(rec['weights'].shape[0] for rec in tape if 'weights' in rec)

# -----------------------------------------------------------------------------
# FLOPs vs FlopCounterMode


def check_flops(cfg, T, B):
    """flop_check(cfg) agrees with the analytic count, exactly where both count the same things."""
    scheme = cfg.residual
    r = cost.flop_check(cfg, T, batch=B)
    assert r['counted'] > 0 and r['analytic'] > 0
    # the backbone (projections, SwiGLU, full attention, LM head on all positions) is a
    # pure matmul count: without the scheme's extra terms the two agree to the FLOP
    backbone = B * cost.forward_flops(cfg.n_layer, cfg.n_embd, T, residual='preln', ffn_hidden=cfg.ffn_hidden,
                                      n_head=cfg.n_head, n_kv_head=cfg.n_kv_head, vocab_size=cfg.vocab_size,
                                      attention='full', logits='all')
    assert r['analytic'] - sum(r['terms'].values()) == backbone
    terms = r['terms']
    if scheme in cost.ELEMENTWISE_SCHEMES:
        assert terms == {} and r['missing'] == 0
        return
    # exact up to which per-token weighted sums / outer products the implementation writes as
    # broadcasts (invisible to the counter); projections must always be seen
    optional = [k for k in terms if k in cost.BROADCAST_TERMS]
    sums = {sum(terms[k] for k in sub) for n in range(len(optional) + 1)
            for sub in itertools.combinations(optional, n)}
    assert r['missing'] in sums, (scheme, r['missing'], terms)
    if scheme in ('attnres', 'blockattnres', 'moda'):
        # the plain depth reads of residuals.py are matrix products and einsums: all counted
        assert r['missing'] == 0, (scheme, r['missing'], terms)
    if scheme in ('attnres', 'blockattnres'):
        # the number of sources the formula assumes = the number the model's reads mix (trace)
        L, d = cfg.n_layer, cfg.n_embd
        n = L * (2 * L + 3) if scheme == 'attnres' else \
            sum(cost.blockattnres_sources(L, cfg.attnres_blocks, appendix_d=False))
        assert sources_read(cfg, T) == n
        assert terms['depth_scores'] == terms['depth_values'] == 2 * T * d * B * n


# every scheme at MHA and GQA; the third shape (L = 8: Block AttnRes with 2-sublayer blocks)
# only for the schemes with extra terms
FLOP_CASES = [pytest.param(scheme, shape, id=f'{i}-{scheme}') for scheme in SCHEMES
              for shape, i in zip(TINY, TINY_IDS) if shape is not TINY[2] or scheme not in cost.ELEMENTWISE_SCHEMES]


@pytest.mark.parametrize('scheme,shape', FLOP_CASES)
def test_forward_flops_match_flop_counter(scheme, shape):
    check_flops(config(scheme, **shape), T=16, B=2)


def test_flop_check_on_cpu_counts_what_meta_counts():
    """On a real CPU MoDA would use the CPU flash kernel, invisible to the counter;
    flop_check's sdpa_kernel(MATH) turns it off, so both devices count the same FLOPs."""
    cfg = GPTConfig(n_layer=3, n_embd=64, n_head=4, n_kv_head=2, block_size=32, vocab_size=100, residual='moda')
    assert cost.flop_check(cfg, 32, device='cpu')['counted'] == cost.flop_check(cfg, 32)['counted']


@pytest.mark.parametrize('m', [2, 3])
@pytest.mark.parametrize('scheme', ['hc', 'mhc'])
def test_stream_count_generalisation(scheme, m):
    """The general-m HC/mHC formulas against the counter at m != 4 too."""
    if scheme not in RESIDUALS:
        pytest.skip(f"{scheme} is not registered in residuals.RESIDUALS")
    check_flops(config(scheme, **TINY[0], hc_streams=m), T=8, B=1)


def design_flops(L, d, scheme='preln', T=4096, V=50280):
    """Sec. 4.4 / Appendix D of the paper written out for MHA: L·(8Td² + 6T·d·d_ff + 2T²d) + 2dV + ΔF, d_ff = 16·ceil(8d/3/16)."""
    d_ff = 16 * math.ceil(8 * d / 3 / 16)
    extra = {'preln': 0, 'hc': 192 * T * d * L, 'mhc': 480 * T * d * L, 'attnres': 4 * T * d * L * (2 * L + 3)}[scheme]
    return L * (8 * T * d * d + 6 * T * d * d_ff + 2 * T * T * d) + 2 * d * V + extra


def test_forward_flops_design_formula_main_family():
    shapes, kw = cost.family_shapes('main')  # from study/families.py when present
    assert [(L, d) for L, d, _ in shapes] == list(cost.MAIN_SHAPES)
    for (L, d), scheme in itertools.product(cost.MAIN_SHAPES, ('preln', 'hc', 'mhc', 'attnres')):
        assert cost.forward_flops(L, d, 4096, residual=scheme) == design_flops(L, d, scheme)


def test_closed_forms_of_design_section_8():
    """The general formulas reduce to the closed forms of the paper's Sec. 4.4 / Appendix D."""
    for L, d, T in [(16, 1216, 4096), (7, 96, 33), (70, 640, 128)]:
        assert cost.extra_flops('hc', L, d, T) == 192 * T * d * L
        assert cost.extra_flops('mhc', L, d, T) == 480 * T * d * L
        assert cost.extra_flops('attnres', L, d, T) == 4 * T * d * L * (2 * L + 3)
        assert cost.extra_flops('moda', L, d, T) == 4 * T * d * (L - 1) * (L + d)
        for s in cost.ELEMENTWISE_SCHEMES:
            assert cost.extra_flops(s, L, d, T) == 0
    for L in (16, 20, 24, 28, 32):  # Block AttnRes with b = 2L/8, written out as in Appendix D
        b, T, d = 2 * L // 8, 4096, 1024
        assert cost.extra_flops('blockattnres', L, d, T) == 4 * T * d * (sum(2 + k // b for k in range(1, 2 * L)) + 9)
    # HC's m: 8m(m+2); mHC: 4m(m+1)(m+2)
    assert cost.extra_flops('hc', 3, 64, 5, hc_streams=2) == 8 * 2 * 4 * 5 * 64 * 3
    assert cost.extra_flops('mhc', 3, 64, 5, hc_streams=2) == 4 * 2 * 3 * 4 * 5 * 64 * 3


@pytest.mark.parametrize('L', [4, 8, 16, 32])
def test_blockattnres_sources(L):
    """The implemented source count (no empty partial sum at a boundary) vs Appendix D's:
    N - 1 fewer sources; one block per sublayer is Full AttnRes; one block reads only the
    embedding and the partial sum."""
    paper = cost.blockattnres_sources(L, 8)
    model = cost.blockattnres_sources(L, 8, appendix_d=False)
    assert len(paper) == len(model) == 2 * L and paper[-1] == model[-1] == 9
    assert sum(paper) - sum(model) == 8 - 1
    assert sum(cost.blockattnres_sources(L, 2 * L, appendix_d=False)) == L * (2 * L + 3)
    assert cost.blockattnres_sources(L, 1, appendix_d=False) == [2] * (2 * L - 1) + [2]
    d, T = 64, 16
    assert (cost.extra_flops('blockattnres', L, d, T) - cost.extra_flops('blockattnres', L, d, T, appendix_d=False)
            == 4 * T * d * 7)
    with pytest.raises(ValueError, match="divisible"):
        cost.blockattnres_sources(L, 2 * L - 1 if L > 1 else 3, appendix_d=False)


def test_forward_flops_conventions():
    L, d, T, V = 4, 64, 32, 100
    f = dict(n_head=4, vocab_size=V)
    base = cost.forward_flops(L, d, T, logits='last', attention='causal', **f)
    assert cost.forward_flops(L, d, T, logits='all', attention='causal', **f) - base == 2 * (T - 1) * d * V
    assert cost.forward_flops(L, d, T, logits='last', attention='full', **f) - base == L * 2 * T * T * d
    # GQA with 1 KV head: the k, v projections shrink from 2·2Td² to 2·2Td·hd per layer
    mqa = cost.forward_flops(L, d, T, n_head=4, n_kv_head=1, vocab_size=V)
    assert base - mqa == L * 4 * T * d * (d - d // 4)
    with pytest.raises(ValueError, match="logits"):
        cost.forward_flops(L, d, T, logits='first')
    with pytest.raises(ValueError, match="attention"):
        cost.forward_flops(L, d, T, attention='sliding')
    with pytest.raises(ValueError, match="unknown residual"):
        cost.forward_flops(L, d, T, residual='nope')
    with pytest.raises(ValueError, match="n_kv_head"):
        cost.forward_flops(L, d, T, n_head=4, n_kv_head=3)

# -----------------------------------------------------------------------------
# parameters


@pytest.mark.parametrize('scheme', SCHEMES)
@pytest.mark.parametrize('shape', TINY + [dict(n_layer=4, n_embd=16, n_head=2, vocab_size=11)],
                         ids=TINY_IDS + ['d16-V11'])
def test_param_count_matches_model(scheme, shape):
    cfg = config(scheme, **shape)
    with torch.device('meta'):
        model = GPT(cfg)
    assert cost.param_count(cfg) == model.num_params()


def test_param_count_preln_table3():
    """Paper Sec. 2.2 / Table 3: L=24, d=1024 -> 405.41M total."""
    assert round(cost.param_count(GPTConfig(n_layer=24, n_embd=1024)) / 1e6, 2) == 405.41
    with pytest.raises(ValueError, match="no closed form"):
        cost.param_count(GPTConfig(n_layer=2, n_embd=64, residual='nope'))

# -----------------------------------------------------------------------------
# a scheme without closed forms: counted parameters and measured ΔF


@pytest.fixture
def renamed(monkeypatch):
    """registers an unchanged subclass of a scheme under a name cost.py has no closed form
    for, so that its counts go through the fallback; returns the new name"""
    def register(scheme):
        name = f"renamed_{scheme}"
        monkeypatch.setitem(RESIDUALS, name, type(f"Renamed{RESIDUALS[scheme].__name__}", (RESIDUALS[scheme],), {}))
        return name
    return register


# ΔF terms the fallback cannot see: products written as broadcast multiply-and-sum (HC/mHC's
# write beta ⊗ f); the plain depth reads of residuals.py are matmuls and einsums
UNSEEN = {'hc': ('write',), 'mhc': ('write',)}


@pytest.mark.parametrize('scheme', SCHEMES)
@pytest.mark.parametrize('shape', [TINY[0], TINY[2]], ids=[TINY_IDS[0], TINY_IDS[2]])
def test_fallback_equals_the_closed_form(scheme, shape, renamed):
    """The fallback of a scheme without closed forms, applied to a registered scheme:
    the counted parameters equal its closed form, and the measured ΔF equals its closed
    form where the extra work is all matrix products: Full and Block AttnRes and MoDA (their
    plain reads are matmuls and einsums), 0 for the norm-and-gain schemes; HC's and mHC's
    less their write, an outer product the counter does not see."""
    if scheme == 'blockattnres' and shape is TINY[0]:
        shape = dict(shape, n_layer=8)  # 2L divisible by the 8 blocks, as the model needs
    new = renamed(scheme)
    cfg, ref = config(new, **shape), config(scheme, **shape)
    assert new not in cost.STUDY_SCHEMES + cost.EXTRA_SCHEMES
    assert cost.param_count(cfg) == cost.param_count(ref)
    T = 16
    kw = dict(n_head=cfg.n_head, n_kv_head=cfg.n_kv_head, ffn_hidden=cfg.ffn_hidden, hc_streams=cfg.hc_streams,
              attnres_blocks=cfg.attnres_blocks)
    terms = cost.extra_flop_terms(scheme, cfg.n_layer, cfg.n_embd, T, appendix_d=False, **kw)
    seen = sum(v for k, v in terms.items() if k not in UNSEEN.get(scheme, ()))
    assert cost.extra_flop_terms(new, cfg.n_layer, cfg.n_embd, T, **kw) == {'measured': seen}
    assert cost.config_flops(cfg, T) - cost.config_flops(config('preln', **shape), T) == seen
    if scheme in ('attnres', 'moda'):
        assert seen > 0 and seen == cost.extra_flops(scheme, cfg.n_layer, cfg.n_embd, T, **kw)


def test_fallback_refuses_an_unregistered_scheme():
    with pytest.raises(ValueError, match="not registered"):
        cost.param_count(GPTConfig(n_layer=2, n_embd=64, residual='nope'))
    with pytest.raises(ValueError, match="RESIDUALS"):
        cost.extra_flops('nope', 2, 64, 16)


def test_cli_takes_a_scheme_without_closed_forms(renamed, tmp_path, capsys):
    new = renamed('attnres')
    assert cost.main([f'--schemes=preln,attnres,{new}', '--shapes=2x64', '--seq_len=32', f'--out={tmp_path}']) == 0
    rows = {r['scheme']: r for r in json.loads((tmp_path / 'cost.json').read_text())['rows']}
    assert {k: rows[new][k] for k in ('params', 'flops', 'extra_flops')} == \
        {k: rows['attnres'][k] for k in ('params', 'flops', 'extra_flops')}


# -----------------------------------------------------------------------------
# KV cache


def test_kv_cache_mha_and_gqa():
    L, d, T = 28, 2048, 2048  # the 1.6B shape: 16 query heads of 128
    mha = cost.kv_cache_bytes(L, d, T, n_head=16)
    gqa = cost.kv_cache_bytes(L, d, T, n_head=16, n_kv_head=8)
    assert mha == 2 * L * T * d * 2
    assert gqa * 2 == mha and gqa == 2 * L * T * 8 * 128 * 2
    assert cost.kv_cache_bytes(L, d, T, n_head=16, batch=8, bytes_per_elem=4) == 16 * mha
    # the cache is the same for every scheme (tests/test_kv_cache.py measures it); MoDA's
    # prefill also holds a depth buffer (2L slots of K and V per token), 2x the sequence cache
    assert all(cost.kv_cache_bytes(L, d, T, residual=r) == mha for r in ('moda', 'attnres', 'hc'))
    assert cost.kv_cache_bytes(L, d, T, residual='moda', prefill=True) == 3 * mha
    assert cost.kv_cache_bytes(L, d, T, residual='attnres', prefill=True) == mha


def test_kv_cache_at_fixed_backbone_grows_with_L_times_d():
    """At fixed L·d² (fixed backbone) the KV cache is ∝ L·d = sqrt(L · L·d²), i.e. ∝ sqrt(L)."""
    T = 4096
    shapes = [(4, 2048), (16, 1024), (64, 512), (256, 256)]  # L·d² = 16 Mi for all
    assert len({L * d * d for L, d in shapes}) == 1
    kv = [cost.kv_cache_bytes(L, d, T) for L, d in shapes]
    for (L0, d0), k0 in zip(shapes, kv):
        for (L1, d1), k1 in zip(shapes, kv):
            assert k1 / k0 == pytest.approx(L1 * d1 / (L0 * d0)) == pytest.approx(math.sqrt(L1 / L0))

# -----------------------------------------------------------------------------
# the study's numbers (Sec. 4.4, Fig. 11; docs/cost.md)


def test_study_prefill_numbers():
    """Prefill 4096, causal, LM head on the last position: Full AttnRes 2.99 T -> 4.43 T
    (4.33 T Pre-LN + 0.105 T), "3.0 -> 4.4 TFLOPs"; KV cache 319 MB -> 734 MB."""
    T = 4096
    f16 = cost.forward_flops(16, 1216, T, residual='attnres')
    f70 = cost.forward_flops(70, 640, T, residual='attnres')
    assert round(f16 / 1e12, 2) == 2.99 and round(f70 / 1e12, 2) == 4.43
    assert round(f16 / 1e12, 1) == 3.0 and round(f70 / 1e12, 1) == 4.4
    assert round(cost.forward_flops(70, 640, T) / 1e12, 2) == 4.33
    assert round(cost.extra_flops('attnres', 70, 640, T) / 1e12, 3) == 0.105
    assert round(cost.kv_cache_bytes(16, 1216, T) / 1e6) == 319
    assert round(cost.kv_cache_bytes(70, 640, T) / 1e6) == 734
    # the other conventions miss the site's values (docs/cost.md: only causal attention with a
    # last-position head reproduces them)
    assert round(cost.forward_flops(16, 1216, T, residual='attnres', logits='all') / 1e12, 1) != 3.0
    assert round(cost.forward_flops(16, 1216, T, residual='attnres', attention='full') / 1e12, 1) != 3.0

# -----------------------------------------------------------------------------
# CLI and measurement


def test_cli_table_json_figure_and_loss_panel(tmp_path, capsys):
    results = tmp_path / 'results.json'
    results.write_text(json.dumps([dict(scheme='attnres', n_layer=16, n_embd=1216, val_loss=2.751),
                                   dict(scheme='attnres', n_layer=32, n_embd=896, val_loss=2.718)]))
    out = tmp_path / 'cost'
    rc = cost.main(['--schemes=preln,attnres,hc', '--shapes=16x1216,70x640', f'--results={results}', f'--out={out}'])
    assert rc == 0
    text = capsys.readouterr().out
    assert '| attnres | 16 | 1216 | 76.00 |' in text and '| 2.99 |' in text and '| 4.43 |' in text
    pivot = f"| 16 | 1216 | 76.00 | {design_flops(16, 1216) / 1e12:.3f} | {design_flops(16, 1216, 'attnres') / 1e12:.3f} |"
    assert pivot in text and text.rstrip().count('| 319 |') == 4  # 3 table rows + the pivot's KV column
    data = json.loads((out / 'cost.json').read_text())
    rows = {(r['scheme'], r['L']): r for r in data['rows']}
    assert len(rows) == 6 and rows[('preln', 70)]['kv_bytes'] == cost.kv_cache_bytes(70, 640, 4096)
    assert rows[('hc', 16)]['params'] == cost.param_count(GPTConfig(n_layer=16, n_embd=1216, residual='hc'))
    assert (out / 'cost.png').stat().st_size > 0
    assert cost.read_losses(str(results)) == {('attnres', 16, 1216): 2.751, ('attnres', 32, 896): 2.718}


def test_cli_errors(tmp_path, capsys):
    assert cost.main(['--schemes=preln,nope', f'--out={tmp_path}']) == 1
    assert 'unknown scheme nope' in capsys.readouterr().err
    assert cost.main(['--shapes=16by1216', f'--out={tmp_path}']) == 1
    assert '--shapes' in capsys.readouterr().err
    for bad in ('16x100x3', '16x', '0x64', '16x-2'):  # three parts was an unpacking error
        assert cost.main([f'--shapes={bad}', f'--out={tmp_path}']) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"'{bad}' is not an LxD pair" in err, err
    assert cost._parse_shapes('16x1216, 32X896,') == [(16, 1216), (32, 896)]
    assert cost.main(['--results=/nonexistent/results.json', f'--out={tmp_path}']) == 1
    assert 'not found' in capsys.readouterr().err
    with pytest.raises(ValueError, match="RESIDUALS"):
        cost.measure_prefill(['nope'], [(2, 64)], device='cpu')


def test_measure_prefill_cpu():
    """A tiny prefill in a fresh subprocess: positive latency, throughput, peak memory."""
    B, T = 1, 32
    rows = cost.measure_prefill(['preln'], [(2, 64)], batch=B, seq_len=T, device='cpu', warmup=1, iters=2,
                                vocab_size=1000, n_head=4)
    assert len(rows) == 1
    r = rows[0]
    assert (r['scheme'], r['L'], r['d'], r['dtype']) == ('preln', 2, 64, 'float32')
    assert len(r['times_s']) == 2 and r['latency_s'] > 0
    assert r['tokens_per_s'] == pytest.approx(B * T / r['latency_s'])
    assert r['hours_per_1B'] == pytest.approx(r['latency_s'] / (B * T) * 1e9 / 3600)
    # the fp32 weights alone are resident while the passes run
    assert r['peak_mem_bytes'] >= 4 * r['params']


def test_plot_gives_each_scheme_one_colour_in_every_panel(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt
    figs = []
    monkeypatch.setattr(plt, 'close', figs.append)  # keep the figure to inspect it
    rows = [dict(scheme=s, ratio=r, L=L, d=d, flops=1e12 * L, kv_bytes=1e6 * L)
            for s in ('preln', 'sandwich', 'hc') for r, L, d in ((64, 4, 256), (16, 8, 128))]
    losses = {(s, L, d): 3.0 for s in ('preln', 'hc') for L, d in ((4, 256), (8, 128))}  # no sandwich loss
    cost.plot(rows, tmp_path / 'c.png', losses)
    colour = {}
    for ax in figs[0].axes:
        for line in ax.get_lines():  # the loss panel lacks sandwich: its own colour cycle would shift hc
            assert colour.setdefault(line.get_label(), line.get_color()) == line.get_color(), line.get_label()
    assert len(colour) == 3 and len(set(colour.values())) == 3


def test_plot_has_no_empty_panel_and_shows_the_timing_spread(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt
    figs = []
    monkeypatch.setattr(plt, 'close', figs.append)
    rows = [dict(scheme='preln', ratio=r, L=L, d=d, flops=1e12 * L, kv_bytes=1e6 * L, latency_s=2.0,
                 times_s=[1.0, 2.0, 4.0], hours_per_1B=10.0, peak_mem_bytes=None)
            for r, L, d in ((64, 4, 256), (16, 8, 128))]
    cost.plot(rows, tmp_path / 'c.png', {('preln', 99, 1): 3.0})  # losses of no plotted shape, no memory
    axes = [ax for ax in figs[0].axes if ax.get_visible()]
    assert [ax.get_ylabel() for ax in axes] == ['prefill TFLOPs / sequence', 'KV cache (MB)',
                                                'device-hours / 1B prefill tokens']
    hours = axes[2]
    (bars,) = [c for c in hours.collections]  # the min..max bars of the 3 passes: 5 .. 20 hours
    segs = bars.get_segments()
    assert [tuple(seg[:, 1]) for seg in segs] == [(5.0, 20.0), (5.0, 20.0)]
    assert '3 timed passes' in hours.get_title() and 'noisy' in hours.get_title()


@pytest.mark.parametrize('bad', ['not_python', 'directory', 'wrong_type'])
def test_memory_of_a_bad_config_is_one_error_line(bad, tmp_path, capsys):
    """cost.py --memory with a file that is not Python, a directory, or a config whose model
    setting has the wrong type: exit status 1 and one 'error:' line, no traceback."""
    import cost
    path = tmp_path / 'cfg.py'
    if bad == 'not_python':
        path.write_text('# DepthBench\nthis is prose, not a config\n')
    elif bad == 'directory':
        path = tmp_path
    else:
        path.write_text('n_layer = "a"\n')
    assert cost.main([f'--memory={path}']) == 1
    err = capsys.readouterr().err
    assert err.startswith('error: ') and err.count('\n') == 1, err


def test_memory_refuses_a_bad_budget_before_probing(tmp_path, capsys):
    import cost
    assert cost.main(['--memory=config/does_not_matter.py', '--budget_gib=-1']) == 1
    assert 'budget_gib=-1' in capsys.readouterr().err
