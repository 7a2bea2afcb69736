"""
The HC / mHC streams at the price of their bandwidth: a fast form of residuals.MultiStream.block
(HC and mHC, arXiv 2409.19606 and 2512.24880) with the same inputs and outputs.

A sublayer k of the plain code reads the streams H_k (B, T, m, d) fp32 three times forward (its
coefficients, the read x_k = A_m^T H_k, the write H_{k+1} = A_r^T H_k + beta (x) y_k) and
autograd sums their gradient over those uses. Here a step reads them once each way:

  forward   one pass over (H_k, y_k): the write H_{k+1}, then the coefficients of sublayer
            k + 1 from H_{k+1} (HC's projection, mHC's projection and Sinkhorn rounds) and its
            read x_{k+1}                                                        (`Step`)
  backward  one pass over (dH_{k+1}, dx_{k+1}, H_k, y_k): H_{k+1} recomputed, the gradient of
            sublayer k + 1's coefficients (the Sinkhorn rounds recomputed in fp32 from their
            logits: nothing of them is kept) and read added to dH_{k+1} in registers, then the
            write's backward: dH_k, dy_k, dA_r, dbeta; the routing parameters' gradients as one
            partial sum per program
so each stream tensor has one consumer: its gradient is formed once, in one fp32 buffer, with
no add of autograd. A block's streams are kept once: the attention step keeps the block's input
H, the MLP step recomputes its own input from it (H_{2b+1} = A_r^T H_{2b} + beta y_{2b}, one
more read of y_{2b}), so 16 bytes x m d a token per block, not per sublayer. The first
sublayer's coefficients and read come from `Route` (the same pass without a write); a step
plans the next sublayer (the model's order: block b's MLP, then block b+1's attention) and its
result waits on the streams it made (`PENDING`) for the call that reads them; a call in
another order (a probe's swap) computes its own.

`TorchOps` (any device, the CPU's fast path) and `TritonOps` (fast/stream_kernels.py: CUDA or
Triton's interpreter) are two forms of the same steps; `block(ops)` gives the method a fast
path puts in place. Math in fp32 (fp64 for fp64 streams), autocast off, as the plain routing;
the branch output y is read in its own dtype and its gradient returned in it.

Liger's mHC ops (liger_kernel.transformers.functional, the study's default mHC backend:
`liger_coefficients`, `liger_read`, `liger_write`) are kept as the published kernels the step
is measured against (tools/gpu_check.py, `bench.py --suite=step`), not as fast paths.
"""

from dataclasses import dataclass

import torch

from perf.launch import launch
from residuals import LIGER_SINKHORN_EPS, MHC, no_autocast

PENDING = '_streams_next'  # attribute of a step's output streams: (route, x, A_m, A_r, beta) of the planned read


@dataclass(frozen=True)
class Spec:
    """The routing of a scheme: kind 'hc' or 'mhc', m streams; HC's RMS eps (1e-8); mHC's RMS eps
    (cfg.norm_eps), Sinkhorn rounds, order ('liger' / 'plain') and eps."""
    kind: str
    m: int
    eps: float
    iters: int = 0
    order: str = 'liger'
    sk_eps: float = 0.0

    @staticmethod
    def of(res):
        cfg = res.cfg
        if isinstance(res, MHC):
            order = cfg.mhc_sinkhorn
            return Spec('mhc', res.m, cfg.norm_eps, cfg.mhc_sinkhorn_iters, order,
                        LIGER_SINKHORN_EPS if order == 'liger' else 0.0)
        return Spec('hc', res.m, 1e-8)


def route_params(spec, route):
    """The routing parameters of one sublayer, in the order the steps take them."""
    if spec.kind == 'hc':
        return (route.static_alpha, route.static_beta, route.dynamic_alpha, route.dynamic_beta,
                route.alpha_scale, route.beta_scale)
    return route.phi, route.bias, route.alpha_pre, route.alpha_post, route.alpha_res


# ---- the math of one sublayer, in torch ------------------------------------------------

def write(H, y, A_r, beta):
    """H' = A_r^T H + beta (x) y: (..., m, d), y (..., d) in any dtype -> (..., m, d) in H's dtype."""
    return torch.einsum('...st,...sd->...td', A_r, H) + beta.unsqueeze(-1) * y.to(H.dtype).unsqueeze(-2)


def write_backward(H, y, A_r, beta, G):
    """The write's gradients from G = dH': (dH, dy (y's dtype), dA_r, dbeta)."""
    return (A_r @ G, torch.einsum('...t,...td->...d', beta, G).to(y.dtype),
            H @ G.transpose(-1, -2), torch.einsum('...td,...d->...t', G, y.to(G.dtype)))


