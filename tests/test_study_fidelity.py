"""
Our defaults against the study's released code (keyu-wang-2002/DepthBench, its OLMo-core
fork), scheme by scheme: docs/fidelity.md lists every difference and which form is default.

For each of the ten schemes this file holds a compact transcription of the study's forward
pass, written from its files (transformer/block.py and model.py: the blocks, the AttnRes
path and Transformer.forward's readout; nn/hyper_connections.py: HC and the mHC coefficient
formula of its Liger backend, which examples/pretrain_mhc.py selects; kernels/attnres.py:
the fused depth read; nn/moda.py: the depth cache), on plain tensors named as the study
names its parameters. `study_weights` maps our parameters onto those names (one to one:
every parameter of ours is used once), and the logits of both must agree to 1e-5 in fp32,
at init and with every parameter randomised. The weight-decay groups follow the study's
optimizer (examples/pretrain_llama_base.py: one AdamW, weight_decay 0.1 over all
parameters, minus the patterns of HyperConnectionsConfig.static_parameter_patterns). The
cases of one scheme (the HC/mHC init values and Sinkhorn, the AttnRes init and eps) are in
that scheme's file, tests/test_hyper_connections.py and tests/test_attnres.py, and use the
transcription here. CPU, tiny shapes, a few seconds:

    python -m pytest tests/test_study_fidelity.py -q
"""

import math
import re
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model import GPT, GPTConfig  # noqa: E402

TEN = ('preln', 'sandwich', 'lns', 'deepnorm', 'keel', 'hc', 'mhc', 'attnres', 'blockattnres', 'moda')
V, L, D, H, M = 64, 3, 32, 2, 4      # vocab, blocks, width, heads, HC/mHC streams
EPS, STUDY_RMS_DEFAULT = 1e-6, 1e-5  # layer_norm_eps of the study's configs; OLMo-core's RMSNorm default
TOL = 1e-5


def make(residual, seed=0, **kw):
    torch.manual_seed(seed)
    # 2L = 6 sublayers in 3 AttnRes blocks: S = 2, so Block AttnRes differs from Full AttnRes
    cfg = GPTConfig(vocab_size=V, block_size=16, n_layer=L, n_embd=D, n_head=H, norm_eps=EPS,
                    hc_streams=M, attnres_blocks=3, residual=residual, **kw)
    return GPT(cfg).eval()


