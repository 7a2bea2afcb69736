"""
Tests of the memory-lean AttnRes depth mixing (ops.DepthMixFunction behind
ops.depth_mix) and of bench.py: exact gradients against the plain autograd
formula (depth_mix_reference), the saved-activation memory of Full AttnRes against
Pre-LN (a check the stacked formula fails), and bench.py's PlainGPT as a fair plain
reference (same parameters as Pre-LN, same loss for the same weights).
Run: python -m pytest tests/test_fast_mix.py -q
"""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench  # noqa: E402
import residuals  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from compile_check import assert_compiled_matches_eager  # noqa: E402
from ops import DepthMixFunction, depth_mix, depth_mix_reference  # noqa: E402


def mix_inputs(n, B, T, d, dtype=torch.float64, seed=0, src_dtypes=None):
    """n sources (B, T, d), their 1/rms (B, T, 1) perturbed so that gradients into them
    matter, a nonzero query and a non-unit key gain; all require grad."""
    g = torch.Generator().manual_seed(seed)
    src_dtypes = src_dtypes or [dtype] * n
    sources = [torch.randn(B, T, d, generator=g, dtype=torch.float64).to(dt).requires_grad_() for dt in src_dtypes]
    inv = [(torch.rand(B, T, 1, generator=g, dtype=torch.float64) + 0.5).to(torch.promote_types(dtype, torch.float32))
           .requires_grad_() for _ in range(n)]
    query = (0.5 * torch.randn(d, generator=g, dtype=torch.float64)).to(torch.promote_types(dtype, torch.float32))
    gain = (1 + 0.3 * torch.randn(d, generator=g, dtype=torch.float64)).to(query.dtype)
    return sources, inv, query.requires_grad_(), gain.requires_grad_()


def grads(fn, sources, inv, query, gain, weight_a=True):
    """(z, a, gradients of every input) of a scalar loss that uses both outputs."""
    for t in [*sources, *inv, query, gain]:
        t.grad = None
    z, a = fn(sources, inv, query, gain)
    n = a.size(0)
    loss = (z.double() * torch.linspace(-1, 1, z.size(-1), dtype=torch.float64)).square().sum()
    if weight_a:  # a gradient into the weights too
        loss = loss + (a.double() * torch.arange(1, n + 1, dtype=torch.float64).view(n, 1, 1)).sum()
    loss.backward()
    return [z.detach(), a.detach()] + [t.grad.detach().clone() for t in [*sources, *inv, query, gain]]


# -----------------------------------------------------------------------------
# the custom Function against the plain formula


def test_gradcheck_float64(read_form):
    sources, inv, query, gain = mix_inputs(n=3, B=2, T=3, d=4)
    fn = lambda q, g, *t: DepthMixFunction.apply(q, g, *t)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (query, gain, *sources, *inv))


def test_gradcheck_float64_partial_requires_grad(read_form):
    """Sources that need no gradient (e.g. a frozen embedding) get none; the rest stay exact."""
    sources, inv, query, gain = mix_inputs(n=4, B=1, T=2, d=3, seed=1)
    sources[0].requires_grad_(False)
    inv[2].requires_grad_(False)
    fn = lambda q, g, *t: DepthMixFunction.apply(q, g, *t)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (query, gain, *sources, *inv))


@pytest.mark.parametrize('n', [1, 2, 7])
def test_equals_reference_float64(n, read_form):
    inputs = mix_inputs(n=n, B=2, T=5, d=8, seed=n)
    fast, ref = grads(depth_mix, *inputs), grads(depth_mix_reference, *inputs)
    for got, want in zip(fast, ref):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert fast[1].shape == (n, 2, 5) and fast[1].dtype == torch.float64


def test_equals_reference_float32():
    inputs = mix_inputs(n=6, B=2, T=16, d=32, dtype=torch.float32, seed=3)
    fast, ref = grads(depth_mix, *inputs), grads(depth_mix_reference, *inputs)
    assert fast[0].dtype == torch.float32 and fast[1].dtype == torch.float32
    for got, want in zip(fast, ref):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_close_to_reference_bf16_autocast(read_form):
    """An fp32 embedding and bf16 sublayer outputs under CPU bf16 autocast, as in mixed
    precision training: both implementations agree to bf16 precision, and every gradient
    comes back in its input's dtype."""
    dts = [torch.float32] + [torch.bfloat16] * 5
    inputs = mix_inputs(n=6, B=2, T=16, d=32, dtype=torch.float32, seed=4, src_dtypes=dts)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        fast = grads(depth_mix, *inputs)
        ref = grads(depth_mix_reference, *inputs)
    sources, inv, query, gain = inputs
    for t, gr in zip([*sources, *inv, query, gain], fast[2:]):
        assert gr.dtype == t.dtype
    for got, want in zip(fast, ref):
        scale = want.float().abs().max()
        assert (got.float() - want.float()).abs().max() <= 3e-2 * scale + 1e-3