def hc_coefficients(spec, X, params):
    """HC.coefficients on X (..., m, d): r = 1/rms per stream, Z = r (X [W_alpha | w_beta]),
    [A_m | A_r] = static_alpha + s_alpha tanh(Z[:m+1]), beta = static_beta + s_beta tanh(Z[m+1]).
    -> (A_m, A_r, beta, stats = (Z, r))."""
    static_alpha, static_beta, dyn_alpha, dyn_beta, alpha_scale, beta_scale = params
    r = torch.rsqrt(X.square().mean(-1) + spec.eps)                                    # (..., m)
    Z = (X @ torch.cat([dyn_alpha, dyn_beta.unsqueeze(-1)], -1)) * r.unsqueeze(-1)       # (..., m, m + 2)
    Tz = torch.tanh(Z)
    A = static_alpha + alpha_scale * Tz[..., :-1]
    beta = static_beta + beta_scale * Tz[..., -1]
    return A[..., 0], A[..., 1:], beta, (Z, r)


def hc_coefficients_backward(spec, X, params, stats, dA_m, dA_r, dbeta):
    """Gradients of `hc_coefficients` from those of A_m, A_r, beta: (dX, dparams)."""
    static_alpha, static_beta, dyn_alpha, dyn_beta, alpha_scale, beta_scale = params
    Z, r = stats
    d = X.size(-1)
    Tz = torch.tanh(Z)
    dA = torch.cat([dA_m.unsqueeze(-1), dA_r], -1)                                       # (..., m, m + 1)
    dT = torch.cat([alpha_scale * dA, (beta_scale * dbeta).unsqueeze(-1)], -1)
    dZ = dT * (1 - Tz * Tz)                                                               # (..., m, m + 2)
    W = torch.cat([dyn_alpha, dyn_beta.unsqueeze(-1)], -1)                               # (d, m + 2)
    dP = dZ * r.unsqueeze(-1)
    P = Z / r.unsqueeze(-1)
    dX = dP @ W.t() - (r.pow(3) * (dZ * P).sum(-1) / d).unsqueeze(-1) * X
    dW = torch.einsum('...sd,...sc->dc', X, dP)
    lead = tuple(range(dA.dim() - 2))
    return dX, (dA.sum(lead), dbeta.sum(lead), dW[:, :-1], dW[:, -1], (dA * Tz[..., :-1]).sum(),
                (dbeta * Tz[..., -1]).sum())


def sinkhorn_steps(logits, spec):
    """residuals.sinkhorn's rounds on logits (..., m, m) with their history: (P, steps)."""
    first, last = (-2, -1) if spec.order == 'liger' else (-1, -2)
    eps = spec.sk_eps
    if eps > 0:
        sm = torch.softmax(logits, dim=first)
        P0 = sm + eps
        s = P0.sum(last, keepdim=True) + eps
        P = P0 / s
        steps = [('softmax+eps', sm, P, s)]
    else:
        ls = torch.log_softmax(logits, dim=first)
        P = torch.softmax(ls, dim=last)
        steps = [('log', ls, P, None)]
    for _ in range(spec.iters - 1):
        for dim in (first, last):
            s = P.sum(dim, keepdim=True) + eps
            P = P / s
            steps.append((dim, None, P, s))
    return P, steps


def sinkhorn_backward(steps, g, spec):
    """The gradient of the logits from g = dP, back through `sinkhorn_steps`' history."""
    first, last = (-2, -1) if spec.order == 'liger' else (-1, -2)
    for kind, aux, y, s in reversed(steps):
        if kind == 'softmax+eps':   # y = (sm + eps) / s, sm = softmax(logits, first)
            g = (g - (g * y).sum(last, keepdim=True)) / s
            g = aux * (g - (g * aux).sum(first, keepdim=True))
        elif kind == 'log':         # y = softmax(ls, last), ls = log_softmax(logits, first)
            g = y * (g - (g * y).sum(last, keepdim=True))
            g = g - aux.exp() * g.sum(first, keepdim=True)
        else:                       # y = P / s over dim `kind`
            g = (g - (g * y).sum(kind, keepdim=True)) / s
    return g