def tokens(B=2, T=12, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def randomise(model, seed=5):
    """Moves every parameter off its init: matrices by 0.05, vectors and scalars by 0.3."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=g) * (0.05 if p.dim() >= 2 else 0.3))


# -----------------------------------------------------------------------------
# our parameters under the study's names

BACKBONE = {'attn.wq': 'attention.w_q', 'attn.wk': 'attention.w_k', 'attn.wv': 'attention.w_v',
            'attn.wo': 'attention.w_out', 'mlp.w_gate': 'feed_forward.w1', 'mlp.w_up': 'feed_forward.w3',
            'mlp.w_down': 'feed_forward.w2'}
NORMS = {'attn_norm': 'attention_norm', 'mlp_norm': 'feed_forward_norm',   # pre-norms
         'attn_out_norm': 'post_attention_norm', 'mlp_out_norm': 'post_feed_forward_norm',  # Peri-LN, KEEL
         'attn_post_norm': 'attention_norm', 'mlp_post_norm': 'feed_forward_norm'}  # DeepNorm: its block norms
CONNECTOR = {'attn_route': 'attention_hyper_connection', 'mlp_route': 'feed_forward_hyper_connection'}
ROUTE = {'static_alpha': 'static_alpha', 'dynamic_alpha': 'dynamic_alpha_proj', 'alpha_scale': 'dynamic_alpha_scale',
         'static_beta': 'static_beta', 'dynamic_beta': 'dynamic_beta_proj', 'beta_scale': 'dynamic_beta_scale',
         'phi': 'phi', 'bias': 'b', 'alpha_pre': 'alpha_pre', 'alpha_post': 'alpha_post', 'alpha_res': 'alpha_res'}


def study_name(name, n_layer):
    """The study's name of our parameter `name` (HC/mHC: its HyperConnection / Liger modules)."""
    fixed = {'wte.weight': 'embeddings.weight', 'norm_f.weight': 'lm_head.norm.weight',
             'lm_head.weight': 'lm_head.w_out.weight'}
    if name in fixed:
        return fixed[name]
    if m := re.fullmatch(r'blocks\.(\d+)\.(\w+\.\w+)\.weight', name):
        return f'blocks.{m[1]}.{BACKBONE[m[2]]}.weight'
    if m := re.fullmatch(r'residual\.layers\.(\d+)\.(\w+)\.weight', name):
        if m[2] == 'depth_kv':  # MoDA's W_kv of the FFN input
            return f'blocks.{m[1]}.feed_forward.kv_proj.weight'
        return f'blocks.{m[1]}.{NORMS[m[2]]}.weight'
    if m := re.fullmatch(r'residual\.layers\.(\d+)\.(attn_route|mlp_route)\.(\w+)', name):
        return f'blocks.{m[1]}.{CONNECTOR[m[2]]}.{ROUTE[m[3]]}'
    if m := re.fullmatch(r'residual\.layers\.(\d+)\.(mlp_mix|out_mix)\.(query|key_norm\.weight)', name):
        # our block b reads its MLP input (mlp_mix) and its output (out_mix): the input of
        # block b+1's attention, or the final aggregator after the last block
        b, part = int(m[1]), 'proj' if m[3] == 'query' else 'norm'
        if m[2] == 'mlp_mix':
            return f'blocks.{b}.mlp_res_{part}.weight'
        return f'res_{part}.weight' if b == n_layer - 1 else f'blocks.{b + 1}.attn_res_{part}.weight'
    raise KeyError(name)


def liger_cols(m):
    """Column order of Liger's phi / b in ours: [pre | post | res], Liger's res block (out, in)
    row-major, ours (in, out): Liger's entry 2m + o m + i is our 2m + i m + o."""
    return torch.cat([torch.arange(2 * m), 2 * m + torch.arange(m * m).view(m, m).t().reshape(-1)])


def study_weights(model, mhc_layout='liger'):
    """{study name: our tensor} for every parameter of `model` (a bijection), the AttnRes
    queries as the study's (1, d) projections; mHC's phi columns and b in the H_res layout
    of the Liger backend, (out, in) (mhc_layout 'liger'), or ours and its PyTorch
    backend's, (in, out) ('plain')."""
    W, cols = {}, liger_cols(model.config.hc_streams)
    for n, p in model.named_parameters():
        s = study_name(n, model.config.n_layer)
        assert s not in W, f"two of our parameters map to {s}"
        W[s] = p.view(1, -1) if s.endswith('res_proj.weight') else p
        if model.config.residual == 'mhc' and mhc_layout == 'liger' and s.endswith(('.phi', '.b')):
            W[s] = p[..., cols]
    return W


# -----------------------------------------------------------------------------
# the study's forward, transcribed (fp32, batch-first (B, T, d); HC/mHC streams (B, T, m, d)
# where the study folds them into the batch as (B m, T, d): the same numbers)

def rms(x, w, eps):
    """OLMo-core RMSNorm: x / sqrt(mean(x^2) + eps) * w."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate(x, cos, sin):
    """OLMo-core RotaryEmbedding: x cos + rotate_half(x) sin, rotate_half(x) = [-x2, x1]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_tables(T, hd, theta):
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    freqs = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq)
    pos = torch.cat((freqs, freqs), dim=-1)                   # (T, hd)
    return pos.cos(), pos.sin()


