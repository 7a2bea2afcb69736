"""
Triton kernels of the grouped AttnRes depth read (fast/depth_read.py, which launches them
through perf/launch.py and documents the math). Tokens are rows of N = B * T; d = D features,
held in one block of BD = next power of 2 >= D lanes. Sources come as two tuples of (N, D)
pointers, the fp32 ones (`src32`, the first n32 sources) and the 16-bit ones (`src16`, the next
n16), each padded to a power-of-2 length so that few variants compile; a loop over the first n
picks source i's pointer from its tuple with a chain of selects (as fla-core's attnres kernels
do). Every accumulation is fp32.

    phase1_fwd      one program per token: online softmax of P pseudo-queries over the base
    phase2_fwd      one program per token: merge a read's phase-1 partial with its intra sources
    sum_phase2_fwd  the same with Block AttnRes's running sum P + f formed first, its one intra source
    contribute_bwd  a grid of programs, each over a strided set of tokens: the gradient of
                    each source from R reads of it (into its fp32 sink) and the R reads' u
                    gradients (added to one partial sum per program)
    finish_bwd      the same for one source, with its sink's sum and any other gradient of it:
                    its whole gradient, in its dtype
"""

import triton
import triton.language as tl


@triton.jit
def _pick(ptrs, i, N_PTRS: tl.constexpr):
    """Pointer i of the tuple `ptrs` (i a run-time scalar < N_PTRS)."""
    p = ptrs[0]
    for j in tl.static_range(1, N_PTRS):
        p = tl.where(i == j, ptrs[j], p)
    return p


@triton.jit
def _rows(ptrs, rows, N_PTRS: tl.constexpr):
    """A vector of pointers: ptrs[rows[k]] for every lane k (rows < N_PTRS)."""
    p = ptrs[0] + rows * 0
    for j in tl.static_range(1, N_PTRS):
        p = tl.where(rows == j, ptrs[j], p)
    return p


@triton.jit
def _load_src(src32, src16, i, n32, t, D, offs, mask, N32: tl.constexpr, N16: tl.constexpr):
    """Source i's row t as fp32 [BD] (sources 0..n32-1 fp32, then the 16-bit ones)."""
    if i < n32:
        v = tl.load(_pick(src32, i, N32) + t * D + offs, mask=mask, other=0.0)
    else:
        v = tl.load(_pick(src16, i - n32, N16) + t * D + offs, mask=mask, other=0.0).to(tl.float32)
    return v


@triton.jit
def phase1_fwd(src32, src16, n32, n16, U, z1, lse1, e1, a0, N, D, eps,
               P: tl.constexpr, BD: tl.constexpr):
    """Per token t: for each of the P reads, over the n0 = n32 + n16 base sources, e[p, i] =
    rstd_i (v_i . U[p]) -> e1[p, i, t]; lse1[p, t] = logsumexp_i e[p, i]; z1[p][t] =
    sum_i softmax_i(e[p, :]) v_i; a0[i, t] = exp(e[0, i] - lse1[0, t]). U (P, D) fp32; z1 a
    tuple of P (N, D) fp32 outputs."""
    t = tl.program_id(0).to(tl.int64)
    N32: tl.constexpr = len(src32)
    N16: tl.constexpr = len(src16)
    PP: tl.constexpr = triton.next_power_of_2(P)
    offs = tl.arange(0, BD)
    mask = offs < D
    rows = tl.arange(0, PP)
    rmask = rows < P
    u = tl.load(U + rows[:, None] * D + offs[None, :], mask=rmask[:, None] & mask[None, :], other=0.0)  # [PP, BD]
    m = tl.full([PP], float('-inf'), tl.float32)
    s = tl.zeros([PP], tl.float32)
    acc = tl.zeros([PP, BD], tl.float32)
    n0 = n32 + n16
    for i in range(n0):
        v = _load_src(src32, src16, i, n32, t, D, offs, mask, N32, N16)
        rstd = tl.rsqrt(tl.sum(v * v, axis=0) / D + eps)
        e = tl.sum(u * v[None, :], axis=1) * rstd                                 # [PP]
        tl.store(e1 + (rows * n0 + i) * N + t, e, mask=rmask)
        m_new = tl.maximum(m, e)
        scale = tl.exp(m - m_new)
        w = tl.exp(e - m_new)
        s = s * scale + w
        acc = acc * scale[:, None] + w[:, None] * v[None, :]
        m = m_new
    lse = m + tl.log(s)
    tl.store(lse1 + rows * N + t, lse, mask=rmask)
    out = _rows(z1, rows, P)
    tl.store(out[:, None] + t * D + offs[None, :], acc / s[:, None], mask=rmask[:, None] & mask[None, :])
    # the first read's weights over the base, a0[i, t] = exp(e[0, i] - lse[0]), from the scores stored above
    lse0 = tl.sum(tl.where(rows == 0, lse, 0.0), axis=0)
    tl.debug_barrier()
    for i in range(n0):
        tl.store(a0 + i * N + t, tl.exp(tl.load(e1 + i * N + t) - lse0))


