"""
Triton kernels of the fused HC / mHC stream steps (fast/streams.py, which launches them through
perf/launch.py and documents the math). Tokens are rows of N = B * T; a token's streams are m
rows of d = D features (H (N, m, D) fp32), padded to MP = next power of 2 >= m streams and BD
lanes. Every accumulation is fp32; the branch output y is read and its gradient written in its
own dtype.

    hc_fwd    one program per token, its m x D streams in registers: the write, HC's
              coefficients of the next sublayer and its read, from one read of H and y
    hc_bwd    a grid of programs, each over a strided set of tokens: the step's backward
              from one read of (dH', dx, H, y), the routing parameters' gradients summed per
              program; H optionally recomputed from the write that made it
    mhc_fwd   one program per block of BT tokens: pass 1 over D in chunks (the write, x' phi as
              products with phi's chunk, sum of squares), then the gates and Sinkhorn rounds in
              registers, pass 2 the read of the written streams (the program's own tile)
    mhc_bwd   one program per block of BT tokens: pass 1 the read's gradient H'.dx, the
              coefficients' backward (Sinkhorn rounds recomputed from their logits), pass 2
              the step's gradients; phi's gradient as one partial per block
"""

import triton
import triton.language as tl


@triton.jit
def _tanh(z):
    """tanh in fp32 from exp (series below 1/8, where 1 - exp(-2|z|) would cancel)."""
    a = tl.abs(z)
    t = tl.exp(-2.0 * a)
    big = (1.0 - t) / (1.0 + t)
    z2 = z * z
    small = a * (1.0 - z2 / 3.0 * (1.0 - 0.4 * z2 * (1.0 - 17.0 / 42.0 * z2)))
    return tl.where(z < 0, -1.0, 1.0) * tl.where(a < 0.125, small, big)


@triton.jit
def _mix(A, X):
    """Y[t] = sum_s A[s, t] X[s]: A [MP, MP], X [MP, BD] -> [MP, BD]."""
    return tl.sum(A[:, :, None] * X[:, None, :], axis=0)


@triton.jit
def _write(X, yv, A, b):
    """The write of one token: A^T X + b (x) y."""
    return _mix(A, X) + b[:, None] * yv[None, :]


@triton.jit
def _load_write(H, y, Ar, bt, t, M, D, rows, offs, m2, mm):
    """X, y (fp32), A_r [MP, MP], beta [MP] of token t."""
    X = tl.load(H + (t * M + rows[:, None]) * D + offs[None, :], mask=m2, other=0.0)
    yv = tl.load(y + t * D + offs, mask=offs < D, other=0.0).to(tl.float32)
    A = tl.load(Ar + t * M * M + rows[:, None] * M + rows[None, :], mask=mm, other=0.0)
    b = tl.load(bt + t * M + rows, mask=rows < M, other=0.0)
    return X, yv, A, b


@triton.jit
def _wcol(Wa, wb, c: tl.constexpr, offs, D, M: tl.constexpr):
    """Column c of W = [Wa | wb] (D, m + 2)."""
    if c < M + 1:
        w = tl.load(Wa + offs * (M + 1) + c, mask=offs < D, other=0.0)
    else:
        w = tl.load(wb + offs, mask=offs < D, other=0.0)
    return w


