"""
Full and Block AttnRes (residuals.py AttnRes, BlockAttnRes, DepthMixer; paper Appendix A,
docs/schemes.md): the depth read z = sum_i a_i v_i, a = softmax_i(w . RMSNorm(v_i)) with
non-zero pseudo-queries, the skip rule against a loop over sublayers written from the
docstrings, Block AttnRes's block size and when it is another scheme, the eps of each norm,
the zero-query init (every read a mean, Pre-LN up to scale), fp32 partial sums, the probe
hooks (depth states, traces) and the init and eps of the study's code. CPU only, tiny shapes:

    python -m pytest tests/test_attnres.py -q
"""

import math

import pytest
import torch

import test_study_fidelity as fidelity
from model import GPT, GPTConfig
from multi_stream_models import make, max_rel, pair, perturb, tokens
from small_models import TINY, move_off_init, small_model, small_tokens, tiny
from test_study_fidelity import STUDY_RMS_DEFAULT, study_weights


# -----------------------------------------------------------------------------
# the depth read


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


# -----------------------------------------------------------------------------
# the skip rule, against a loop over sublayers written from the docstrings


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def depth_read(V, mixer, eps):
    """z = sum_i a_i v_i, a = softmax_i(w . RMSNorm_key(v_i)), one source at a time."""
    logits = torch.stack([(rms(v, mixer.key_norm.weight, eps) * mixer.query).sum(-1) for v in V])  # (n, B, T)
    a = torch.exp(logits - logits.max(0).values)
    a = a / a.sum(0)
    return sum(a[i].unsqueeze(-1) * v for i, v in enumerate(V))


def reference_attnres(model, idx, skip):
    """Full AttnRes from its docstring: sources v_0 = embedding, then every sublayer's output;
    a skipped block adds no source and the next read is the newest source itself. Returns the
    raw mix after each block (L of (B, T, d))."""
    cfg, res, T = model.config, model.residual, idx.size(1)
    rope, eps = (model.rope_cos[:T], model.rope_sin[:T]), cfg.attnres_eps
    V = [model.wte(idx)]
    mix, mixes = V[0], []
    for b in range(cfg.n_layer):
        p, blk = res.layers[b], model.blocks[b]
        if b in skip:
            mix = V[-1]
        else:
            V.append(blk.attn(rms(mix, p.attn_norm.weight, cfg.norm_eps if len(V) == 1 else eps), rope))
            V.append(blk.mlp(rms(depth_read(V, p.mlp_mix, eps), p.mlp_norm.weight, eps)))
            mix = depth_read(V, p.out_mix, eps)
        mixes.append(mix)
    return mixes


def reference_block_attnres(model, idx, skip, boundary=None):
    """Block AttnRes from its docstring, one sublayer k at a time: at a boundary, k % S == 0
    (k > 0) or `boundary(k)` if given, the running sum P is frozen as a source before the
    read; a skipped block adds nothing, still freezes P at a boundary inside it, and if the
    next read is a boundary it is the newest source itself. Returns the raw mix after each block."""
    cfg, res, T = model.config, model.residual, idx.size(1)
    rope, eps, S = (model.rope_cos[:T], model.rope_sin[:T]), cfg.attnres_eps, res.group_size
    src, P, mixes = [model.wte(idx)], [None], []
    at = boundary or (lambda k: k % S == 0)

    def freeze(k):
        if at(k) and P[0] is not None:
            src.append(P[0])
            P[0] = None

    def bank():
        return src + ([P[0]] if P[0] is not None else [])

    def add(f):
        P[0] = f if P[0] is None else P[0] + f

    mix = src[0]
    for b in range(cfg.n_layer):
        p, blk, k = res.layers[b], model.blocks[b], 2 * b
        if b in skip:
            freeze(k + 1)
            if at(k + 2):
                freeze(k + 2)
                mix = src[-1]
            else:
                mix = depth_read(bank(), p.out_mix, eps)
        else:
            first = len(src) == 1 and P[0] is None
            add(blk.attn(rms(mix, p.attn_norm.weight, cfg.norm_eps if first else eps), rope))
            freeze(k + 1)
            add(blk.mlp(rms(depth_read(bank(), p.mlp_mix, eps), p.mlp_norm.weight, eps)))
            freeze(k + 2)
            mix = depth_read(bank(), p.out_mix, eps)
        mixes.append(mix)
    return mixes


SKIPS = [(), (0,), (1,), (2,), (0, 2), (0, 1, 2)]