class Study:
    """The study's Transformer for one scheme, reading weights W (study names)."""

    def __init__(self, W, cfg, mhc_backend='liger'):
        self.W, self.cfg, self.L, self.mhc_backend = W, cfg, cfg.n_layer, mhc_backend
        self.hd = cfg.n_embd // cfg.n_head

    def w(self, name):
        return self.W[name]

    def qkv(self, b, x):
        B, T, _ = x.shape
        q = (x @ self.w(f'blocks.{b}.attention.w_q.weight').t()).view(B, T, -1, self.hd)
        k = (x @ self.w(f'blocks.{b}.attention.w_k.weight').t()).view(B, T, -1, self.hd)
        v = (x @ self.w(f'blocks.{b}.attention.w_v.weight').t()).view(B, T, -1, self.hd)
        return q, k, v                                        # (B, T, heads, hd), before RoPE

    def attention(self, b, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(b, x)
        cos, sin = rope_tables(T, self.hd, self.cfg.rope_theta)
        q, k = (rotate(t.transpose(1, 2), cos, sin) for t in (q, k))
        y = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True)
        return y.transpose(1, 2).reshape(B, T, -1) @ self.w(f'blocks.{b}.attention.w_out.weight').t()

    def feed_forward(self, b, x):
        w1, w2, w3 = (self.w(f'blocks.{b}.feed_forward.{n}.weight') for n in ('w1', 'w2', 'w3'))
        return (F.silu(x @ w1.t()) * (x @ w3.t())) @ w2.t()

    def norm(self, name, x):
        return rms(x, self.w(name + '.weight'), EPS)

    def lm_head(self, h, skip_norm=False):
        if not skip_norm:
            h = self.norm('lm_head.norm', h)
        return h @ self.w('lm_head.w_out.weight').t()

    # ---- the blocks (block.py)
    def preln(self, b, x):        # TransformerBlock
        h = x + self.attention(b, self.norm(f'blocks.{b}.attention_norm', x))
        return h + self.feed_forward(b, self.norm(f'blocks.{b}.feed_forward_norm', h))

    def sandwich(self, b, x):     # PeriNormTransformerBlock
        p = f'blocks.{b}.'
        h = x + self.norm(p + 'post_attention_norm', self.attention(b, self.norm(p + 'attention_norm', x)))
        return h + self.norm(p + 'post_feed_forward_norm', self.feed_forward(b, self.norm(p + 'feed_forward_norm', h)))

    def lns(self, b, x):          # LayerNormScaledTransformerBlock: ln_scale = 1 / sqrt(block_idx + 1)
        s = 1.0 / math.sqrt(b + 1)
        h = x + self.attention(b, self.norm(f'blocks.{b}.attention_norm', x) * s)
        return h + self.feed_forward(b, self.norm(f'blocks.{b}.feed_forward_norm', h) * s)

    def deepnorm(self, b, x):     # DeepNormTransformerBlock, block norms LayerNorm (no bias)
        a = (2 * self.L) ** 0.25
        ln = lambda n, t: F.layer_norm(t, (t.size(-1),), self.w(f'blocks.{b}.{n}.weight'), None, EPS)  # noqa: E731
        h = ln('attention_norm', a * x + self.attention(b, x))
        return ln('feed_forward_norm', a * h + self.feed_forward(b, h))

    def keel(self, b, x):         # KeelTransformerBlock: alpha = 2L, block 0 special
        p, a = f'blocks.{b}.', float(2 * self.L)
        y = self.attention(b, self.norm(p + 'attention_norm', x))
        h = x + y if b == 0 else self.norm(p + 'post_attention_norm', a * x + y)
        y = self.feed_forward(b, self.norm(p + 'feed_forward_norm', h))
        return self.norm(p + 'post_feed_forward_norm', (1.0 if b == 0 else a) * h + y)

    def run_single(self, scheme, idx):
        h = self.w('embeddings.weight')[idx]
        for b in range(self.L):
            h = getattr(self, scheme)(b, h)
        return self.lm_head(h)

    # ---- HC (HyperConnection._forward_hc, the version that applies A_r)
    def hc_sublayer(self, pre, streams, branch):
        W = lambda n: self.w(f'{pre}.{n}')  # noqa: E731
        normed = streams * torch.rsqrt(streams.pow(2).mean(-1, keepdim=True) + 1e-8)   # _rms_norm, eps 1e-8
        alpha = W('dynamic_alpha_scale') * torch.tanh(normed @ W('dynamic_alpha_proj')) + W('static_alpha')
        mixed = torch.einsum('...st,...sd->...td', alpha, streams)                      # (B, T, m+1, d)
        out = branch(mixed[..., 0, :])
        beta = W('static_beta') + W('dynamic_beta_scale') * torch.tanh(normed @ W('dynamic_beta_proj'))
        return mixed[..., 1:, :] + out.unsqueeze(-2) * beta.unsqueeze(-1)

    # ---- mHC, default backend (LigerHyperConnection, liger_kernel ops/mhc.py: mix = RMS(vec H)
    # phi, rms eps 1e-6, coefficients mix * alpha + b, no tanh, post_mult 2, pre_eps 0;
    # _mhc_split_sinkhorn_fwd_kernel with tmax 20, sinkhorn_eps 1e-6, H_res stored (out, in);
    # _mhc_post_res_fwd_kernel: new stream o = sum_i H_res[o, i] H[i] + post[o] f)
    @staticmethod
    def liger_sinkhorn(z, iters=20, eps=1e-6):
        """z (..., out, in): stable row softmax + eps, then columns; iters - 1 rounds of
        rows, columns, every denominator + eps."""
        mat = torch.softmax(z, dim=-1) + eps
        mat = mat / (mat.sum(-2, keepdim=True) + eps)
        for _ in range(iters - 1):
            mat = mat / (mat.sum(-1, keepdim=True) + eps)
            mat = mat / (mat.sum(-2, keepdim=True) + eps)
        return mat

    # its plain PyTorch backend (HyperConnection._forward_mhc): sinkhorn_log on H_res stored
    # (in, out), new stream t = sum_s H_res[s, t] H[s]
    @staticmethod
    def sinkhorn_log(z, iters=20):
        n = z.shape[-1]
        u, v = torch.zeros_like(z[..., 0]), torch.zeros_like(z[..., 0, :])
        for _ in range(iters):
            u = -math.log(n) - torch.logsumexp(z + v.unsqueeze(-2), dim=-1)
            v = -math.log(n) - torch.logsumexp(z + u.unsqueeze(-1), dim=-2)
        return torch.exp(z + u.unsqueeze(-1) + v.unsqueeze(-2)) * n

    def mhc_sublayer(self, pre, streams, branch):
        W = lambda n: self.w(f'{pre}.{n}')  # noqa: E731
        m = streams.shape[-2]
        flat = streams.reshape(*streams.shape[:-2], -1)
        logits = (flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-6)) @ W('phi')
        b = W('b')
        h_pre = torch.sigmoid(logits[..., :m] * W('alpha_pre') + b[:m])
        h_post = 2.0 * torch.sigmoid(logits[..., m:2 * m] * W('alpha_post') + b[m:2 * m])
        res = (logits[..., 2 * m:] * W('alpha_res') + b[2 * m:]).view(*logits.shape[:-1], m, m)
        out = branch(torch.einsum('...s,...sd->...d', h_pre, streams))
        if self.mhc_backend == 'liger':
            mixed = torch.einsum('...oi,...id->...od', self.liger_sinkhorn(res), streams)
        else:
            mixed = torch.einsum('...st,...sd->...td', self.sinkhorn_log(res), streams)
        return mixed + out.unsqueeze(-2) * h_post.unsqueeze(-1)

    def run_streams(self, scheme, idx, m):
        x = self.w('embeddings.weight')[idx]
        streams = x.unsqueeze(-2).expand(*x.shape[:-1], m, x.shape[-1])   # HyperConnectionStreamExpand
        sub = self.hc_sublayer if scheme == 'hc' else self.mhc_sublayer
        for b in range(self.L):
            p = f'blocks.{b}.'
            streams = sub(p + 'attention_hyper_connection', streams,
                          lambda t: self.attention(b, self.norm(p + 'attention_norm', t)))
            streams = sub(p + 'feed_forward_hyper_connection', streams,
                          lambda t: self.feed_forward(b, self.norm(p + 'feed_forward_norm', t)))
        if scheme == 'mhc':  # Liger backend, collapse 'auto' = 'mean': reduce, then the head's norm
            return self.lm_head(streams.mean(-2))
        # collapse 'sum': lm_head.norm on every stream, reduce, head with skip_norm
        return self.lm_head(self.norm('lm_head.norm', streams).sum(-2), skip_norm=True)

    # ---- AttnRes / Block AttnRes (TransformerBlock's attnres path, Transformer.forward)
    @staticmethod
    def fused_attnres(query, residuals, rms_weight, output_rms_weight, eps):
        """kernels/attnres.py: one eps for the key norms and the optional output norm, scale 1."""
        Vs = torch.stack(residuals)                                            # (n, B, T, d)
        rstd = torch.rsqrt(Vs.pow(2).mean(-1) + eps)                           # (n, B, T)
        p = torch.softmax((Vs @ (query.flatten() * rms_weight)) * rstd, dim=0)
        o = torch.einsum('nbt,nbtd->btd', p, Vs)
        if output_rms_weight is not None:
            o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * output_rms_weight
        return o

    def run_attnres(self, idx, block_size):
        eps = STUDY_RMS_DEFAULT  # attn_res_norm / mlp_res_norm / res_norm: RMSNorm built with the default eps
        x, states = self.w('embeddings.weight')[idx], None
        for b in range(self.L):
            p = f'blocks.{b}.'
            attn_boundary, mlp_boundary = (2 * b) % block_size == 0, (2 * b + 1) % block_size == 0
            prefix = x
            if states is None:
                h_normed, states, prefix = self.norm(p + 'attention_norm', prefix), [prefix], None
            else:
                residuals = [*states, prefix]
                if attn_boundary:
                    states, prefix = residuals, None
                h_normed = self.fused_attnres(self.w(p + 'attn_res_proj.weight'), residuals,
                                              self.w(p + 'attn_res_norm.weight'), self.w(p + 'attention_norm.weight'), eps)
            out = self.attention(b, h_normed)
            prefix = out if prefix is None else prefix + out
            residuals = [*states, prefix]
            if mlp_boundary:
                states, prefix = residuals, None
            h_normed = self.fused_attnres(self.w(p + 'mlp_res_proj.weight'), residuals,
                                          self.w(p + 'mlp_res_norm.weight'), self.w(p + 'feed_forward_norm.weight'), eps)
            out = self.feed_forward(b, h_normed)
            x = out if prefix is None else prefix + out
        h = self.fused_attnres(self.w('res_proj.weight'), [*states, x], self.w('res_norm.weight'),
                               self.w('lm_head.norm.weight'), eps)
        return self.lm_head(h, skip_norm=True)

    # ---- MoDA (MoDATransformerBlock, MoDAAttention, MoDAFeedForwardDepthCache)
    def run_moda(self, idx):
        cfg = self.cfg
        h = self.w('embeddings.weight')[idx]
        B, T, _ = h.shape
        cache_k, cache_v = {}, {}                            # slot -> (B, T, H_kv, hd); unwritten slots are zeros
        zero = h.new_zeros(B, T, cfg.n_kv_head, self.hd)
        cos, sin = rope_tables(T, self.hd, cfg.rope_theta)
        for b in range(self.L):
            p, slot = f'blocks.{b}.', 2 * b
            q, k, v = self.qkv(b, self.norm(p + 'attention_norm', h))
            qr, kr = (rotate(t.transpose(1, 2), cos, sin) for t in (q, k))   # (B, heads, T, hd)
            seq = (qr @ kr.transpose(-1, -2)) / math.sqrt(self.hd)
            seq = seq.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float('-inf'))
            # depth part: slots 0 .. current_depth - 1 of the same token, keys before RoPE
            K = torch.stack([cache_k.get(j, zero) for j in range(slot)] + [zero], dim=2)[:, :, :slot]  # (B, T, slot, H_kv, hd)
            Vd = torch.stack([cache_v.get(j, zero) for j in range(slot)] + [zero], dim=2)[:, :, :slot]
            dep = torch.einsum('bhtd,btjhd->bhtj', qr, K) / math.sqrt(self.hd)    # MHA here: H_kv = heads
            a = torch.softmax(torch.cat((seq, dep), dim=-1), dim=-1)
            y = a[..., :T] @ v.transpose(1, 2) + torch.einsum('bhtj,btjhd->bhtd', a[..., T:], Vd)
            h = h + y.transpose(1, 2).reshape(B, T, -1) @ self.w(p + 'attention.w_out.weight').t()
            if slot + 1 < 2 * self.L:                        # _write_moda_depth_slot
                cache_k[slot], cache_v[slot] = k, v
            x = self.norm(p + 'feed_forward_norm', h)
            if slot + 2 < 2 * self.L:                        # the FFN slot, written only when slot + 1 < max_depth
                kv = (x @ self.w(p + 'feed_forward.kv_proj.weight').t()).view(B, T, 2, cfg.n_kv_head, self.hd)
                cache_k[slot + 1], cache_v[slot + 1] = kv.unbind(dim=2)
            h = h + self.feed_forward(b, x)
        return self.lm_head(h)

    def logits(self, scheme, idx):
        if scheme in ('hc', 'mhc'):
            return self.run_streams(scheme, idx, self.cfg.hc_streams)
        if scheme in ('attnres', 'blockattnres'):
            n_sub = 2 * self.L
            size = 1 if scheme == 'attnres' else n_sub // min(self.cfg.attnres_blocks, n_sub)
            return self.run_attnres(idx, size)
        if scheme == 'moda':
            return self.run_moda(idx)
        return self.run_single(scheme, idx)