def mhc_gates(spec, params, l):
    """(H_pre, H_post, Sinkhorn logits) from the projection l (..., m^2 + 2m) = x' phi."""
    phi, bias, a_pre, a_post, a_res = params
    m = spec.m
    l_pre, l_post, l_res = l.split([m, m, m * m], dim=-1)
    b_pre, b_post, b_res = bias.split([m, m, m * m])
    return (torch.sigmoid(a_pre * l_pre + b_pre), 2 * torch.sigmoid(a_post * l_post + b_post),
            (a_res * l_res + b_res).view(*l.shape[:-1], m, m))


def mhc_coefficients(spec, X, params):
    """MHC.coefficients on X (..., m, d): r = 1/rms(vec X), l = r (vec X) phi, the gates and the
    Sinkhorn rounds. -> (H_pre, H_res, H_post, stats = (l, r))."""
    v = X.flatten(-2)
    r = torch.rsqrt(v.square().mean(-1) + spec.eps)                                      # (...)
    l = (v @ params[0]) * r.unsqueeze(-1)                                                # (..., m^2 + 2m)
    H_pre, H_post, logits = mhc_gates(spec, params, l)
    H_res, _ = sinkhorn_steps(logits, spec)
    return H_pre, H_res, H_post, (l, r)


def mhc_coefficients_backward(spec, X, params, stats, dH_pre, dH_res, dH_post):
    """Gradients of `mhc_coefficients` (the Sinkhorn rounds recomputed from l): (dX, dparams)."""
    phi, bias, a_pre, a_post, a_res = params
    l, r = stats
    m, shape = spec.m, X.shape
    v = X.flatten(-2)
    l_pre, l_post, l_res = l.split([m, m, m * m], dim=-1)
    H_pre, H_post, logits = mhc_gates(spec, params, l)
    _, steps = sinkhorn_steps(logits, spec)
    u_pre = dH_pre * H_pre * (1 - H_pre)
    u_post = dH_post * H_post * (1 - H_post / 2)
    g_res = sinkhorn_backward(steps, dH_res, spec).flatten(-2)
    dl = torch.cat([a_pre * u_pre, a_post * u_post, a_res * g_res], -1)                # (..., m^2 + 2m)
    l_raw = l / r.unsqueeze(-1)
    dv = (dl @ phi.t()) * r.unsqueeze(-1) - (r.pow(3) * (l_raw * dl).sum(-1) / v.size(-1)).unsqueeze(-1) * v
    lead = tuple(range(l.dim() - 1))
    dphi = torch.einsum('...k,...c->kc', v * r.unsqueeze(-1), dl)
    dbias = torch.cat([u_pre, u_post, g_res], -1).sum(lead)
    return dv.view(shape), (dphi, dbias, (u_pre * l_pre).sum(), (u_post * l_post).sum(), (g_res * l_res).sum())


COEFFICIENTS = {'hc': (hc_coefficients, hc_coefficients_backward),
                'mhc': (mhc_coefficients, mhc_coefficients_backward)}


class TorchOps:
    """The steps in torch ops, on any device; math in H's dtype (fp32, or fp64)."""

    @staticmethod
    def forward(spec, H, src, wr, params, store=True):
        """H, or src = (H_s, y_s, A_r_s, beta_s), the write that made it (H not materialised);
        wr: (y, A_r, beta) of the write, or None (H is read as it is); params: the next
        sublayer's routing parameters, or None (no read). -> (H', x, A_m, A_r, beta, stats)
        (H' None without a write or with store=False; the rest None without a read)."""
        H = write(*src) if src is not None else H
        Hn = H if wr is None else write(H, *wr)
        if params is None:
            return (Hn if store else None), None, None, None, None, None
        A_m, A_r, beta, stats = COEFFICIENTS[spec.kind][0](spec, Hn, params)
        x = torch.einsum('...s,...sd->...d', A_m, Hn)
        return (None if wr is None or not store else Hn), x, A_m, A_r, beta, stats

    @staticmethod
    def backward(spec, H, src, wr, params, stats, A_m, dHn, dx, dA_m, dA_r, dbeta):
        """The gradients of `forward`, H given or recomputed from src = (H_s, y_s, A_r_s, beta_s):
        dH' (None: zero), dx, dA_m (None: zero; the trace's), dA_r, dbeta of the read ->
        (dH, dy, dA_r, dbeta of the write (None without one), dparams (None without a read))."""
        H = write(*src) if H is None else H
        Hn = H if wr is None else write(H, *wr)
        G = torch.zeros_like(Hn) if dHn is None else dHn.clone()
        dparams = None
        if params is not None:
            zero = torch.zeros_like(A_m)
            dx = torch.zeros_like(Hn[..., 0, :]) if dx is None else dx
            G += A_m.unsqueeze(-1) * dx.unsqueeze(-2)
            dA_m = torch.einsum('...sd,...d->...s', Hn, dx) + (zero if dA_m is None else dA_m)
            dA_r = torch.zeros_like(A_m.unsqueeze(-1).expand(*A_m.shape, spec.m)) if dA_r is None else dA_r
            dX, dparams = COEFFICIENTS[spec.kind][1](spec, Hn, params, stats, dA_m, dA_r,
                                                     zero if dbeta is None else dbeta)
            G += dX
        if wr is None:
            return G, None, None, None, dparams
        return (*write_backward(H, *wr, G), dparams)