@pytest.mark.parametrize('residual,blocks', [('attnres', 8), ('blockattnres', 2), ('blockattnres', 3)])
@torch.no_grad()
def test_attnres_skip_rule_against_a_loop_over_sublayers(residual, blocks):
    """Every single skip and two multiple ones; Block AttnRes with S = 3 (a boundary inside a
    skipped block) and S = 2 (boundaries at every block's attention)."""
    model = move_off_init(small_model(residual, attnres_blocks=blocks))
    ref = reference_block_attnres if residual == 'blockattnres' else reference_attnres
    idx = small_tokens()
    for skip in SKIPS:
        rec = []
        h = model.hidden(idx, skip=set(skip), record=rec)
        want = ref(model, idx, set(skip))
        for b, (got, exp) in enumerate(zip([lens for _, lens in rec[1:]], want)):
            torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-5, msg=f"skip {skip}, after block {b}")
        torch.testing.assert_close(h, want[-1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(model.hidden(idx, skip={1}), model.hidden(idx, order=(0, 2)), atol=1e-4)


@torch.no_grad()
def test_a_boundary_edit_moves_the_read_and_the_skip_rule_together(monkeypatch):
    """A student's edit of BlockAttnRes.boundary, the one place of the rule: uneven blocks,
    boundaries at sublayers 1, 4 and 5 of 6. The forward (read_at) and every skip (the probes'
    skip rule) follow the edited rule, against the loop over sublayers with the same rule;
    the model before the edit (blocks of 2) computes something else."""
    model = move_off_init(small_model('blockattnres', attnres_blocks=3))
    idx = small_tokens()
    before = model.hidden(idx)
    rule = lambda k: k in (1, 4, 5)  # noqa: E731
    monkeypatch.setattr(type(model.residual), 'boundary', lambda self, k: rule(k))
    for skip in SKIPS:
        rec = []
        h = model.hidden(idx, skip=set(skip), record=rec)
        want = reference_block_attnres(model, idx, set(skip), boundary=rule)
        for b, (got, exp) in enumerate(zip([lens for _, lens in rec[1:]], want)):
            torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-5, msg=f"skip {skip}, after block {b}")
        torch.testing.assert_close(h, want[-1], rtol=1e-5, atol=1e-5)
    assert max_rel(model.hidden(idx), before) > 1e-2


# -----------------------------------------------------------------------------
# Block AttnRes: the block size, and when it is another scheme


def test_blockattnres_block_size():
    assert make('blockattnres', n_layer=4, attnres_blocks=2).residual.group_size == 4
    assert make('blockattnres', n_layer=2).residual.group_size == 1  # 2L = 4 < 8 blocks: S = 1
    with pytest.raises(ValueError, match='attnres_blocks'):
        make('blockattnres', n_layer=3, attnres_blocks=4)  # 6 sublayers in 4 blocks


@torch.no_grad()
def test_blockattnres_block_size_one_is_full_attnres():
    full = make('attnres')
    perturb(full)  # random non-zero queries and key gains
    block = make('blockattnres', attnres_blocks=8, seed=5)  # 2L = 8 sublayers: S = 1
    assert block.residual.group_size == 1
    block.load_state_dict(full.state_dict())  # same parameter layout
    idx = tokens()
    for kw in [{}, {'skip': (0,)}, {'skip': (2,)}, {'order': [2, 0, 3, 1]}, {'order': [0, 1, 3]}]:
        torch.testing.assert_close(block(idx, **kw)[0], full(idx, **kw)[0], rtol=0, atol=1e-6)
    with block.residual.trace() as tb, full.residual.trace() as tf:
        block(idx), full(idx)
    assert len(tb) == len(tf) == 8
    for a, b in zip(tb, tf):
        assert (a['block'], a['sublayer']) == (b['block'], b['sublayer'])
        torch.testing.assert_close(a['weights'], b['weights'])
    # ... while S = 2 is a different model with the same weights (the test can fail)
    other = make('blockattnres', attnres_blocks=4)
    other.load_state_dict(full.state_dict())
    assert max_rel(other(idx)[0], full(idx)[0]) > 1e-3


@pytest.mark.parametrize('n_layer,blocks,says', [
    (4, 8, 'and 2L = 8 sublayers is Full AttnRes'),   # the CPU config's 4 layers with the default 8 blocks
    (2, 8, 'and 2L = 4 sublayers is Full AttnRes'),   # fewer sublayers than blocks: S = 1 too
    (4, 1, 'one block holds all 8 sublayers'),
    (4, 4, 'Block AttnRes: 4 blocks of 2 sublayers'), (4, 2, 'Block AttnRes: 2 blocks of 4 sublayers'),
    (6, 4, 'Block AttnRes: 4 blocks of 3 sublayers')])
def test_blockattnres_says_its_block_size_and_when_it_is_another_scheme(n_layer, blocks, says):
    """The start-up note (train.py prints `notes()`): the block size, and that Block AttnRes
    with one sublayer per block is Full AttnRes (test_blockattnres_block_size_one_is_full_attnres),
    and one block holding every sublayer reads only the embedding and the running sum."""
    notes = make('blockattnres', n_layer=n_layer, attnres_blocks=blocks).residual.notes()
    assert len(notes) == 1 and says in notes[0] and f"attnres_blocks={blocks}" in notes[0], notes
    assert make('attnres').residual.notes() == [] and make('hc').residual.notes() == []


@pytest.mark.parametrize('residual', ['attnres', 'blockattnres'])
@torch.no_grad()
def test_attnres_norms_hold_the_eps_they_are_used_with(residual):
    """Each pre-norm's eps, as printed, is the eps it runs with: mlp_norm attnres_eps,
    attn_norm norm_eps in block 0 (it reads the embedding alone) and attnres_eps after."""
    model = make(residual, attnres_eps=0.1)  # large: the eps moves the output
    layers = model.residual.layers
    assert [p.attn_norm.eps for p in layers] == [1e-6, 0.1, 0.1, 0.1]
    assert [p.mlp_norm.eps for p in layers] == [0.1] * 4
    assert 'RMSNorm(64, eps=0.1)' in repr(layers[1].mlp_norm)
    perturb(model)
    idx = tokens()
    before = model(idx)[0]
    for p in layers:
        p.mlp_norm.eps = 1e-6
    assert max_rel(model(idx)[0], before) > 1e-3  # the module's eps is the one used


# -----------------------------------------------------------------------------
# init: zero pseudo-queries make every read a mean of its sources


def test_attnres_zero_init_equals_preln():
    """Paper Appendix A, docs/schemes.md: with all pseudo-queries zero every read is the mean of its sources, whose
    RMSNorm equals Pre-LN's residual stream's, so logits match Pre-LN with the same weights
    (up to eps, which we make negligible)."""
    torch.manual_seed(0)
    pre = GPT(GPTConfig(norm_eps=1e-12, **TINY))
    att = GPT(GPTConfig(norm_eps=1e-12, attnres_eps=1e-12, residual='attnres', **TINY))
    missing, unexpected = att.load_state_dict(pre.state_dict(), strict=False)
    assert not unexpected and all('_mix.' in k for k in missing)
    with torch.no_grad():  # non-trivial norm gains, to check they are the shared pre-norms
        for n, p in pre.named_parameters():
            if n.endswith('norm.weight'):
                p.uniform_(0.5, 1.5)
        att.load_state_dict(pre.state_dict(), strict=False)
    idx = torch.randint(0, 101, (2, 32))
    torch.testing.assert_close(att(idx)[0], pre(idx)[0], rtol=1e-4, atol=1e-5)
    # and it is a real identity: a non-zero query changes the output
    with torch.no_grad():
        att.residual.layers[1].mlp_mix.query.normal_()
    assert (att(idx)[0] - pre(idx)[0]).abs().max() > 1e-3


def test_attnres_queries_survive_reinit():
    """A second init pass must not destroy the zero queries (docs/schemes.md)."""
    m = GPT(GPTConfig(residual='attnres', **TINY))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
    m.init_weights()
    for layer in m.residual.layers:
        assert layer.mlp_mix.query.abs().sum() == 0 and layer.out_mix.query.abs().sum() == 0
    assert m.num_params() - GPT(GPTConfig(**TINY)).num_params() == 4 * TINY['n_layer'] * TINY['n_embd']


@pytest.mark.parametrize('blocks', [1, 2, 4])
@torch.no_grad()
def test_blockattnres_zero_queries_equal_preln(blocks):
    model, pre = pair('blockattnres', attnres_blocks=blocks)  # S = 8, 4, 2 sublayers
    idx = tokens()
    # every read is the mean of its sources, whose sum is Pre-LN's residual stream
    torch.testing.assert_close(model(idx)[0], pre(idx)[0], rtol=1e-5, atol=1e-5)


# -----------------------------------------------------------------------------
# precision


@torch.no_grad()
def test_blockattnres_partial_sums_accumulate_in_fp32_under_autocast():
    """docs/fidelity.md: AttnRes partial sums stay fp32. Under bf16 autocast every sublayer
    output is bf16; the running partial sum P and the frozen block sums are fp32, each the fp32
    sum of its block's outputs (S = 4 here: P = f_0 + f_1 after block 0, frozen as
    f_0 + .. + f_3 at k = 4, restarted as f_4 + f_5). Summed in bf16 they would be rounded
    to 8 bits at every addition."""
    model = make('blockattnres', attnres_blocks=2)  # 8 sublayers, blocks of 4
    perturb(model)
    outs = []
    for blk in model.blocks:
        for branch in (blk.attn, blk.mlp):
            branch.register_forward_hook(lambda mod, args, out: outs.append(out))
    res, idx = model.residual, tokens()
    rope = (model.rope_cos[:idx.size(1)], model.rope_sin[:idx.size(1)])
    with torch.autocast('cpu', dtype=torch.bfloat16):
        state = res.begin(model.wte(idx))
        states = []
        for b in range(4):
            state = res.block(state, b, model.blocks[b], rope)
            states.append(state)
    assert len(outs) == 8 and all(f.dtype == torch.bfloat16 for f in outs)
    f = [o.float() for o in outs]
    for st in states:
        assert all(v.dtype == torch.float32 for v in st.sources) and st.mix.dtype == torch.float32
        assert st.partial is None or st.partial.dtype == torch.float32
    assert len(states[0].sources) == 1 and states[1].partial is None and len(states[3].sources) == 3
    torch.testing.assert_close(states[0].partial, f[0] + f[1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(states[1].sources[1], f[0] + f[1] + f[2] + f[3], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(states[2].partial, f[4] + f[5], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(states[3].sources[2], f[4] + f[5] + f[6] + f[7], rtol=1e-6, atol=1e-6)


# -----------------------------------------------------------------------------
# probe hooks: depth states, the next-output rule, traces


@torch.no_grad()
def test_blockattnres_probe_states_and_next_output_rule():
    model = make('blockattnres', attnres_blocks=4)  # S = 2: every attention read is a boundary
    idx = tokens()
    x = model.wte(idx)
    rec = []
    model.hidden(idx, skip=(1,), record=rec)
    torch.testing.assert_close(rec[0][0], x)
    # after block 0 the attention read (k = 2) is a boundary: probe = lens = mean(v_0, P_0) at zero queries
    torch.testing.assert_close(rec[1][0], rec[1][1], rtol=0, atol=0)
    block0 = 2 * rec[1][1] - x                                  # P_0 = f_0 + f_1
    # block 1 skipped, the next read (k = 4) is a boundary: identity on the newest source P_0
    torch.testing.assert_close(rec[2][0], block0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rec[2][1], rec[2][0], rtol=0, atol=0)

    model = make('blockattnres', attnres_blocks=2)  # S = 4: block 1's attention read (k = 2) is inside a block
    rec = []
    model.hidden(idx, record=rec)
    mix1, partial1 = rec[1][1], rec[1][0]
    # probe = the running partial sum, lens = the mix of [v_0, P] = (v_0 + P) / 2 at zero queries
    torch.testing.assert_close(mix1, (x + partial1) / 2, rtol=1e-5, atol=1e-5)
    assert (partial1 - mix1).abs().max() > 1e-3
    torch.testing.assert_close(rec[2][0], rec[2][1], rtol=0, atol=0)  # k = 4: a boundary


@pytest.mark.parametrize('blocks', [8, 4, 2])
@torch.no_grad()
def test_blockattnres_trace_follows_the_boundary_rule(blocks):
    L = 4
    model = make('blockattnres', n_layer=L, attnres_blocks=blocks)
    S = 2 * L // blocks
    with model.residual.trace() as tape:
        model(tokens())
    # reads k = 1 .. 2L (k = 2L: the final aggregator, recorded as block L, sublayer 0)
    assert [(r['block'], r['sublayer']) for r in tape] == [(k // 2, k % 2) for k in range(1, 2 * L + 1)]
    for k, r in zip(range(1, 2 * L + 1), tape):
        n = 1 + k // S + (k % S != 0)  # embedding, frozen blocks, the running partial sum
        assert r['weights'].shape == (n, 2, 16)
        assert int(r['current']) == (n - 1 if k % S else -1)
        torch.testing.assert_close(r['weights'], torch.full_like(r['weights'], 1 / n))  # zero queries


# -----------------------------------------------------------------------------
# fidelity to the study's code (tests/test_study_fidelity.py holds its transcription)


@pytest.mark.parametrize('scheme', ('attnres', 'blockattnres'))
def test_attnres_init_and_eps(scheme):
    """Zero pseudo-queries, unit key gains (the blocks' nn.init.zeros_ and RMSNorm ones);
    the eps of the depth reads is OLMo-core's RMSNorm default 1e-5, block 0's attention
    norm keeps the configs' 1e-6."""
    model = fidelity.make(scheme)
    W = study_weights(model)
    for s, p in W.items():
        if s.endswith('res_proj.weight'):
            assert not p.any()
        if s.endswith('res_norm.weight'):
            assert torch.equal(p, torch.ones_like(p))
    assert model.config.attnres_eps == STUDY_RMS_DEFAULT and model.config.norm_eps == fidelity.EPS
    assert all(layer.mlp_mix.key_norm.eps == STUDY_RMS_DEFAULT for layer in model.residual.layers)