def study_logits(model, idx, mhc_backend='liger'):
    W = study_weights(model, mhc_layout=mhc_backend)
    return Study(W, model.config, mhc_backend).logits(model.config.residual, idx)


# -----------------------------------------------------------------------------
# the tests

@pytest.mark.parametrize('scheme', TEN)
@torch.no_grad()
def test_logits_match_the_study_at_init_and_with_random_weights(scheme):
    model, idx = make(scheme), tokens()
    ours, theirs = model(idx)[0], study_logits(model, idx)
    assert (ours - theirs).abs().max().item() <= TOL
    randomise(model)
    ours, theirs = model(idx)[0], study_logits(model, idx)
    assert theirs.abs().max() > 0.05  # the comparison is not between near-zero logits
    assert (ours - theirs).abs().max().item() <= TOL


def test_every_parameter_has_one_study_name():
    for scheme in TEN:
        model = make(scheme)
        W = study_weights(model)
        assert len(W) == len(list(model.parameters()))
        assert sum(p.numel() for p in W.values()) == model.num_params()


@pytest.mark.parametrize('scheme,change,min_gap', [
    ('hc', dict(hc_readout='sum'), 1e-2),          # the paper's "sum, then norm"
    ('mhc', dict(hc_readout='sum'), 2e-5),         # differs from the mean only through the norm's eps
    ('mhc', dict(hc_readout='norm_sum'), 1e-2),
    ('mhc', dict(mhc_sinkhorn='plain'), 1e-4),     # the PyTorch backend's Sinkhorn order, no eps
    ('attnres', dict(attnres_eps=EPS), 1e-3),      # one eps everywhere, as before
    ('blockattnres', dict(attnres_eps=EPS), 1e-3),
])
@torch.no_grad()
def test_the_paper_forms_are_named_options_that_differ(scheme, change, min_gap):
    """The comparison above can fail: the other readout or eps, with the same weights,
    moves the logits past the tolerance."""
    model, idx = make(scheme), tokens()
    randomise(model)
    other = make(scheme, **change)
    other.load_state_dict(model.state_dict())
    assert (other(idx)[0] - study_logits(model, idx)).abs().max().item() > max(min_gap, TOL)