def _next_pow2(n):
    return 1 << max(n - 1, 0).bit_length()


class TritonOps:
    """The steps as launches of fast/stream_kernels.py (fp32 math; CUDA or Triton's interpreter).
    Streams that are not fp32 (fp64) or a branch output in another dtype than fp32 / bf16 / fp16
    take TorchOps' code instead (on the same device)."""

    PROGRAMS = 264  # programs of the HC backward (2 per SM of an H100): each sums the parameters' gradients

    @staticmethod
    def _torch(H, wr):
        return H.dtype != torch.float32 or (wr is not None and wr[0].dtype not in
                                             (torch.float32, torch.bfloat16, torch.float16))

    BT, BDC = 64, 32          # mHC: tokens per program and features per chunk of the forward,
    BT_BWD, BDC_BWD = 64, 16  # and of the backward (more tiles live at once; the coefficients' backward at BDC)

    @staticmethod
    def forward(spec, H, src, wr, params, store=True):
        base = src[0] if src is not None else H
        if TritonOps._torch(base, wr) or (src is not None and TritonOps._torch(src[0], src[1:])) or \
                (spec.kind == 'mhc' and spec.m not in (3, 4)):
            return TorchOps.forward(spec, H, src, wr, params, store)
        if spec.kind == 'mhc':
            return TritonOps.mhc_forward(spec, H, src, wr, params, store)
        m, d = spec.m, base.size(-1)
        N, lead, dev = base.numel() // (m * d), base.shape[:-2], base.device
        dummy = torch.empty(1, dtype=torch.float32, device=dev)
        H = dummy if src is not None else H.contiguous()
        Hs, ys, Ars, bs = (t.contiguous() for t in src) if src is not None else (dummy,) * 4
        store = store and wr is not None
        Hn = torch.empty(base.shape, dtype=torch.float32, device=dev) if store else None
        y, A_r0, b0 = (t.contiguous() for t in wr) if wr is not None else (dummy, dummy, dummy)
        read = params is not None
        if read:
            sa, sb, Wa, wb, a_s, b_s = params
            new = lambda *shape: torch.empty(*lead, *shape, dtype=torch.float32, device=dev)  # noqa: E731
            x, A_m, A_r, beta, Z, r = new(d), new(m), new(m, m), new(m), new(m, m + 2), new(m)
        else:
            sa = sb = Wa = wb = a_s = b_s = x = A_m = A_r = beta = Z = r = dummy
        reads = (('Hs', 'ys', 'Ars', 'bs') if src is not None else ('H',)) + \
            (('y', 'Ar0', 'b0') if wr is not None else ()) + (('sa', 'sb', 'Wa', 'wb', 'ascale', 'bscale') if read else ())
        writes = (('Hn',) if store else ()) + (('x', 'Am', 'Ar', 'bt', 'Z', 'r') if read else ())
        launch('fast.stream_kernels', 'hc_fwd', (N,), reads=reads, writes=writes,
               flops=N * (2 * m * m * d * ((wr is not None) + (src is not None))
                          + (2 * m * d * (m + 2) + 2 * m * d) * read), num_warps=8,
               H=H, y=y, Ar0=A_r0, b0=b0, Hs=Hs, ys=ys, Ars=Ars, bs=bs, Hn=dummy if Hn is None else Hn, x=x, Am=A_m,
               Ar=A_r, bt=beta, Z=Z, r=r, sa=sa, sb=sb, Wa=Wa, wb=wb, ascale=a_s, bscale=b_s, N=N, D=d, eps=spec.eps,
               M=m, MP=_next_pow2(m), CP=_next_pow2(m + 2), BD=_next_pow2(d), WRITE=wr is not None, READ=read,
               SRC=src is not None, STORE=store)
        if not read:
            return Hn, None, None, None, None, None
        return Hn, x, A_m, A_r, beta, (Z, r)

    @staticmethod
    def backward(spec, H, src, wr, params, stats, A_m, dHn, dx, dA_m, dA_r, dbeta):
        base = H if H is not None else src[0]
        if TritonOps._torch(base, wr) or (spec.kind == 'mhc' and spec.m not in (3, 4)) or dA_m is not None or \
                (src is not None and TritonOps._torch(src[0], src[1:])):
            return TorchOps.backward(spec, H, src, wr, params, stats, A_m, dHn, dx, dA_m, dA_r, dbeta)
        if spec.kind == 'mhc':
            return TritonOps.mhc_backward(spec, H, src, wr, params, stats, A_m, dHn, dx, dA_r, dbeta)
        m, d = spec.m, base.size(-1)
        N, dev = base.numel() // (m * d), base.device
        f32 = torch.float32
        dummy = torch.empty(1, dtype=f32, device=dev)
        read = params is not None
        programs = min(N, TritonOps.PROGRAMS)
        MP, CP = _next_pow2(m), _next_pow2(m + 2)
        dH = torch.empty(base.shape, dtype=f32, device=dev)
        y, A_r0, b0 = (t.contiguous() for t in wr) if wr is not None else (dummy, dummy, dummy)
        Hs, ys, Ars, bs = (t.contiguous() for t in src) if src is not None else (dummy,) * 4
        dy = torch.empty_like(y) if wr is not None else dummy
        dAr0, db0 = (torch.empty_like(A_r0), torch.empty_like(b0)) if wr is not None else (dummy, dummy)
        if read:
            sa, sb, Wa, wb, a_s, b_s = params
            Z, r = stats
            g = torch.empty(programs, m * CP + CP * d + 2, dtype=f32, device=dev)  # one row of partial sums a program
            dx = torch.zeros(base.shape[:-2] + (d,), dtype=f32, device=dev) if dx is None else dx.contiguous()
        else:
            Wa = wb = a_s = b_s = Z = r = A_m = g = dx = dummy
        has_dr = read and (dA_r is not None or dbeta is not None)
        if has_dr:
            dA_r = torch.zeros_like(A_m.unsqueeze(-1).expand(*A_m.shape, m)) if dA_r is None else dA_r.contiguous()
            dbeta = torch.zeros_like(A_m) if dbeta is None else dbeta.contiguous()
        reads = (('Hs', 'ys', 'Ars', 'bs') if src is not None else ('H',)) + \
            (('y', 'Ar0', 'b0') if wr is not None else ()) + (('dHn',) if dHn is not None else ()) + \
            (('Z', 'r', 'Am', 'Wa', 'wb', 'ascale', 'bscale', 'dx') if read else ()) + \
            (('dAr', 'dbt') if has_dr else ())
        writes = ('dH',) + (('dy', 'dAr0', 'db0') if wr is not None else ()) + (('g',) if read else ())
        launch('fast.stream_kernels', 'hc_bwd', (programs,), reads=reads, writes=writes,
               flops=N * (6 * m * m * d * (wr is not None) + 2 * m * m * d * (src is not None)
                          + (6 * m * d * (m + 2) + 4 * m * d) * read), num_warps=8,
               H=dummy if H is None else H.contiguous(), y=y, Ar0=A_r0, b0=b0, Hs=Hs, ys=ys, Ars=Ars, bs=bs,
               Z=Z, r=r, Am=A_m, Wa=Wa, wb=wb, ascale=a_s, bscale=b_s,
               dHn=dummy if dHn is None else dHn.contiguous(), dx=dx, dAr=dA_r if has_dr else dummy,
               dbt=dbeta if has_dr else dummy, dH=dH, dy=dy, dAr0=dAr0, db0=db0, g=g,
               N=N, D=d, M=m, MP=MP, CP=CP, BD=_next_pow2(d), WRITE=wr is not None, READ=read, SRC=src is not None,
               HAS_DHN=dHn is not None, HAS_DR=has_dr)
        dparams = None
        if read:
            tot = g.sum(0)
            ga, gW, gs = tot[:m * CP].view(m, CP), tot[m * CP:-2].view(CP, d)[:m + 2].t(), tot[-2:]
            dparams = (ga[:, :m + 1], ga[:, m + 1], gW[:, :m + 1], gW[:, m + 1], gs[0], gs[1])
        if wr is None:
            return dH, None, None, None, dparams
        return dH, dy, dAr0, db0, dparams


    @staticmethod
    def _mhc_consts(spec, d, BT, BDC):
        return dict(M=spec.m, MP=4, BT=BT, BDC=BDC, D=d, eps=spec.eps,
                    sk_eps=spec.sk_eps, iters=spec.iters, LIGER=spec.order == 'liger')

    @staticmethod
    def mhc_forward(spec, H, src, wr, params, store):
        base = src[0] if src is not None else H
        m, d = spec.m, base.size(-1)
        N, lead, dev = base.numel() // (m * d), base.shape[:-2], base.device
        dummy = torch.empty(1, dtype=torch.float32, device=dev)
        H = dummy if src is not None else H.contiguous()
        Hs, ys, Ars, bs = (t.contiguous() for t in src) if src is not None else (dummy,) * 4
        store = store and wr is not None
        Hn = torch.empty(base.shape, dtype=torch.float32, device=dev) if store else None
        y, A_r0, b0 = (t.contiguous() for t in wr) if wr is not None else (dummy, dummy, dummy)
        read = params is not None
        if read:
            phi, bias, a_pre, a_post, a_res = params
            new = lambda *shape: torch.empty(*lead, *shape, dtype=torch.float32, device=dev)  # noqa: E731
            x, A_m, A_r, beta, L, r = new(d), new(m), new(m, m), new(m), new(m * m + 2 * m), new()
        else:
            phi = bias = a_pre = a_post = a_res = x = A_m = A_r = beta = L = r = dummy
        streams = ('Hs', 'ys', 'Ars', 'bs') if src is not None else ('H',)
        reads = streams + (('y', 'Ar0', 'b0') if wr is not None else ()) + \
            (('phi', 'bias', 'apre', 'apost', 'ares') if read else ())
        writes = (('Hn',) if store else ()) + (('x', 'Am', 'Ar', 'bt', 'L', 'r') if read else ())
        # pass 2 (the read) reads the streams again: those it stored, or those it wrote from
        reread = (('Hn',) if store else streams + (('y',) if wr is not None else ())) if read else ()
        launch('fast.stream_kernels', 'mhc_fwd', (triton_cdiv(N, TritonOps.BT),), reads=reads, writes=writes,
               reread=reread, flops=N * (2 * m * m * d * ((wr is not None) + (src is not None))
                                         + (2 * m * d * (m * m + 2 * m) + 2 * m * d) * read),
               num_warps=8, H=H, y=y, Ar0=A_r0, b0=b0, Hs=Hs, ys=ys, Ars=Ars, bs=bs, Hn=dummy if Hn is None else Hn,
               x=x, Am=A_m, Ar=A_r, bt=beta, L=L, r=r, phi=phi, bias=bias, apre=a_pre, apost=a_post, ares=a_res, N=N,
               WRITE=wr is not None, READ=read, SRC=src is not None, STORE=store,
               **TritonOps._mhc_consts(spec, d, TritonOps.BT, TritonOps.BDC))
        if not read:
            return Hn, None, None, None, None, None
        return Hn, x, A_m, A_r, beta, (L, r)

    @staticmethod
    def mhc_backward(spec, H, src, wr, params, stats, A_m, dHn, dx, dA_r, dbeta):
        base = H if H is not None else src[0]
        m, d = spec.m, base.size(-1)
        N, lead, dev = base.numel() // (m * d), base.shape[:-2], base.device
        f32 = torch.float32
        dummy = torch.empty(1, dtype=f32, device=dev)
        read = params is not None
        nc = m * m + 2 * m
        y, A_r0, b0 = (t.contiguous() for t in wr) if wr is not None else (dummy, dummy, dummy)
        Hs, ys, Ars, bs = (t.contiguous() for t in src) if src is not None else (dummy,) * 4
        Hk = dummy if H is None else H.contiguous()
        streams = ('Hs', 'ys', 'Ars', 'bs') if src is not None else ('H',)
        mine = dict(H=Hk, y=y, Ar0=A_r0, b0=b0, Hs=Hs, ys=ys, Ars=Ars, bs=bs, N=N, WRITE=wr is not None,
                    SRC=src is not None)
        if read:  # the read's and the coefficients' backward: dl, c per token
            phi, bias, a_pre, a_post, a_res = params
            L, r = stats
            dx = torch.zeros(*lead, d, dtype=f32, device=dev) if dx is None else dx.contiguous()
            has_dr = dA_r is not None or dbeta is not None
            if has_dr:
                dA_r = torch.zeros(*lead, m, m, dtype=f32, device=dev) if dA_r is None else dA_r.contiguous()
                dbeta = torch.zeros(*lead, m, dtype=f32, device=dev) if dbeta is None else dbeta.contiguous()
            blocks = triton_cdiv(N, TritonOps.BT_BWD)
            dl, cf = torch.empty(*lead, nc, dtype=f32, device=dev), torch.empty(*lead, dtype=f32, device=dev)
            g = torch.empty(blocks, m * d + 2, nc, dtype=f32, device=dev)  # one block of partial sums a program
            launch('fast.stream_kernels', 'mhc_bwd_coef', (blocks,),
                   reads=streams + (('y', 'Ar0', 'b0') if wr is not None else ()) +
                   ('L', 'r', 'bias', 'apre', 'apost', 'ares', 'dx') + (('dAr', 'dbt') if has_dr else ()),
                   writes=('dl', 'cf', 'gb'), flops=N * 2 * m * d, num_warps=8,
                   L=L, r=r, bias=bias, apre=a_pre, apost=a_post, ares=a_res, dx=dx,
                   dAr=dA_r if has_dr else dummy, dbt=dbeta if has_dr else dummy, dl=dl, cf=cf, gb=g[:, m * d:],
                   HAS_DR=has_dr,
                   **mine, **{k: v for k, v in TritonOps._mhc_consts(spec, d, TritonOps.BT_BWD, TritonOps.BDC).items()
                              if k != 'eps'})
        else:
            phi = r = dl = cf = A_m = dx = g = dummy
        blocks = triton_cdiv(N, TritonOps.BT_BWD)
        dH = torch.empty(base.shape, dtype=f32, device=dev)
        dy = torch.empty_like(y) if wr is not None else dummy
        dAr0, db0 = (torch.empty_like(A_r0), torch.empty_like(b0)) if wr is not None else (dummy, dummy)
        launch('fast.stream_kernels', 'mhc_bwd', (blocks,),
               reads=streams + (('y', 'Ar0', 'b0') if wr is not None else ()) + (('dHn',) if dHn is not None else ()) +
               (('r', 'Am', 'phi', 'dl', 'cf', 'dx') if read else ()),
               writes=('dH',) + (('dy', 'dAr0', 'db0') if wr is not None else ()) + (('g_phi',) if read else ()),
               flops=N * (6 * m * m * d * (wr is not None) + 2 * m * m * d * (src is not None)
                          + (4 * m * d * (m * m + 2 * m) + 2 * m * d) * read), num_warps=8,
               r=r, Am=A_m, phi=phi, dl=dl, cf=cf, dHn=dummy if dHn is None else dHn.contiguous(), dx=dx, dH=dH, dy=dy,
               dAr0=dAr0, db0=db0, g_phi=g, READ=read, HAS_DHN=dHn is not None, **mine,
               **{k: v for k, v in TritonOps._mhc_consts(spec, d, TritonOps.BT_BWD, TritonOps.BDC_BWD).items()
                  if k not in ('eps', 'sk_eps', 'iters', 'LIGER')})
        dparams = None
        if read:
            tot = g.sum(0)
            dparams = (tot[:m * d], tot[m * d], tot[m * d + 1, 0], tot[m * d + 1, 1], tot[m * d + 1, 2])
        if wr is None:
            return dH, None, None, None, dparams
        return dH, dy, dAr0, db0, dparams


