"""
Triton kernels of MoDA's depth attention on the depth cache (fast/moda.py, which launches them
through fast/launch.py and documents the math). A program takes BT tokens of one batch row and
one key/value head, and its G query heads; features are one block of HD = next power of 2 >= hd
lanes. The cache Kc, Vc is (B, H_kv, T, NS, hd) contiguous: a token's slots lie side by side.
q-like tensors (B, H, T, hd) come with their strides (the feature dim contiguous). Every
accumulation is fp32.

    depth_fwd   the depth part of a block's attention over slots [0, S) (online softmax), merged
                with the sequence part's output and logsumexp: the joint output and logsumexp
    depth_bwd   the depth part's gradient of q added to the sequence part's, and D = dy . y
    slot_bwd    the gradient of one or two slots from all the blocks that read them, one pass
                over each reader's q, dy, logsumexp and D
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
def _heads(base, sb, sh, st, b, heads, ts, dims, m3):
    """A [GP, BT, HD] tile of a (B, H, T, hd) tensor at batch row b (fp32)."""
    return tl.load(base + b * sb + heads[:, None, None] * sh + ts[None, :, None] * st + dims[None, None, :],
                   mask=m3, other=0.0).to(tl.float32)


@triton.jit
def _slot(C, b, kh, ts, j, Hkv, T, NS, hd, dims, m2):
    """Slot j of the cache C (B, H_kv, T, NS, hd) for tokens ts: [BT, HD] fp32."""
    return tl.load(C + (((b * Hkv + kh) * T + ts[:, None]) * NS + j) * hd + dims[None, :], mask=m2,
                   other=0.0).to(tl.float32)


@triton.jit
def depth_fwd(q, sqb, sqh, sqt, o, sob, soh, sot, lse_seq, Kc, Vc, y, lse, S, Hkv, T, NS, hd, scale,
              G: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr, HD: tl.constexpr):
    """Tokens ts of program (pid_t, b * H_kv + kh): for each query head of the group, the depth
    scores s_j = scale q . K_j over the slots j < S, their logsumexp lse_d and mix o_d = softmax(s)
    . V; merged with the sequence part (o, lse_seq): lse = logaddexp(lse_seq, lse_d) -> lse,
    y = e^(lse_seq - lse) o + e^(lse_d - lse) o_d -> y (contiguous, q's dtype)."""
    pid_t = tl.program_id(0)
    bk = tl.program_id(1)
    b, kh = bk // Hkv, bk % Hkv
    ts = pid_t * BT + tl.arange(0, BT)
    tm = ts < T
    g = tl.arange(0, GP)
    heads = kh * G + g
    dims = tl.arange(0, HD)
    dm = dims < hd
    m2 = tm[:, None] & dm[None, :]
    m3 = (g < G)[:, None, None] & m2[None, :, :]
    H = Hkv * G
    q3 = _heads(q, sqb, sqh, sqt, b, heads, ts, dims, m3)
    mx = tl.full([GP, BT], -1e30, tl.float32)
    den = tl.zeros([GP, BT], tl.float32)
    acc = tl.zeros([GP, BT, HD], tl.float32)
    for j in range(S):
        K = _slot(Kc, b, kh, ts, j, Hkv, T, NS, hd, dims, m2)
        V = _slot(Vc, b, kh, ts, j, Hkv, T, NS, hd, dims, m2)
        s = tl.sum(q3 * K[None, :, :], axis=2) * scale
        m_new = tl.maximum(mx, s)
        c = tl.exp(mx - m_new)
        w = tl.exp(s - m_new)
        den = den * c + w
        acc = acc * c[:, :, None] + w[:, :, None] * V[None, :, :]
        mx = m_new
    lse_d = mx + tl.log(den)
    gm = (g < G)[:, None] & tm[None, :]
    row = (b * H + heads[:, None]) * T + ts[None, :]                                         # [GP, BT]
    ls = tl.load(lse_seq + row, mask=gm, other=0.0)
    top = tl.maximum(ls, lse_d)
    out = top + tl.log(tl.exp(ls - top) + tl.exp(lse_d - top))
    o3 = _heads(o, sob, soh, sot, b, heads, ts, dims, m3)
    yv = tl.exp(ls - out)[:, :, None] * o3 + (tl.exp(lse_d - out) / den)[:, :, None] * acc
    tl.store(y + row[:, :, None] * hd + dims[None, None, :], yv.to(y.dtype.element_ty), mask=m3)
    tl.store(lse + row, out, mask=gm)


@triton.jit
def depth_bwd(q, sqb, sqh, sqt, dy, sdb, sdh, sdt, yy, lse, dq_seq, sgb, sgh, sgt, Kc, Vc, dq, D,
              S, Hkv, T, NS, hd, scale,
              G: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr, HD: tl.constexpr):
    """Tokens ts of program (pid_t, b * H_kv + kh), each query head of the group: D = dy . y -> D;
    over the slots j < S: a_j = e^(scale q . K_j - lse), ds_j = a_j (dy . V_j - D), and
    dq = dq_seq + scale sum_j ds_j K_j -> dq (contiguous, q's dtype). y is contiguous (depth_fwd's)."""
    pid_t = tl.program_id(0)
    bk = tl.program_id(1)
    b, kh = bk // Hkv, bk % Hkv
    ts = pid_t * BT + tl.arange(0, BT)
    tm = ts < T
    g = tl.arange(0, GP)
    heads = kh * G + g
    dims = tl.arange(0, HD)
    dm = dims < hd
    m2 = tm[:, None] & dm[None, :]
    m3 = (g < G)[:, None, None] & m2[None, :, :]
    H = Hkv * G
    gm = (g < G)[:, None] & tm[None, :]
    row = (b * H + heads[:, None]) * T + ts[None, :]
    q3 = _heads(q, sqb, sqh, sqt, b, heads, ts, dims, m3)
    d3 = _heads(dy, sdb, sdh, sdt, b, heads, ts, dims, m3)
    Dv = tl.sum(d3 * _heads(yy, H * T * hd, T * hd, hd, b, heads, ts, dims, m3), axis=2)   # [GP, BT]
    lv = tl.load(lse + row, mask=gm, other=0.0)
    acc = tl.zeros([GP, BT, HD], tl.float32)
    for j in range(S):
        K = _slot(Kc, b, kh, ts, j, Hkv, T, NS, hd, dims, m2)
        V = _slot(Vc, b, kh, ts, j, Hkv, T, NS, hd, dims, m2)
        a = tl.exp(tl.sum(q3 * K[None, :, :], axis=2) * scale - lv)
        ds = a * (tl.sum(d3 * V[None, :, :], axis=2) - Dv)
        acc += ds[:, :, None] * K[None, :, :]
    out = _heads(dq_seq, sgb, sgh, sgt, b, heads, ts, dims, m3) + scale * acc
    tl.store(dq + row[:, :, None] * hd + dims[None, None, :], out.to(dq.dtype.element_ty), mask=m3)
    tl.store(D + row, Dv, mask=gm)


@triton.jit
def slot_bwd(Kc, Vc, qs, sqb, sqh, sqt, dys, sdb, sdh, sdt, lses, Ds, R, dK0, dV0, dK1, dV1,
             Hkv, T, NS, hd, scale,
             NSLOT: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BT: tl.constexpr, HD: tl.constexpr):
    """Tokens ts of program (pid_t, b * H_kv + kh): the gradient of the slot Kc, Vc point at (views of
    the cache from that slot on; and the next if NSLOT is 2) from the R blocks that read them (tuples of their q, dy (strides shared), lse, D (B, H, T)):
    a = e^(scale q . K_j - lse), ds = a (dy . V_j - D), dK_j = scale sum ds q, dV_j = sum a dy, over
    the readers and the group's query heads -> dK0, dV0 (, dK1, dV1) (B, H_kv, T, hd) contiguous."""
    pid_t = tl.program_id(0)
    bk = tl.program_id(1)
    b, kh = bk // Hkv, bk % Hkv
    NR: tl.constexpr = len(qs)
    ts = pid_t * BT + tl.arange(0, BT)
    tm = ts < T
    g = tl.arange(0, GP)
    heads = kh * G + g
    dims = tl.arange(0, HD)
    dm = dims < hd
    m2 = tm[:, None] & dm[None, :]
    m3 = (g < G)[:, None, None] & m2[None, :, :]
    gm = (g < G)[:, None] & tm[None, :]
    H = Hkv * G
    row = (b * H + heads[:, None]) * T + ts[None, :]
    K0 = _slot(Kc, b, kh, ts, 0, Hkv, T, NS, hd, dims, m2)
    V0 = _slot(Vc, b, kh, ts, 0, Hkv, T, NS, hd, dims, m2)
    dk0 = tl.zeros([BT, HD], tl.float32)
    dv0 = tl.zeros([BT, HD], tl.float32)
    if NSLOT == 2:
        K1 = _slot(Kc, b, kh, ts, 1, Hkv, T, NS, hd, dims, m2)
        V1 = _slot(Vc, b, kh, ts, 1, Hkv, T, NS, hd, dims, m2)
        dk1 = tl.zeros([BT, HD], tl.float32)
        dv1 = tl.zeros([BT, HD], tl.float32)
    for r in range(R):
        q3 = _heads(_pick(qs, r, NR), sqb, sqh, sqt, b, heads, ts, dims, m3)
        d3 = _heads(_pick(dys, r, NR), sdb, sdh, sdt, b, heads, ts, dims, m3)
        lv = tl.load(_pick(lses, r, NR) + row, mask=gm, other=0.0)
        Dv = tl.load(_pick(Ds, r, NR) + row, mask=gm, other=0.0)
        a = tl.where(gm, tl.exp(tl.sum(q3 * K0[None, :, :], axis=2) * scale - lv), 0.0)
        ds = a * (tl.sum(d3 * V0[None, :, :], axis=2) - Dv)
        dk0 += tl.sum(ds[:, :, None] * q3, axis=0)
        dv0 += tl.sum(a[:, :, None] * d3, axis=0)
        if NSLOT == 2:
            a = tl.where(gm, tl.exp(tl.sum(q3 * K1[None, :, :], axis=2) * scale - lv), 0.0)
            ds = a * (tl.sum(d3 * V1[None, :, :], axis=2) - Dv)
            dk1 += tl.sum(ds[:, :, None] * q3, axis=0)
            dv1 += tl.sum(a[:, :, None] * d3, axis=0)
    out = ((b * Hkv + kh) * T + ts[:, None]) * hd + dims[None, :]
    tl.store(dK0 + out, (scale * dk0).to(dK0.dtype.element_ty), mask=m2)
    tl.store(dV0 + out, dv0.to(dV0.dtype.element_ty), mask=m2)
    if NSLOT == 2:
        tl.store(dK1 + out, (scale * dk1).to(dK1.dtype.element_ty), mask=m2)
        tl.store(dV1 + out, dv1.to(dV1.dtype.element_ty), mask=m2)