def study_decay_groups(model):
    """(decayed, exempt) study names: one AdamW over all parameters with weight_decay 0.1,
    and an override to 0 for HyperConnectionsConfig.static_parameter_patterns (HC:
    static_alpha, static_beta; Liger mHC: b, alpha_pre, alpha_post, alpha_res) under
    blocks.*.attention_hyper_connection and blocks.*.feed_forward_hyper_connection."""
    names = {'hc': ('static_alpha', 'static_beta'),
             'mhc': ('b', 'alpha_pre', 'alpha_post', 'alpha_res')}.get(model.config.residual, ())
    patterns = [f'blocks.*.{c}.{n}' for c in ('attention_hyper_connection', 'feed_forward_hyper_connection')
                for n in names]
    W = study_weights(model)
    exempt = {s for s in W if any(fnmatch(s, pat) for pat in patterns)}
    return set(W) - exempt, exempt


@pytest.mark.parametrize('scheme', TEN)
def test_weight_decay_groups_are_the_study_s(scheme):
    model = make(scheme)
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    decay, other = opt.param_groups
    assert decay['weight_decay'] == 0.1 and other['weight_decay'] == 0.0
    W = study_weights(model)
    by_id = {id(p): s for s, p in W.items()}  # AttnRes queries are views: map through their base
    for n, p in model.named_parameters():
        by_id[id(p)] = study_name(n, model.config.n_layer)
    ours = ({by_id[id(p)] for p in decay['params']}, {by_id[id(p)] for p in other['params']})
    assert ours == study_decay_groups(model)
    if scheme in ('hc', 'mhc'):
        assert ours[1]  # there are exemptions, and they are the routing statics
    # nanoGPT's groups stay available: matrices only, minus the same exemptions
    decay, other = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), decay_on='matrices').param_groups
    assert all(p.dim() >= 2 for p in decay['params'])
    assert {by_id[id(p)] for p in decay['params']} == {s for s in study_decay_groups(model)[0] if W[s].dim() >= 2
                                                        and not s.endswith('res_proj.weight')}