def test_mixing_is_a_softmax_average():
    """Independent of the reference: with w = 0 every weight is 1/n and z the mean of the
    sources; with one source z is that source."""
    sources, inv, query, gain = mix_inputs(n=5, B=2, T=3, d=4)
    z, a = depth_mix(sources, inv, torch.zeros_like(query), gain)
    torch.testing.assert_close(a, torch.full_like(a, 0.2))
    torch.testing.assert_close(z, torch.stack(sources).mean(0))
    z1, a1 = depth_mix(sources[:1], inv[:1], query, gain)
    torch.testing.assert_close(z1, sources[0])
    assert torch.equal(a1, torch.ones_like(a1))


def test_double_backward_raises():
    """The backward is written by hand: a second derivative must fail loudly, not be wrong."""
    sources, inv, query, gain = mix_inputs(n=2, B=1, T=2, d=4)
    z, _ = depth_mix(sources, inv, query, gain)
    (gq,) = torch.autograd.grad(z.square().sum(), query, create_graph=True)
    with pytest.raises(RuntimeError):
        gq.sum().backward()


def test_bad_arguments():
    sources, inv, query, gain = mix_inputs(n=2, B=1, T=2, d=4)
    with pytest.raises(ValueError, match='one 1/rms per source'):
        depth_mix(sources, inv[:1], query, gain)
    with pytest.raises(ValueError, match='at least one source'):
        depth_mix([], [], query, gain)
    for fn in (depth_mix, depth_mix_reference):  # shapes that do not fit, from both forms
        with pytest.raises(ValueError, match=r'1/rms 0 has shape \(1, 2\), expected \(1, 2, 1\)'):
            fn(sources, [t.squeeze(-1) for t in inv], query, gain)
        with pytest.raises(ValueError, match=r'source 1 has shape \(1, 2, 3\), expected \(1, 2, 4\)'):
            fn([sources[0], sources[1][..., :3]], inv, query, gain)
        with pytest.raises(ValueError, match=r'query has shape \(3,\), expected \(4,\)'):
            fn(sources, inv, query[:3], gain)
        with pytest.raises(ValueError, match='at least one source'):
            fn([], [], query, gain)