def triton_cdiv(a, b):
    return -(-a // b)


# ---- the autograd of one sublayer's streams ----------------------------------------------

class Step(torch.autograd.Function):
    """H', x, A_m, A_r, beta = Step.apply(ops, spec, src, virtual, H, y, A_r0, beta0, *params): the
    write of sublayer k (y, A_r0, beta0; all None: no write, H is read as it is) and the
    coefficients and read of sublayer k + 1 (its routing parameters; none: no read). src: None (H
    is kept for the backward), or (H_s, y_s, A_r_s, beta_s), the write that made H, kept in its
    place (H, a placeholder then, is recomputed from it forward and backward). virtual: H' is not
    written (a placeholder of its shape is returned: the next step takes this one's write as its
    src). Outputs that do not apply are None."""

    @staticmethod
    def forward(ctx, ops, spec, src, virtual, H, y, A_r0, beta0, *params):
        wr = None if y is None else (y, A_r0, beta0)
        with no_autocast(H):
            Hn, x, A_m, A_r, beta, stats = ops.forward(spec, H, src, wr, params or None, store=not virtual)
        if virtual:
            Hn = torch.empty(1, dtype=H.dtype, device=H.device).expand(H.shape)  # never read
        kept = (H,) if src is None else tuple(src)
        ctx.ops, ctx.spec, ctx.src, ctx.wr, ctx.n = ops, spec, src is not None, wr is not None, len(params)
        ctx.save_for_backward(*kept, *(wr or ()), *params, *(stats or ()), *(() if A_m is None else (A_m,)))
        ctx.set_materialize_grads(False)
        return Hn, x, A_m, A_r, beta

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dHn, dx, dA_m, dA_r, dbeta):
        saved = list(ctx.saved_tensors)
        ops, spec = ctx.ops, ctx.spec
        src = saved[:4] if ctx.src else None
        H = None if ctx.src else saved[0]
        rest = saved[4 if ctx.src else 1:]
        wr = tuple(rest[:3]) if ctx.wr else None
        rest = rest[3 if ctx.wr else 0:]
        params, rest = tuple(rest[:ctx.n]), rest[ctx.n:]
        stats, A_m = (tuple(rest[:-1]), rest[-1]) if params else (None, None)
        if dx is None and dA_m is None and dA_r is None and dbeta is None:
            params = ()  # the read was not used (a step planned for a call that did not come)
        with no_autocast(saved[0]):
            dH, dy, dA_r0, dbeta0, dparams = ops.backward(spec, H, src, wr, params or None, stats, A_m,
                                                           dHn, dx, dA_m, dA_r, dbeta)
        return (None, None, None, None, dH, dy, dA_r0, dbeta0, *(dparams or (None,) * ctx.n))