@pytest.mark.parametrize('scheme', ('hc', 'mhc', 'attnres'))
@torch.no_grad()
def test_logit_lens_decodes_depth_states_with_the_model_s_readout(scheme):
    """Our LogitLens decodes every depth state with the scheme's own readout, so the last one
    gives the study's logits (KL 0 at the last layer). The study's analysis/depth_probes.py
    decodes HC/mHC states as lm_head(reduce(H)) with the head's norm: for mHC (mean) that is
    the readout itself; for HC it differs (docs/fidelity.md), and we check by how much."""
    model, idx = make(scheme), tokens()
    randomise(model)
    rec = []
    model.hidden(idx, record=rec)
    study = Study(study_weights(model), model.config)
    assert (model.head(rec[-1][1]) - study.logits(scheme, idx)).abs().max().item() <= TOL
    if scheme == 'attnres':  # decode_readout: RMSNorm with the head's gain and the mixer's eps
        for _, lens in rec[1:]:
            want = study.lm_head(rms(lens, study.w('lm_head.norm.weight'), STUDY_RMS_DEFAULT), skip_norm=True)
            assert (model.head(lens) - want).abs().max().item() <= TOL
    else:
        for _, lens in rec[1:]:
            gap = (model.head(lens) - study.lm_head(model.residual.reduce(lens))).abs().max().item()
            assert gap <= TOL if scheme == 'mhc' else gap > 1e-2