@triton.jit
def hc_fwd(H, y, Ar0, b0, Hs, ys, Ars, bs, Hn, x, Am, Ar, bt, Z, r, sa, sb, Wa, wb, ascale, bscale, N, D, eps,
           M: tl.constexpr, MP: tl.constexpr, CP: tl.constexpr, BD: tl.constexpr,
           WRITE: tl.constexpr, READ: tl.constexpr, SRC: tl.constexpr, STORE: tl.constexpr):
    """Token t = program: X = H[t] (m, D), or if SRC the write that made it, Ars[t]^T Hs[t] + bs[t] (x)
    ys[t]; if WRITE, X <- A_r0^T X + b0 (x) y[t], stored to Hn[t] if STORE;
    if READ, HC's coefficients of X with the next route (static_alpha sa (m, m+1), static_beta sb
    (m), W = [W_alpha | w_beta] = [Wa (D, m+1) | wb (D)], scales ascale, bscale): r = 1/rms per stream (eps),
    Z = r (X W) -> Z[t], r[t]; A = sa + ascale tanh(Z[:, :m+1]), beta = sb + bscale tanh(Z[:, m+1])
    -> Am[t] = A[:, 0], Ar[t] = A[:, 1:], bt[t] = beta; and the read x[t] = sum_s A_m[s] X[s]."""
    t = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, MP)
    offs = tl.arange(0, BD)
    cols = tl.arange(0, CP)
    m2 = (rows[:, None] < M) & (offs[None, :] < D)
    mm = (rows[:, None] < M) & (rows[None, :] < M)
    if SRC:
        Xs, ysv, As, bsv = _load_write(Hs, ys, Ars, bs, t, M, D, rows, offs, m2, mm)
        X = _write(Xs, ysv, As, bsv)
    else:
        X = tl.load(H + (t * M + rows[:, None]) * D + offs[None, :], mask=m2, other=0.0)
    if WRITE:
        yv = tl.load(y + t * D + offs, mask=offs < D, other=0.0).to(tl.float32)
        A0 = tl.load(Ar0 + t * M * M + rows[:, None] * M + rows[None, :], mask=mm, other=0.0)
        b = tl.load(b0 + t * M + rows, mask=rows < M, other=0.0)
        X = _write(X, yv, A0, b)
        if STORE:
            tl.store(Hn + (t * M + rows[:, None]) * D + offs[None, :], X, mask=m2)
    if READ:
        C: tl.constexpr = M + 2
        rr = tl.rsqrt(tl.sum(X * X, axis=1) / D + eps)                               # [MP]
        P = tl.zeros([MP, CP], tl.float32)
        for c in tl.static_range(C):
            w = _wcol(Wa, wb, c, offs, D, M)
            P += tl.where(cols[None, :] == c, tl.sum(X * w[None, :], axis=1)[:, None], 0.0)
        Zt = P * rr[:, None]
        cm = (rows[:, None] < M) & (cols[None, :] < C)
        tl.store(Z + (t * M + rows[:, None]) * C + cols[None, :], Zt, mask=cm)
        tl.store(r + t * M + rows, rr, mask=rows < M)
        T = _tanh(Zt)
        alpha = tl.load(sa + rows[:, None] * (M + 1) + cols[None, :], mask=(rows[:, None] < M) & (cols[None, :] < M + 1),
                        other=0.0) + tl.load(ascale) * T
        beta = tl.load(sb + rows, mask=rows < M, other=0.0) + \
            tl.load(bscale) * tl.sum(tl.where(cols[None, :] == M + 1, T, 0.0), axis=1)
        a_m = tl.sum(tl.where(cols[None, :] == 0, alpha, 0.0), axis=1)                # [MP]
        a_r = tl.zeros([MP, MP], tl.float32)
        for c in tl.static_range(M):
            a_r += tl.where(rows[None, :] == c, tl.sum(tl.where(cols[None, :] == c + 1, alpha, 0.0), axis=1)[:, None], 0.0)
        tl.store(Am + t * M + rows, a_m, mask=rows < M)
        tl.store(Ar + t * M * M + rows[:, None] * M + rows[None, :], a_r, mask=mm)
        tl.store(bt + t * M + rows, beta, mask=rows < M)
        tl.store(x + t * D + offs, tl.sum(a_m[:, None] * X, axis=0), mask=offs < D)