def step(ops, spec, H, wr, route, src=None, virtual=False):
    """Step.apply with the write wr = (y, A_r, beta) or None and the next route or None."""
    params = route_params(spec, route) if route is not None else ()
    return Step.apply(ops, spec, src, virtual, H, *(wr or (None, None, None)), *params)


def block(ops):
    """MultiStream.block(H, b, layer, rope) on `Step`s with `ops` (module docstring)."""
    @torch.compiler.disable
    def fused(self, H, b, layer, rope):
        spec, p = Spec.of(self), self.layers[b]
        pending = getattr(H, PENDING, None)
        if pending is not None and pending[0] is p.attn_route:
            _, x, A_m, A_r, beta = pending          # planned by the step that made H
        else:
            _, x, A_m, A_r, beta = step(ops, spec, H, None, p.attn_route)
        self.record(b, 0, read=A_m, mix=A_r, write=beta)
        y = layer.attn(p.attn_norm(x), rope)
        wr = (y, A_r, beta)
        H1, x, A_m, A_r, beta = step(ops, spec, H, wr, p.mlp_route, virtual=True)  # H1: made again by the next step
        self.record(b, 1, read=A_m, mix=A_r, write=beta)
        y1 = layer.mlp(p.mlp_norm(x))
        nxt = self.layers[b + 1].attn_route if b + 1 < len(self.layers) else None
        H2, *read = step(ops, spec, H1, (y1, A_r, beta), nxt, src=(H, *wr))  # H1 made from H, never kept
        if nxt is not None:
            setattr(H2, PENDING, (nxt, *read))
        return H2
    return fused