def saved_storages(fn, *args):
    """{data_ptr: nbytes} of the storages autograd saves while running fn(*args)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return seen, out


def test_one_read_saves_no_copy_of_the_sources():
    """Beyond references to its inputs, a read saves n numbers per token (fp32), not the
    (n, B, T, d) stack that the plain formula keeps."""
    n, B, T, d = 6, 2, 8, 32
    sources, inv, query, gain = mix_inputs(n=n, B=B, T=T, d=d, dtype=torch.float32)
    inputs = {t.untyped_storage().data_ptr() for t in [*sources, *inv, query, gain]}
    for fn, lo, hi in ((depth_mix, 0, n * B * T * 4), (depth_mix_reference, n * B * T * d * 4, None)):
        seen, _ = saved_storages(fn, sources, inv, query, gain)
        extra = sum(b for p, b in seen.items() if p not in inputs)
        assert extra >= lo and (hi is None or extra <= hi), (fn.__name__, extra)


# -----------------------------------------------------------------------------
# activation memory of whole models (bench.saved_activation_bytes)

MEM_SHAPE = dict(n_layer=8, n_embd=64, n_head=4, block_size=64, vocab_size=257)


def saved_mib(residual):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MEM_SHAPE, residual=residual))
    idx = torch.randint(0, 257, (2, 64))
    return bench.saved_activation_bytes(model, idx, idx) / 2**20


def test_attnres_activation_memory_near_preln(monkeypatch):
    """Full AttnRes at L=8 saves at most 1.2x Pre-LN's activation bytes; the stacked
    formula saves n copies per read and fails the same bound (so the check can fail)."""
    preln, fast = saved_mib('preln'), saved_mib('attnres')
    assert fast > preln            # the sources and their 1/rms do cost something
    assert fast <= 1.2 * preln
    reference = lambda s, i, q, g, route=None, routed=None: (  # noqa: E731
        depth_mix_reference(s, i, q, g) + ((route,) if route is not None else ()))
    monkeypatch.setattr(residuals, 'depth_mix', reference)
    stacked = saved_mib('attnres')
    assert stacked > 1.5 * preln


@pytest.mark.parametrize('residual,kw', [('attnres', {}), ('blockattnres', {'attnres_blocks': 2})])
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32], ids=['fp64', 'fp32'])
def test_eager_route_gives_autograds_gradients(residual, kw, dtype, monkeypatch):
    """Eagerly the AttnRes reads add their sources' gradients into one route buffer in
    place (ops.open_route with eager=True): the same loss and parameter gradients as
    autograd summing one gradient per (read, source) pair through DepthMixFunction
    (ops.UNROLL_DEPTH_READS: no route). fp64 runs the torch form, fp32 the fused kernels
    where they build. Under no_grad no route is opened."""
    import ops
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=3, n_embd=32, n_head=4, block_size=16, vocab_size=31, residual=residual, **kw)
    model = GPT(cfg).to(dtype)
    with torch.no_grad():
        for n, p in model.residual.named_parameters():
            if 'query' in n:
                p.normal_(0, 0.5)
    idx = torch.randint(0, 31, (2, 16))
    writes, apply = [], ops.RouteWrite.apply
    monkeypatch.setattr(ops.RouteWrite, 'apply', lambda *a: writes.append(a[1]) or apply(*a))

    def run(unroll):
        with monkeypatch.context() as m:
            m.setattr(ops, 'UNROLL_DEPTH_READS', unroll)
            model.zero_grad(set_to_none=True)
            loss = model(idx, idx)[1]
            loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]
    routed = run(False)
    assert writes == list(range(model.residual.route_slots()))  # every source went on its slot
    plain = run(True)
    assert len(writes) == model.residual.route_slots()  # none without a route
    # the 1/rms are fp32 even in an fp64 model (residuals.inv_rms): the route sums their
    # gradients over the reads in fp64 and rounds once, autograd rounds each read's
    tol = dict(rtol=1e-6, atol=1e-8) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-6)
    for got, want in zip(routed, plain):
        torch.testing.assert_close(got, want, **tol)
    with torch.no_grad():
        model(idx, idx)
    assert len(writes) == model.residual.route_slots()


def test_saved_activation_bytes_excludes_parameters():
    """A bare linear map saves only its input (the weight is a parameter): B*T*d*4 bytes."""
    lin = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    model = lambda idx, targets: (None, lin(idx).sum())  # noqa: E731
    model.parameters, model.buffers = lin.parameters, lin.buffers
    assert bench.saved_activation_bytes(model, x, None) == 4 * 16 * 4


# -----------------------------------------------------------------------------
# bench.py's plain baseline


@pytest.mark.parametrize('kw', [dict(n_layer=3, n_embd=64, n_head=4),
                                dict(n_layer=2, n_embd=64, n_head=8, n_kv_head=2, ffn_hidden=80)],
                         ids=['mha', 'gqa'])
def test_plain_gpt_is_preln(kw):
    """Same parameter count, and with Pre-LN's weights (every one perturbed, norms included)
    the same logits and loss."""
    cfg = GPTConfig(**kw, block_size=32, vocab_size=97)
    torch.manual_seed(0)
    gpt = GPT(cfg)
    with torch.no_grad():
        for p in gpt.parameters():
            p.add_(0.05 * torch.randn_like(p))
    plain = bench.PlainGPT(cfg)
    assert plain.num_params() == gpt.num_params()
    plain.load_state_dict(bench.plain_state_dict(gpt.state_dict()))  # strict: every tensor mapped
    idx = torch.randint(0, 97, (2, 32))
    logits, loss = gpt(idx, idx)
    logits_p, loss_p = plain(idx, idx)
    torch.testing.assert_close(logits_p, logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_p, loss, rtol=1e-6, atol=1e-6)
    assert plain.flops_per_token(32) == gpt.flops_per_token(32)


def test_plain_state_dict_rejects_other_schemes():
    gpt = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, block_size=8, vocab_size=11, residual='attnres'))
    with pytest.raises(KeyError, match='Pre-LN'):
        bench.plain_state_dict(gpt.state_dict())


# -----------------------------------------------------------------------------
# bench.py end to end (tiny, CPU)

TINY = ['--n_layer=2', '--n_embd=32', '--n_head=2', '--block_size=16', '--batch_size=2', '--device=cpu',
        '--warmup=1', '--steps=2', '--rounds=2', '--compile=False']


def test_bench_runs_and_writes_json(tmp_path, capsys):
    out = tmp_path / 'bench.json'
    rows = bench.main(['--schemes=attnres'] + TINY + [f'--out={out}'])
    byname = {r['name']: r for r in rows}
    assert list(byname) == ['preln', 'attnres', 'plain']          # Pre-LN added, plain always there
    assert byname['preln']['train_vs_preln'] == 1.0                # paired ratios against itself
    assert byname['plain']['params'] == byname['preln']['params']
    att = byname['attnres']
    L, d, T = 2, 32, 16
    from cost import forward_flops
    base = forward_flops(L, d, T, n_head=2, vocab_size=257, logits='all')
    assert att['delta_f_over_f'] == pytest.approx(4 * T * d * L * (2 * L + 3) / base)  # paper Appendix D
    assert att['target'] == 1.25                                   # a flat bound, no FLOP allowance
    assert att['pass_train'] == (att['train_vs_preln'] <= att['target'])
    assert byname['preln']['target'] == 1.0 and byname['preln']['target_vs'] == 'plain'
    assert bench.time_target('hc', 0.05) == 1.3                   # flat for the multi-stream schemes
    assert bench.time_target('moda', 0.128) == pytest.approx(1.128 * 1.10)  # ΔF/F allowance + 10%
    assert len(att['train_ms_rounds']) == 2 and all(t > 0 for t in att['train_ms_rounds'])
    assert att['mfu'] is None                                      # CPU: no peak, no MFU
    assert att['saved_bytes'] > byname['preln']['saved_bytes']
    saved = json.loads(out.read_text())
    assert saved['config']['schemes'] == 'attnres' and saved['rows'][1]['name'] == 'attnres'
    assert '2 rounds of 1 timed step,' in capsys.readouterr().out
    assert bench.schemes == 'preln,attnres'                        # defaults untouched


def test_bench_times_at_least_the_steps_asked_for():
    # 20 steps in 8 rounds: 3 per round (24), not 2 (16, fewer than asked)
    assert [bench.steps_per_round(s, r) for s, r in ((20, 8), (20, 10), (1, 5), (0, 5))] == [3, 2, 1, 0]


@pytest.mark.parametrize('arg, msg', [('--schemes=nope', 'unknown scheme'),
                                      ('--rounds=0', 'rounds=0 must be >= 1'),
                                      ('--steps=-1', 'steps=-1 must be >= 0'),
                                      ('--suite=gpu --gpu_steps=0', 'gpu_steps=0: time at least one step'),
                                      ('--threads=-2', 'threads=-2 must be >= 0'),
                                      ('--n_head=3', 'divisible'),
                                      ('--schemes=hc --hc_streams=0', 'hc_streams must be >= 1'),
                                      ('--schemes=blockattnres --attnres_blocks=3', 'divisible by attnres_blocks')])
def test_bench_user_errors(arg, msg):
    with pytest.raises(SystemExit) as e:
        bench.main(TINY + arg.split())
    assert msg in str(e.value) and str(e.value).startswith('error:')


def test_bench_verdicts_say_when_the_noise_leaves_them_open():
    """A ratio over its target by less than the row's noise is FAIL?, not FAIL."""
    def row(name, ratio, noise):
        return dict(name=name, params=1, delta_f_over_f=0.0, train_ms=1.0, train_vs_preln=ratio,
                    train_vs_plain=ratio, prefill_tokens_per_s=1.0, prefill_vs_preln=ratio, prefill_vs_plain=ratio,
                    saved_bytes=2**20, mem_vs_preln=1.0, mfu=None, target=1.25, target_vs='preln',
                    pass_train=ratio <= 1.25, pass_prefill=ratio <= 1.25,
                    train_ratio_noise=noise, prefill_ratio_noise=noise)
    table = bench.format_table([row('a', 1.20, 0.05), row('b', 1.30, 0.05), row('c', 1.40, 0.05)], 'cpu')
    verdicts = {line.split()[0]: line.split()[-2:] for line in table.splitlines()[2:5]}
    assert verdicts == {'a': ['PASS', 'PASS'], 'b': ['FAIL?', 'FAIL?'], 'c': ['FAIL', 'FAIL']}
    assert 'FAIL? = over its target by less than' in table


# -----------------------------------------------------------------------------


@pytest.mark.slow
def test_compiled_attnres_one_graph_same_gradients():
    """torch.compile of a whole AttnRes model traces the custom Function into one graph
    (no graph break, no recompile across the reads of different lengths) and gives the
    eager gradients."""
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=31, residual='attnres')
    torch.manual_seed(0)
    model = GPT(cfg)
    with torch.no_grad():
        for layer in model.residual.layers:
            layer.mlp_mix.query.normal_()
            layer.out_mix.query.normal_()
    assert_compiled_matches_eager(model, torch.randint(0, 31, (2, 16)))