@triton.jit
def phase2_fwd(z1, lse1, e1, src32, src16, n32, n16, u, z, a, lse, N, n0, D, eps,
               BD: tl.constexpr):
    """Per token t: merge the phase-1 partial (z1[t], lse1[t]) with the m = n32 + n16 intra
    sources, e_j = rstd_j (v_j . u): z[t], lse[t], and a[:, t] = exp([e1[:, t], e] - lse)."""
    t = tl.program_id(0).to(tl.int64)
    N32: tl.constexpr = len(src32)
    N16: tl.constexpr = len(src16)
    offs = tl.arange(0, BD)
    mask = offs < D
    uu = tl.load(u + offs, mask=mask, other=0.0)
    m = tl.load(lse1 + t)
    s = tl.full([], 1.0, tl.float32)
    acc = tl.load(z1 + t * D + offs, mask=mask, other=0.0)
    for j in range(n32 + n16):
        v = _load_src(src32, src16, j, n32, t, D, offs, mask, N32, N16)
        e = tl.sum(v * uu, axis=0) * tl.rsqrt(tl.sum(v * v, axis=0) / D + eps)
        tl.store(a + (n0 + j) * N + t, e)  # the raw score, normalised below
        m_new = tl.maximum(m, e)
        scale = tl.exp(m - m_new)
        w = tl.exp(e - m_new)
        s = s * scale + w
        acc = acc * scale + w * v
        m = m_new
    out = m + tl.log(s)
    tl.store(z + t * D + offs, acc / s, mask=mask)
    tl.store(lse + t, out)
    tl.debug_barrier()  # the raw scores above, written by this program, are read back
    for i in range(n0):
        tl.store(a + i * N + t, tl.exp(tl.load(e1 + i * N + t) - out))
    for j in range(n32 + n16):
        tl.store(a + (n0 + j) * N + t, tl.exp(tl.load(a + (n0 + j) * N + t) - out))


@triton.jit
def sum_phase2_fwd(z1, lse1, e1, f, prev, u, z, a, P, N, n0, D, eps, HAS_PREV: tl.constexpr, BD: tl.constexpr):
    """Per token t: P[t] = f[t] (as fp32), plus prev[t] if HAS_PREV (Block AttnRes's running
    sum), then phase2_fwd with P the one intra source: z[t], and a[:, t] = exp([e1[:, t], e] - lse)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BD)
    mask = offs < D
    x = tl.load(f + t * D + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_PREV:
        x += tl.load(prev + t * D + offs, mask=mask, other=0.0)
    tl.store(P + t * D + offs, x, mask=mask)
    e = tl.sum(x * tl.load(u + offs, mask=mask, other=0.0), axis=0) * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    m1 = tl.load(lse1 + t)
    m = tl.maximum(m1, e)
    w1, w = tl.exp(m1 - m), tl.exp(e - m)
    s = w1 + w
    lse = m + tl.log(s)
    tl.store(z + t * D + offs, (w1 * tl.load(z1 + t * D + offs, mask=mask, other=0.0) + w * x) / s, mask=mask)
    for i in range(n0):
        tl.store(a + i * N + t, tl.exp(tl.load(e1 + i * N + t) - lse))
    tl.store(a + n0 * N + t, tl.exp(e - lse))


@triton.jit
def contribute_bwd(src32, src16, n32, n16, U, gz, aw, c, zs, c_mask, bufs, write_mask, add_mask, gu, row0, P,
                   N, D, eps, R: tl.constexpr, BD: tl.constexpr):
    """For the tokens t = pid, pid + programs, ...: with the R reads (group rows row0 + r) of the
    n = n32 + n16 sources, their gz[r][t], weights a = aw[r][i, t] (as the forward computed them),
    c = c[r, t] (for the reads in c_mask formed here, c = gz . zs[r], and stored there), for each
    source i (rstd = 1/rms(v), e = rstd (v . U[row0 + r]), p = gz . v, ge = a (p - c)):
        g_i = sum_r a_r gz_r + rstd sum_r ge_r U[row0 + r] - rstd^2 (sum_r ge_r e_r) v / D
    written to bufs[i] (bit i of write_mask; added to it if bit i of add_mask), and
    gu[pid, row0 + r] += the program's sum over its tokens and the sources of ge_r rstd v."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    N32: tl.constexpr = len(src32)
    N16: tl.constexpr = len(src16)
    NB: tl.constexpr = len(bufs)
    RR: tl.constexpr = triton.next_power_of_2(R)
    offs = tl.arange(0, BD)
    mask = offs < D
    rows = tl.arange(0, RR)
    rmask = rows < R
    m2 = rmask[:, None] & mask[None, :]
    u = tl.load(U + (row0 + rows[:, None]) * D + offs[None, :], mask=m2, other=0.0)   # [RR, BD]
    own_c = ((c_mask >> rows) & 1) == 1                                                 # [RR]: c formed here
    g_u = tl.zeros([RR, BD], tl.float32)
    n = n32 + n16
    for tok in range(pid, N, programs):
        t = tok.to(tl.int64)
        g = tl.load(_rows(gz, rows, R)[:, None] + t * D + offs[None, :], mask=m2, other=0.0)   # [RR, BD]
        zz = tl.load(_rows(zs, rows, R)[:, None] + t * D + offs[None, :], mask=m2 & own_c[:, None], other=0.0)
        cc = tl.where(own_c, tl.sum(g * zz, axis=1), tl.load(c + rows * N + t, mask=rmask & ~own_c, other=0.0))
        tl.store(c + rows * N + t, cc, mask=rmask & own_c)
        a_p = _rows(aw, rows, R) + t                                                    # [RR]: row 0 of the weights
        for i in range(n):
            v = _load_src(src32, src16, i, n32, t, D, offs, mask, N32, N16)
            rstd = tl.rsqrt(tl.sum(v * v, axis=0) / D + eps)
            e = tl.sum(u * v[None, :], axis=1) * rstd                                   # [RR]
            w = tl.load(a_p + i * N, mask=rmask, other=0.0)
            ge = w * (tl.sum(g * v[None, :], axis=1) - cc)
            g_u += (ge * rstd)[:, None] * v[None, :]
            if ((write_mask >> i) & 1) == 1:
                gv = tl.sum(w[:, None] * g + (ge * rstd)[:, None] * u, axis=0) - \
                    (rstd * rstd * tl.sum(ge * e, axis=0) / D) * v
                out = _pick(bufs, i, NB) + t * D + offs
                if ((add_mask >> i) & 1) == 1:
                    gv += tl.load(out, mask=mask, other=0.0)
                tl.store(out, gv, mask=mask)
    out = gu + (pid * P + row0 + rows[:, None]) * D + offs[None, :]
    tl.store(out, tl.load(out, mask=m2, other=0.0) + g_u, mask=m2)