# ---- liger_kernel (CUDA): the published kernels the steps are measured against -------------

def liger_phi_columns(m, device):
    """Our phi/bias columns in Liger's order: [pre | post | res], its res block (out, in)
    row-major where ours is (in, out): Liger's column 2m + o m + i is our 2m + i m + o."""
    res = 2 * m + torch.arange(m * m, device=device).view(m, m).t().reshape(-1)
    return torch.cat([torch.arange(2 * m, device=device), res])


def liger_coefficients(self, H, route):
    """MHC.coefficients on liger_mhc_coeffs: exact for mhc_sinkhorn='liger' (Liger's order
    and eps 1e-6), rms eps = cfg.norm_eps; the Sinkhorn is cfg.mhc_sinkhorn_iters rounds."""
    from liger_kernel.transformers.functional import liger_mhc_coeffs
    m = self.m
    cols = liger_phi_columns(m, H.device)
    H_pre, H_post, H_res = liger_mhc_coeffs(H, route.phi[:, cols], route.bias[cols], route.alpha_pre,
                                            route.alpha_post, route.alpha_res, allow_fp32=True,
                                            tmax=self.cfg.mhc_sinkhorn_iters, rms_eps=self.cfg.norm_eps,
                                            pre_eps=0.0, sinkhorn_eps=LIGER_SINKHORN_EPS, post_mult=2.0)
    return H_pre, H_res.transpose(-1, -2), H_post             # H_res back to (in, out)


def liger_read(self, H, A_m):
    from liger_kernel.transformers.functional import liger_mhc_pre
    return liger_mhc_pre(H, A_m)


def liger_write(self, H, A_r, beta, y):
    from liger_kernel.transformers.functional import liger_mhc_post_res
    return liger_mhc_post_res(H, y, beta, A_r.transpose(-1, -2))