@triton.jit
def hc_bwd(H, y, Ar0, b0, Hs, ys, Ars, bs, Z, r, Am, Wa, wb, ascale, bscale, dHn, dx, dAr, dbt,
           dH, dy, dAr0, db0, g, N, D,
           M: tl.constexpr, MP: tl.constexpr, CP: tl.constexpr, BD: tl.constexpr,
           WRITE: tl.constexpr, READ: tl.constexpr, SRC: tl.constexpr, HAS_DHN: tl.constexpr,
           HAS_DR: tl.constexpr):
    """For the tokens t = pid, pid + programs, ...: the backward of hc_fwd. X = H[t], or if SRC
    recomputed as Ars[t]^T Hs[t] + bs[t] (x) ys[t]; X' = the write of X (WRITE) or X. The
    gradient of X' is G = dHn[t] (HAS_DHN) and, if READ, A_m (x) dx[t] and the coefficients'
    part from dA_m = X'.dx[t], dA_r = dAr[t], dbeta = dbt[t] (HAS_DR; else zero), with Z, r as
    hc_fwd stored them. Then dH[t] = A_r0 G, dy[t] = sum_t b0 G (y's dtype), dAr0[t][s, u] =
    X[s].G[u], db0[t] = y.G (WRITE; else dH[t] = G). The routing parameters' gradients, summed
    over the program's tokens, go to row pid of g: [m x CP (static_alpha's m+1 columns, then
    static_beta's) | CP x D (W^T) | 2 (the two scales)]."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    C: tl.constexpr = M + 2
    rows = tl.arange(0, MP)
    offs = tl.arange(0, BD)
    cols = tl.arange(0, CP)
    m2 = (rows[:, None] < M) & (offs[None, :] < D)
    mm = (rows[:, None] < M) & (rows[None, :] < M)
    cm = (rows[:, None] < M) & (cols[None, :] < C)
    acc_sa = tl.zeros([MP, CP], tl.float32)     # static_alpha (cols < m+1) and static_beta (col m+1)
    acc_sc = tl.zeros([MP, CP], tl.float32)     # the scales: dA * tanh(Z) per column
    acc_W = tl.zeros([CP, BD], tl.float32)      # W^T
    if READ:
        a_s = tl.load(ascale)
        b_s = tl.load(bscale)
    for tok in range(pid, N, programs):
        t = tok.to(tl.int64)
        if SRC:
            Xs, ysv, As, bsv = _load_write(Hs, ys, Ars, bs, t, M, D, rows, offs, m2, mm)
            X = _write(Xs, ysv, As, bsv)
        else:
            X = tl.load(H + (t * M + rows[:, None]) * D + offs[None, :], mask=m2, other=0.0)
        if WRITE:
            yv = tl.load(y + t * D + offs, mask=offs < D, other=0.0).to(tl.float32)
            A0 = tl.load(Ar0 + t * M * M + rows[:, None] * M + rows[None, :], mask=mm, other=0.0)
            b = tl.load(b0 + t * M + rows, mask=rows < M, other=0.0)
            Xn = _write(X, yv, A0, b)
        else:
            Xn = X
        if HAS_DHN:
            G = tl.load(dHn + (t * M + rows[:, None]) * D + offs[None, :], mask=m2, other=0.0)
        else:
            G = tl.zeros([MP, BD], tl.float32)
        if READ:
            dxv = tl.load(dx + t * D + offs, mask=offs < D, other=0.0)
            a_m = tl.load(Am + t * M + rows, mask=rows < M, other=0.0)
            G += a_m[:, None] * dxv[None, :]
            dA = tl.where(cols[None, :] == 0, tl.sum(Xn * dxv[None, :], axis=1)[:, None], 0.0)   # [MP, CP]
            if HAS_DR:
                for c in tl.static_range(M):
                    ga = tl.load(dAr + t * M * M + rows * M + c, mask=rows < M, other=0.0)
                    dA += tl.where(cols[None, :] == c + 1, ga[:, None], 0.0)
                dA += tl.where(cols[None, :] == M + 1, tl.load(dbt + t * M + rows, mask=rows < M, other=0.0)[:, None], 0.0)
            Zt = tl.load(Z + (t * M + rows[:, None]) * C + cols[None, :], mask=cm, other=0.0)
            rr = tl.load(r + t * M + rows, mask=rows < M, other=1.0)
            T = _tanh(Zt)
            dZ = tl.where(cols[None, :] == M + 1, b_s, a_s) * dA * (1.0 - T * T)
            acc_sa += dA
            acc_sc += dA * T
            dP = dZ * rr[:, None]                                                        # [MP, CP]
            G -= (rr * rr * rr * tl.sum(dZ * Zt / rr[:, None], axis=1) / D)[:, None] * Xn
            for c in tl.static_range(C):
                dp = tl.sum(tl.where(cols[None, :] == c, dP, 0.0), axis=1)                 # [MP]
                w = _wcol(Wa, wb, c, offs, D, M)
                G += dp[:, None] * w[None, :]
                acc_W += tl.where(cols[:, None] == c, tl.sum(dp[:, None] * Xn, axis=0)[None, :], 0.0)
        if WRITE:
            tl.store(dH + (t * M + rows[:, None]) * D + offs[None, :], tl.sum(A0[:, :, None] * G[None, :, :], axis=1),
                     mask=m2)
            tl.store(dy + t * D + offs, tl.sum(b[:, None] * G, axis=0).to(dy.dtype.element_ty), mask=offs < D)
            tl.store(dAr0 + t * M * M + rows[:, None] * M + rows[None, :],
                     tl.sum(X[:, None, :] * G[None, :, :], axis=2), mask=mm)
            tl.store(db0 + t * M + rows, tl.sum(G * yv[None, :], axis=1), mask=rows < M)
        else:
            tl.store(dH + (t * M + rows[:, None]) * D + offs[None, :], G, mask=m2)
    if READ:
        row = g + pid * (M * CP + CP * D + 2)
        tl.store(row + rows[:, None] * CP + cols[None, :], acc_sa, mask=cm)
        tl.store(row + M * CP + cols[:, None] * D + offs[None, :], acc_W, mask=(cols[:, None] < C) & (offs[None, :] < D))
        sc = tl.sum(tl.sum(tl.where(cols[None, :] < M + 1, acc_sc, 0.0), axis=1), axis=0)
        tc = tl.sum(tl.sum(tl.where(cols[None, :] == M + 1, acc_sc, 0.0), axis=1), axis=0)
        tl.store(row + M * CP + CP * D + tl.arange(0, 2), tl.where(tl.arange(0, 2) == 0, sc, tc))


# ---- mHC: blocks of BT tokens, D in chunks of BDC ------------------------------------------

@triton.jit
def _lanes(M: tl.constexpr, MP: tl.constexpr):
    """The 32 lanes of the product l = x' phi (MP = 4): pre of stream j at lane j, post at 4 + j,
    res (in i, out o) at 16 + 4 i + o; -> (phi's column of each lane, whether it holds one). phi's
    columns: [pre (m) | post (m) | res (m^2, (in, out) row-major)]."""
    j = tl.arange(0, 32)
    i, o = (j - 16) // MP, (j - 16) % MP
    col = tl.where(j < MP, j, tl.where(j < 16, M + j - MP, 2 * M + i * M + o))
    ok = tl.where(j < MP, j < M, tl.where(j < 2 * MP, j - MP < M, (j >= 16) & (i < M) & (o < M)))
    return col, ok


@triton.jit
def _split(l, BT: tl.constexpr, MP: tl.constexpr):
    """Lanes l [BT, 32] -> ([pre | post | pad] [BT, 16], res [BT, MP, MP])."""
    two = tl.reshape(l, [BT, 2, 16])
    k = tl.arange(0, 2)
    pp = tl.sum(tl.where(k[None, :, None] == 0, two, 0.0), axis=1)
    rs = tl.sum(tl.where(k[None, :, None] == 1, two, 0.0), axis=1)
    return pp, tl.reshape(rs, [BT, MP, MP])


@triton.jit
def _join(pp, rs, BT: tl.constexpr, MP: tl.constexpr):
    """The inverse of `_split`: [BT, 16], [BT, MP, MP] -> lanes [BT, 32]."""
    k = tl.arange(0, 2)
    two = tl.where(k[None, :, None] == 0, pp[:, None, :], tl.reshape(rs, [BT, 16])[:, None, :])
    return tl.reshape(two, [BT, 32])


@triton.jit
def _streams3(H, toks, rows, offs, M, D, ok):
    """H's chunk [BT, MP, BDC] of the tokens toks (fp32)."""
    return tl.load(H + (toks[:, None, None] * M + rows[None, :, None]) * D + offs[None, None, :], mask=ok, other=0.0)


@triton.jit
def _mix_y(X3, yv, Ar, bt, toks, rows, tm, M):
    """The write of a chunk X3 [BT, MP, BDC] with y's chunk yv [BT, BDC]: Ar^T X3 + bt (x) yv."""
    out = tl.load(bt + toks[:, None] * M + rows[None, :], mask=tm[:, None] & (rows[None, :] < M), other=0.0)[:, :, None] \
        * yv[:, None, :]
    for s in tl.static_range(M):
        a = tl.load(Ar + toks[:, None] * M * M + s * M + rows[None, :], mask=tm[:, None] & (rows[None, :] < M), other=0.0)
        out += a[:, :, None] * _row(X3, rows, s)[:, None, :]
    return out


@triton.jit
def _mix_in(X3, y, Ar, bt, toks, rows, offs, tm, M, D):
    """The write of a chunk X3 [BT, MP, BDC] already loaded: Ar^T X3 + bt (x) y."""
    yv = tl.load(y + toks[:, None] * D + offs[None, :], mask=tm[:, None] & (offs[None, :] < D), other=0.0).to(tl.float32)
    return _mix_y(X3, yv, Ar, bt, toks, rows, tm, M)


@triton.jit
def _mix3(H, y, Ar, bt, toks, rows, offs, tm, M, D, ok):
    """The write of a chunk of H's streams: Ar^T X + bt (x) y [BT, MP, BDC]."""
    return _mix_in(_streams3(H, toks, rows, offs, M, D, ok), y, Ar, bt, toks, rows, offs, tm, M, D)


@triton.jit
def _stream_in(H, Hs, ys, Ars, bs, toks, rows, offs, tm, M, D, ok, SRC: tl.constexpr):
    """A chunk of the streams a step writes from: H's, or (SRC) recomputed from the write that made them."""
    if SRC:
        X3 = _mix3(Hs, ys, Ars, bs, toks, rows, offs, tm, M, D, ok)
    else:
        X3 = _streams3(H, toks, rows, offs, M, D, ok)
    return X3


@triton.jit
def _row(X3, rows, t):
    """Stream t of a chunk [BT, MP, BDC] -> [BT, BDC]."""
    return tl.sum(tl.where(rows[None, :, None] == t, X3, 0.0), axis=1)


@triton.jit
def _sk_first(z, vm, eps, LIGER: tl.constexpr):
    """Sinkhorn's first round on logits z [BT, MP, MP] (valid entries vm): 'liger' (eps > 0)
    softmax over inputs (axis 1) + eps, then over outputs; 'plain' log_softmax over outputs
    (axis 2), then softmax over inputs. -> (P, softmax or log_softmax, the 'liger' denominator)."""
    zz = tl.where(vm, z, -1e30)  # a padded entry: finite, so that no NaN is formed and masked
    if LIGER:
        e = tl.where(vm, tl.exp(zz - tl.max(zz, axis=1, keep_dims=True)), 0.0)
        sm = e / tl.maximum(tl.sum(e, axis=1, keep_dims=True), 1e-30)
        P = tl.where(vm, sm + eps, 0.0)
        s = tl.sum(P, axis=2, keep_dims=True) + eps
        return P / s, sm, s
    mx = tl.max(zz, axis=2, keep_dims=True)
    e = tl.where(vm, tl.exp(zz - mx), 0.0)
    ls = tl.where(vm, zz - mx - tl.log(tl.maximum(tl.sum(e, axis=2, keep_dims=True), 1e-30)), 0.0)
    mx1 = tl.max(tl.where(vm, ls, -1e30), axis=1, keep_dims=True)
    e1 = tl.where(vm, tl.exp(ls - mx1), 0.0)
    ones = tl.full([z.shape[0], z.shape[1], 1], 1.0, tl.float32)  # (no denominator: the shapes of the other branch)
    return e1 / tl.maximum(tl.sum(e1, axis=1, keep_dims=True), 1e-30), ls, ones


@triton.jit
def _sk_norm(P, vm, eps, AXIS: tl.constexpr):
    """P / (sum over AXIS + eps) -> (P', denominator)."""
    s = tl.sum(P, axis=AXIS, keep_dims=True) + eps
    s = tl.where(s == 0.0, 1.0, s)  # a padded row or column (eps = 0): nothing to normalise
    return tl.where(vm, P / s, 0.0), s


@triton.jit
def _sinkhorn(z, vm, eps, iters, LIGER: tl.constexpr):
    """residuals.sinkhorn on logits [BT, MP, MP]: the first round, then iters - 1 rounds over the
    first dim (inputs, axis 1, for 'liger'; outputs, axis 2, for 'plain'), then the other."""
    FA: tl.constexpr = 1 if LIGER else 2
    LA: tl.constexpr = 3 - FA
    P, _, _ = _sk_first(z, vm, eps, LIGER)
    for _ in range(iters - 1):
        P, _ = _sk_norm(P, vm, eps, FA)
        P, _ = _sk_norm(P, vm, eps, LA)
    return P


@triton.jit
def _sinkhorn_backward(z, vm, g, eps, iters, LIGER: tl.constexpr):
    """The gradient of the logits z from g = dP through `_sinkhorn`, each round's input recomputed
    from z (no history kept: iters^2 / 2 rounds of [BT, MP, MP] in registers)."""
    FA: tl.constexpr = 1 if LIGER else 2
    LA: tl.constexpr = 3 - FA
    for k in range(iters - 1, 0, -1):      # round k (1-based after the first), last one first
        P, _, _ = _sk_first(z, vm, eps, LIGER)
        for _ in range(k - 1):
            P, _ = _sk_norm(P, vm, eps, FA)
            P, _ = _sk_norm(P, vm, eps, LA)
        a, s1 = _sk_norm(P, vm, eps, FA)
        b, s2 = _sk_norm(a, vm, eps, LA)
        g = tl.where(vm, (g - tl.sum(g * b, axis=LA, keep_dims=True)) / s2, 0.0)
        g = tl.where(vm, (g - tl.sum(g * a, axis=FA, keep_dims=True)) / s1, 0.0)
    P, aux, s = _sk_first(z, vm, eps, LIGER)
    if LIGER:   # P = (sm + eps) / s, sm = softmax over axis 1
        g = tl.where(vm, (g - tl.sum(g * P, axis=2, keep_dims=True)) / s, 0.0)
        g = tl.where(vm, aux * (g - tl.sum(g * aux, axis=1, keep_dims=True)), 0.0)
    else:       # P = softmax(ls, axis 1), ls = log_softmax(z, axis 2)
        g = tl.where(vm, P * (g - tl.sum(g * P, axis=1, keep_dims=True)), 0.0)
        g = tl.where(vm, g - tl.exp(aux) * tl.sum(g, axis=2, keep_dims=True), 0.0)
    return g


@triton.jit
def _gates(l, bias, apre, apost, ares, M: tl.constexpr, MP: tl.constexpr, BT: tl.constexpr):
    """(l_pre, l_post [BT, MP], l_res [BT, MP, MP], H_pre, H_post, Sinkhorn logits, valid mask) from
    the lanes l [BT, 32] of x' phi."""
    rows = tl.arange(0, MP)
    pp, l_res = _split(l, BT, MP)
    pp3 = tl.reshape(pp, [BT, 16 // MP, MP])
    k = tl.arange(0, 16 // MP)
    l_pre = tl.sum(tl.where(k[None, :, None] == 0, pp3, 0.0), axis=1)
    l_post = tl.sum(tl.where(k[None, :, None] == 1, pp3, 0.0), axis=1)
    sm = rows < M
    vm = (sm[:, None] & sm[None, :])[None, :, :]
    b_pre = tl.load(bias + rows, mask=sm, other=0.0)
    b_post = tl.load(bias + M + rows, mask=sm, other=0.0)
    b_res = tl.load(bias + 2 * M + rows[:, None] * M + rows[None, :], mask=sm[:, None] & sm[None, :], other=0.0)
    H_pre = tl.sigmoid(tl.load(apre) * l_pre + b_pre[None, :])
    H_post = 2.0 * tl.sigmoid(tl.load(apost) * l_post + b_post[None, :])
    z = tl.load(ares) * l_res + b_res[None, :, :]
    return l_pre, l_post, l_res, H_pre, H_post, z, vm


@triton.jit
def mhc_fwd(H, y, Ar0, b0, Hs, ys, Ars, bs, Hn, x, Am, Ar, bt, L, r, phi, bias, apre, apost, ares, N, D, eps,
            sk_eps, iters, M: tl.constexpr, MP: tl.constexpr, BT: tl.constexpr, BDC: tl.constexpr,
            WRITE: tl.constexpr, READ: tl.constexpr, SRC: tl.constexpr, STORE: tl.constexpr, LIGER: tl.constexpr):
    """Tokens of block pid: X = H (m, D) per token, or if SRC the write that made it, Ars^T Hs +
    bs (x) ys; if WRITE, X <- A_r0^T X + b0 (x) y, stored to Hn if STORE; if READ, mHC's
    coefficients of X with the next route (phi (m D, m^2 + 2m), bias, the gates apre, apost, ares):
    r = 1/rms(vec X) (eps), l = r (vec X) phi -> L (N, m^2 + 2m) and r (N);
    H_pre = sigmoid(apre l_pre + b_pre) -> Am, H_post = 2 sigmoid(apost l_post + b_post) -> bt,
    H_res = Sinkhorn(ares l_res + b_res) (iters rounds, sk_eps, order LIGER) -> Ar; then (pass 2
    over the stored X, or over H and y again when X is not stored) the read x = sum_s H_pre[s] X[s].
    m = 3 or 4 (MP = 4)."""
    pid = tl.program_id(0)
    toks = (pid * BT + tl.arange(0, BT)).to(tl.int64)
    tm = toks < N
    rows = tl.arange(0, MP)
    NC: tl.constexpr = M * M + 2 * M
    col, cok = _lanes(M, MP)
    lacc = tl.zeros([BT, 32], tl.float32)
    ss = tl.zeros([BT], tl.float32)
    for c0 in range(0, D, BDC):
        offs = c0 + tl.arange(0, BDC)
        ok = tm[:, None, None] & (rows[None, :, None] < M) & (offs[None, None, :] < D)
        X3 = _stream_in(H, Hs, ys, Ars, bs, toks, rows, offs, tm, M, D, ok, SRC)
        if WRITE:
            X3 = _mix_in(X3, y, Ar0, b0, toks, rows, offs, tm, M, D)
            if STORE:
                tl.store(Hn + (toks[:, None, None] * M + rows[None, :, None]) * D + offs[None, None, :], X3, mask=ok)
        if READ:
            ss += tl.sum(tl.sum(X3 * X3, axis=2), axis=1)
            dm = offs < D
            for t in tl.static_range(M):
                pl = tl.load(phi + (t * D + offs)[:, None] * NC + col[None, :], mask=dm[:, None] & cok[None, :], other=0.0)
                lacc += tl.dot(_row(X3, rows, t), pl, input_precision="ieee")
    if READ:
        rr = tl.rsqrt(ss / (M * D) + eps)
        l = lacc * rr[:, None]
        tl.store(L + toks[:, None] * NC + col[None, :], l, mask=tm[:, None] & cok[None, :])
        tl.store(r + toks, rr, mask=tm)
        _, _, _, H_pre, H_post, z, vm = _gates(l, bias, apre, apost, ares, M, MP, BT)
        P = _sinkhorn(z, vm, sk_eps, iters, LIGER)
        sm = tm[:, None] & (rows[None, :] < M)
        tl.store(Am + toks[:, None] * M + rows[None, :], H_pre, mask=sm)
        tl.store(bt + toks[:, None] * M + rows[None, :], H_post, mask=sm)
        tl.store(Ar + toks[:, None, None] * M * M + rows[None, :, None] * M + rows[None, None, :], P,
                 mask=tm[:, None, None] & vm)
        # pass 2: the read, over the streams this program just wrote (or read)
        tl.debug_barrier()
        for c0 in range(0, D, BDC):
            offs = c0 + tl.arange(0, BDC)
            ok = tm[:, None, None] & (rows[None, :, None] < M) & (offs[None, None, :] < D)
            if WRITE and STORE:
                X3 = _streams3(Hn, toks, rows, offs, M, D, ok)
            else:
                X3 = _stream_in(H, Hs, ys, Ars, bs, toks, rows, offs, tm, M, D, ok, SRC)
                if WRITE:
                    X3 = _mix_in(X3, y, Ar0, b0, toks, rows, offs, tm, M, D)
            tl.store(x + toks[:, None] * D + offs[None, :], tl.sum(H_pre[:, :, None] * X3, axis=1),
                     mask=tm[:, None] & (offs[None, :] < D))


@triton.jit
def mhc_bwd_coef(H, y, Ar0, b0, Hs, ys, Ars, bs, L, r, bias, apre, apost, ares, dx, dAr, dbt,
                 dl, cf, gb, N, D, sk_eps, iters,
                 M: tl.constexpr, MP: tl.constexpr, BT: tl.constexpr, BDC: tl.constexpr,
                 WRITE: tl.constexpr, SRC: tl.constexpr, HAS_DR: tl.constexpr, LIGER: tl.constexpr):
    """The coefficients' backward of mhc_fwd for the tokens of block pid. X = H, or if SRC
    recomputed as Ars^T Hs + bs (x) ys; X' = the write of X (WRITE) or X. Pass over D: the read's
    gradient dA_m = X'.dx per stream; then with dH_res = dAr, dH_post = dbt (HAS_DR; else zero)
    and the coefficients recomputed from L, r (the Sinkhorn rounds from their logits): the
    gradient of l = x' phi -> dl (N, m^2 + 2m), c = r^2 (l . dl) / (m D) -> cf (N), and the bias'
    and the gates' gradients summed over the block -> gb[pid] (2, m^2 + 2m; rows m D and m D + 1
    of the block's partial sums (m D + 2, m^2 + 2m), whose rows 0 .. m D - 1 mhc_bwd fills with phi's)."""
    pid = tl.program_id(0)
    toks = (pid * BT + tl.arange(0, BT)).to(tl.int64)
    tm = toks < N
    rows = tl.arange(0, MP)
    sm = tm[:, None] & (rows[None, :] < M)
    NC: tl.constexpr = M * M + 2 * M
    col, cok = _lanes(M, MP)
    gpre = tl.zeros([BT, MP], tl.float32)
    for c0 in range(0, D, BDC):
        offs = c0 + tl.arange(0, BDC)
        ok = tm[:, None, None] & (rows[None, :, None] < M) & (offs[None, None, :] < D)
        X3 = _stream_in(H, Hs, ys, Ars, bs, toks, rows, offs, tm, M, D, ok, SRC)
        if WRITE:
            X3 = _mix_in(X3, y, Ar0, b0, toks, rows, offs, tm, M, D)
        dxv = tl.load(dx + toks[:, None] * D + offs[None, :], mask=tm[:, None] & (offs[None, :] < D), other=0.0)
        gpre += tl.sum(X3 * dxv[:, None, :], axis=2)
    l = tl.load(L + toks[:, None] * NC + col[None, :], mask=tm[:, None] & cok[None, :], other=0.0)
    rr = tl.load(r + toks, mask=tm, other=1.0)
    l_pre, l_post, l_res, H_pre, H_post, z, vm = _gates(l, bias, apre, apost, ares, M, MP, BT)
    u_pre = tl.where(sm, gpre * H_pre * (1.0 - H_pre), 0.0)
    if HAS_DR:
        u_post = tl.load(dbt + toks[:, None] * M + rows[None, :], mask=sm, other=0.0) * H_post * (1.0 - 0.5 * H_post)
        gP = tl.load(dAr + toks[:, None, None] * M * M + rows[None, :, None] * M + rows[None, None, :],
                     mask=tm[:, None, None] & vm, other=0.0)
        g_res = tl.where(tm[:, None, None] & vm, _sinkhorn_backward(z, vm, gP, sk_eps, iters, LIGER), 0.0)
    else:
        u_post = tl.zeros([BT, MP], tl.float32)
        g_res = tl.zeros([BT, MP, MP], tl.float32)
    u_post = tl.where(sm, u_post, 0.0)
    j = tl.arange(0, 32)
    gate = tl.where(j == 0, tl.sum(tl.sum(u_pre * l_pre, axis=1), axis=0), 0.0) + \
        tl.where(j == 1, tl.sum(tl.sum(u_post * l_post, axis=1), axis=0), 0.0) + \
        tl.where(j == 2, tl.sum(tl.sum(tl.sum(g_res * l_res, axis=2), axis=1), axis=0), 0.0)
    g_bias = gb + pid * (M * D + 2) * NC
    tl.store(g_bias + NC + j, gate, mask=j < NC)
    tl.store(g_bias + rows, tl.sum(u_pre, axis=0), mask=rows < M)
    tl.store(g_bias + M + rows, tl.sum(u_post, axis=0), mask=rows < M)
    tl.store(g_bias + 2 * M + rows[:, None] * M + rows[None, :], tl.sum(g_res, axis=0),
             mask=(rows[:, None] < M) & (rows[None, :] < M))
    # dl in the lanes of l, stored in phi's column order
    k = tl.arange(0, 16 // MP)
    pp = tl.reshape(tl.where(k[None, :, None] == 0, (tl.load(apre) * u_pre)[:, None, :], 0.0) +
                    tl.where(k[None, :, None] == 1, (tl.load(apost) * u_post)[:, None, :], 0.0), [BT, 16])
    dlv = _join(pp, tl.load(ares) * g_res, BT, MP)
    tl.store(dl + toks[:, None] * NC + col[None, :], dlv, mask=tm[:, None] & cok[None, :])
    tl.store(cf + toks, rr * rr * tl.sum(l * dlv, axis=1) / (M * D), mask=tm)


@triton.jit
def mhc_bwd(H, y, Ar0, b0, Hs, ys, Ars, bs, r, Am, phi, dl, cf, dHn, dx, dH, dy, dAr0, db0, g_phi, N, D,
            M: tl.constexpr, MP: tl.constexpr, BT: tl.constexpr, BDC: tl.constexpr,
            WRITE: tl.constexpr, READ: tl.constexpr, SRC: tl.constexpr, HAS_DHN: tl.constexpr):
    """The step's gradients for the tokens of block pid, X and X' as in mhc_bwd_coef: G = dHn
    (HAS_DHN) and, if READ, H_pre (x) dx + r (phi dl) - cf X' (dl, cf from mhc_bwd_coef, H_pre = Am),
    with phi's gradient x'^T dl of the block -> rows 0 .. m D - 1 of g_phi[pid] (m D + 2, m^2 + 2m);
    the write's backward:
    dH = A_r0 G, dy = b0 G (y's dtype), dAr0 = X G^T, db0 = G y (WRITE; else dH = G)."""
    pid = tl.program_id(0)
    toks = (pid * BT + tl.arange(0, BT)).to(tl.int64)
    tm = toks < N
    rows = tl.arange(0, MP)
    sm = tm[:, None] & (rows[None, :] < M)
    NC: tl.constexpr = M * M + 2 * M
    col, cok = _lanes(M, MP)
    if READ:
        dlv = tl.load(dl + toks[:, None] * NC + col[None, :], mask=tm[:, None] & cok[None, :], other=0.0)
        c = tl.load(cf + toks, mask=tm, other=0.0)
        rr = tl.load(r + toks, mask=tm, other=1.0)
        H_pre = tl.load(Am + toks[:, None] * M + rows[None, :], mask=sm, other=0.0)
    acc_a = tl.zeros([BT, MP, MP], tl.float32)
    acc_b = tl.zeros([BT, MP], tl.float32)
    if WRITE:
        b = tl.load(b0 + toks[:, None] * M + rows[None, :], mask=sm, other=0.0)
    for c0 in range(0, D, BDC):
        offs = c0 + tl.arange(0, BDC)
        dm = offs < D
        ok = tm[:, None, None] & (rows[None, :, None] < M) & (offs[None, None, :] < D)
        X3 = _stream_in(H, Hs, ys, Ars, bs, toks, rows, offs, tm, M, D, ok, SRC)
        if HAS_DHN:
            G3 = _streams3(dHn, toks, rows, offs, M, D, ok)
        else:
            G3 = tl.zeros([BT, MP, BDC], tl.float32)
        if WRITE:
            yv = tl.load(y + toks[:, None] * D + offs[None, :], mask=tm[:, None] & dm[None, :], other=0.0).to(tl.float32)
        if READ:
            if WRITE:
                Xn3 = _mix_y(X3, yv, Ar0, b0, toks, rows, tm, M)
            else:
                Xn3 = X3
            dxv = tl.load(dx + toks[:, None] * D + offs[None, :], mask=tm[:, None] & dm[None, :], other=0.0)
            G3 += H_pre[:, :, None] * dxv[:, None, :] - c[:, None, None] * Xn3
            for t in tl.static_range(M):   # phi's gradient, x'^T dl, while X' is at hand
                xt = tl.trans(_row(Xn3, rows, t) * rr[:, None])                                       # [BDC, BT]
                tl.store(g_phi + (pid * (M * D + 2) + t * D + offs)[:, None] * NC + col[None, :],
                         tl.dot(xt, dlv, input_precision="ieee"), mask=dm[:, None] & cok[None, :])
            for t in tl.static_range(M):   # then r (phi dl) into G
                pT = tl.load(phi + (t * D + offs)[None, :] * NC + col[:, None], mask=cok[:, None] & dm[None, :],
                             other=0.0)                                                                # [32, BDC]
                gt = tl.dot(dlv, pT, input_precision="ieee")                                          # [BT, BDC]
                G3 += tl.where(rows[None, :, None] == t, (rr[:, None] * gt)[:, None, :], 0.0)
        if WRITE:
            for s in tl.static_range(M):
                a = tl.load(Ar0 + toks[:, None] * M * M + s * M + rows[None, :], mask=sm, other=0.0)  # A_r0[s, :]
                tl.store(dH + (toks[:, None] * M + s) * D + offs[None, :], tl.sum(a[:, :, None] * G3, axis=1),
                         mask=tm[:, None] & dm[None, :])
                acc_a += tl.where(rows[None, :, None] == s, tl.sum(_row(X3, rows, s)[:, None, :] * G3, axis=2)[:, None, :],
                                  0.0)
            tl.store(dy + toks[:, None] * D + offs[None, :], tl.sum(b[:, :, None] * G3, axis=1).to(dy.dtype.element_ty),
                     mask=tm[:, None] & dm[None, :])
            acc_b += tl.sum(G3 * yv[:, None, :], axis=2)
        else:
            tl.store(dH + (toks[:, None, None] * M + rows[None, :, None]) * D + offs[None, None, :], G3, mask=ok)
    if WRITE:
        tl.store(dAr0 + toks[:, None, None] * M * M + rows[None, :, None] * M + rows[None, None, :], acc_a,
                 mask=tm[:, None, None] & (rows[None, :, None] < M) & (rows[None, None, :] < M))
        tl.store(db0 + toks[:, None] * M + rows[None, :], acc_b, mask=sm)