@triton.jit
def finish_bwd(v, U, gz, aw, arow, c, zs, c_mask, buf, g, out, out2, gu, row0, P, N, D, eps,
               R: tl.constexpr, HAS_BUF: tl.constexpr, HAS_G: tl.constexpr, HAS_OUT2: tl.constexpr,
               BD: tl.constexpr):
    """One source v's whole gradient, out[t] (v's dtype) = its share from the R reads (as in
    contribute_bwd; v is row arow[r] of read r's weights aw[r]) + buf[t] (its fp32 sum so far,
    if HAS_BUF) + g[t] (its gradient from elsewhere, if HAS_G), and, if HAS_OUT2, the same in
    out2's dtype, for the tokens t = pid, pid + programs, ...; gu as contribute_bwd."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    RR: tl.constexpr = triton.next_power_of_2(R)
    offs = tl.arange(0, BD)
    mask = offs < D
    rows = tl.arange(0, RR)
    rmask = rows < R
    m2 = rmask[:, None] & mask[None, :]
    u = tl.load(U + (row0 + rows[:, None]) * D + offs[None, :], mask=m2, other=0.0)      # [RR, BD]
    own_c = ((c_mask >> rows) & 1) == 1
    a_row = rows * 0
    for j in tl.static_range(R):
        a_row = tl.where(rows == j, arow[j], a_row)
    a_p = _rows(aw, rows, R) + a_row.to(tl.int64) * N                                      # [RR]: v's weight rows
    g_u = tl.zeros([RR, BD], tl.float32)
    for tok in range(pid, N, programs):
        t = tok.to(tl.int64)
        gr = tl.load(_rows(gz, rows, R)[:, None] + t * D + offs[None, :], mask=m2, other=0.0)  # [RR, BD]
        zz = tl.load(_rows(zs, rows, R)[:, None] + t * D + offs[None, :], mask=m2 & own_c[:, None], other=0.0)
        cc = tl.where(own_c, tl.sum(gr * zz, axis=1), tl.load(c + rows * N + t, mask=rmask & ~own_c, other=0.0))
        tl.store(c + rows * N + t, cc, mask=rmask & own_c)
        x = tl.load(v + t * D + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
        e = tl.sum(u * x[None, :], axis=1) * rstd
        w = tl.load(a_p + t, mask=rmask, other=0.0)
        ge = w * (tl.sum(gr * x[None, :], axis=1) - cc)
        g_u += (ge * rstd)[:, None] * x[None, :]
        gv = tl.sum(w[:, None] * gr + (ge * rstd)[:, None] * u, axis=0) - (rstd * rstd * tl.sum(ge * e, axis=0) / D) * x
        if HAS_BUF:
            gv += tl.load(buf + t * D + offs, mask=mask, other=0.0)
        if HAS_G:
            gv += tl.load(g + t * D + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out + t * D + offs, gv.to(out.dtype.element_ty), mask=mask)
        if HAS_OUT2:
            tl.store(out2 + t * D + offs, gv.to(out2.dtype.element_ty), mask=mask)
    gout = gu + (pid * P + row0 + rows[:, None]) * D + offs[None, :]
    tl.store(gout, tl.load(gout, mask=m2, other=0.0) + g_u, mask=m2)
