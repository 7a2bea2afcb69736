"""
Triton kernels of MoDA's depth cache (fast/moda.py, `TritonOps`): the depth part of a block's
joint softmax and its merge with flash attention, one program per query row r = n G + g
(n = (b, kv head, t) a row of the cache, g one of the G query heads of kv head), forward and
backward. A row's S depth slots (S <= 2L - 2) and hd features are one tile of SP x HDP (each the
next power of two, masked beyond S and hd).

depth_fwd, after flash attention gave o and lse_seq (arXiv 2603.15619's joint softmax; fast/moda.py):
    qs = q / sqrt(hd)                       in q's dtype (as the plain scores), into the cache's query rows
    d_j = qs . K_j                          fp32 (the plain code rounds the scores and the weights
    lse_dep = logsumexp(d), a = softmax(d)  to q's dtype for its matmuls; here, as in flash
    y_dep = a . V                           attention, everything stays fp32 up to y)
    lse = logaddexp(lse_seq, lse_dep), w = exp(lse_dep - lse)
    y = o + w (y_dep - o)                   into y (q's dtype); lse (fp32); w a into the weight rows
depth_bwd, after flash attention's backward gave dq for the sequence part:
    D = dy . y, dd_j = a_j (dy . V_j - D)   fp32 (a: the joint weights)
    dq += dd . K / sqrt(hd)                 dd into the cache's score-gradient rows, dy into its output-gradient rows
"""

import triton
import triton.language as tl


@triton.jit
def depth_fwd(q, sq_b, sq_h, sq_t, o, so_b, so_h, so_t, ls, sl_b, sl_h, sl_t, K, V, s_kv, Q, A, s_q, s_a, s_ar,
              y, sy_b, sy_h, sy_t, lse, S, T, HKV, G, scale, HD: tl.constexpr, SP: tl.constexpr, HDP: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    n, g = r // G, r % G
    t, bk = n % T, n // T
    b, h = bk // HKV, (bk % HKV) * G + g
    H = HKV * G
    fd = tl.arange(0, HDP)
    fs = tl.arange(0, SP)
    md, ms = fd < HD, fs < S
    mt = ms[:, None] & md[None, :]
    qv = tl.load(q + b * sq_b + h * sq_h + t * sq_t + fd, mask=md, other=0.0)
    qs = (qv.to(tl.float32) * scale).to(qv.dtype)
    tl.store(Q + n * s_q + g * HD + fd, qs, mask=md)
    kt = tl.load(K + n * s_kv + fs[:, None] * HD + fd[None, :], mask=mt, other=0.0)
    d = tl.sum(kt.to(tl.float32) * qs.to(tl.float32)[None, :], axis=1)
    d = tl.where(ms, d, float('-inf'))
    mx = tl.max(d, 0)
    e = tl.exp(d - mx)
    tot = tl.sum(e, 0)
    lse_dep = mx + tl.log(tot)
    a = e / tot
    vt = tl.load(V + n * s_kv + fs[:, None] * HD + fd[None, :], mask=mt, other=0.0)
    y_dep = tl.sum(a[:, None] * vt.to(tl.float32), axis=0)
    ov = tl.load(o + b * so_b + h * so_h + t * so_t + fd, mask=md, other=0.0).to(tl.float32)
    lsq = tl.load(ls + b * sl_b + h * sl_h + t * sl_t).to(tl.float32)
    top = tl.maximum(lsq, lse_dep)
    lj = top + tl.log(tl.exp(lsq - top) + tl.exp(lse_dep - top))
    w = tl.exp(lse_dep - lj)
    tl.store(A + n * s_a + g * s_ar + fs, a * w, mask=ms)
    tl.store(y + b * sy_b + h * sy_h + t * sy_t + fd, (ov + w * (y_dep - ov)).to(qv.dtype), mask=md)
    tl.store(lse + (b * H + h) * T + t, lj)


@triton.jit
def depth_bwd(dy, sd_b, sd_h, sd_t, y, sy_b, sy_h, sy_t, K, V, s_kv, A, s_a, s_ar, DD, GY, s_g,
              dq, sq_b, sq_h, sq_t, S, T, HKV, G, scale, HD: tl.constexpr, SP: tl.constexpr, HDP: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    n, g = r // G, r % G
    t, bk = n % T, n // T
    b, h = bk // HKV, (bk % HKV) * G + g
    fd = tl.arange(0, HDP)
    fs = tl.arange(0, SP)
    md, ms = fd < HD, fs < S
    mt = ms[:, None] & md[None, :]
    gv = tl.load(dy + b * sd_b + h * sd_h + t * sd_t + fd, mask=md, other=0.0)
    tl.store(GY + n * s_g + g * HD + fd, gv, mask=md)
    g32 = gv.to(tl.float32)
    yv = tl.load(y + b * sy_b + h * sy_h + t * sy_t + fd, mask=md, other=0.0).to(tl.float32)
    D = tl.sum(g32 * yv, 0)
    vt = tl.load(V + n * s_kv + fs[:, None] * HD + fd[None, :], mask=mt, other=0.0).to(tl.float32)
    gV = tl.sum(vt * g32[None, :], axis=1)
    a = tl.load(A + n * s_a + g * s_ar + fs, mask=ms, other=0.0)
    dd = a * (gV - D)
    tl.store(DD + n * s_a + g * s_ar + fs, dd.to(DD.dtype.element_ty), mask=ms)
    kt = tl.load(K + n * s_kv + fs[:, None] * HD + fd[None, :], mask=mt, other=0.0).to(tl.float32)
    dqd = tl.sum(dd[:, None] * kt, axis=0) * scale
    at = dq + b * sq_b + h * sq_h + t * sq_t + fd
    tl.store(at, (tl.load(at, mask=md, other=0.0).to(tl.float32) + dqd).to(dq.dtype.element_ty), mask=md)
