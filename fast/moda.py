"""
Fast forms of MoDA (arXiv 2603.15619), same inputs and outputs as the plain methods of
`residuals.MoDA`:

`cached_block` (MoDA.block): the depth slots kept once. The plain block stacks the 2p depth
keys and values it reads into new (B, H_kv, T, 2p, hd) tensors, and autograd keeps each
stack: sum_p 2p = L (L - 1) slots copied and saved per step. Here one cache (B, H_kv, T, 2L,
hd) per keys and per values, in the dtype of the block's k, is allocated at the first block;
each block writes its slots into it once (slot 2p: its own k, before RoPE, and v; slot 2p + 1:
depth_kv of its FFN input) and every later block reads slots [0, 2p) in place
(`DepthAttention`), keeping only the cache's memory for its backward, and its scaled q and
joint depth weights (2L per query head and token) in two buffers of the cache, one row block
per position. Backward, each reading block leaves its score and output gradients in the
cache's rows; a slot's writer (`WriteSlots`) forms the slot's gradient in one product over its
readers' rows (dK_j = sum_r dd_rj q_r, dV_j = sum_r a_rj dy_r) and hands it back to its entries
when autograd reaches it, after every reader: an empty "token" tensor chains each read to the
last write before it. A state's K and V tuples hold the cache's slots as written; a state whose
slots are not the cache's frontier (one continued twice, one from the plain code) gets a cache
of its own, its slots copied in, their gradient handed back to them.

The joint softmax of a cached block is two softmaxes merged by their logsumexps: the depth
part over the cache (lse_dep, y_dep) and causal attention on the flash kernel with its
logsumexp (`causal_lse`: o, lse_seq); y = o + w (y_dep - o) with w = exp(lse_dep - lse) and
lse = logaddexp(lse_seq, lse_dep). The flash backward, given y and lse in place of its own o
and lse_seq, returns the joint softmax's gradient for the sequence keys (`causal_lse_backward`),
so no (T x (T + S)) score matrix exists forward or backward. The depth part's steps run as
torch ops (`TorchOps`, any device) or as one Triton kernel each way (`TritonOps`,
fast/moda_kernels.py: per block one pass over the slots it reads forward and one backward).

`sdpa_attention` (MoDA.attention, the path of cached generation): the same softmax on fused
`F.scaled_dot_product_attention`. The depth part collapses into one key per query: lse_t = log
sum_j exp(d_tj) (fp32) and y_dep,t = softmax(d_t) . V_depth[t]. Shifting query t's sequence
scores by -lse_t through one extra head dimension (q' = [q, -lse / scale], k' = [k, 1]) and
prepending a null key (score 0, value e_hd) that every query sees (a dummy query at position 0
keeps the causal mask square) makes the kernel return o_t = sum_s a_ts v_s and o_t[hd] = the
total depth weight, so y_t = o_t[:hd] + o_t[hd] * y_dep,t. Exact up to the rounding of the
shift in q's dtype, which is corrected below for bf16 / fp16.

Dtypes, as the plain code, with autocast off so that they stay what is written: the depth
scores d in q's dtype (a matmul of q / sqrt(hd) and the depth keys, as the plain scores), their
softmax and lse in fp32, the depth weights back in q's dtype for their matmul with the depth
values; the depth keys and values are read in their own dtype (never copied to fp32; a skipped
block's zero slot, fp32 among bf16 ones, is cast to q's dtype as autocast casts it for the
plain matmuls). The cache holds the slots in the dtype of the block's k. The Triton kernels keep
the depth scores, weights and values in fp32 up to the output, as flash attention does.
"""

import weakref

import torch
import torch.nn.functional as F

from perf.launch import launch
from residuals import MoDA, no_autocast


def sdpa_attention(self, q, k, v, depth_k, depth_v):
    """MoDA.attention on SDPA: q (B, H, T, hd), k, v (B, H_kv, T, hd), depth_k, depth_v
    (B, H_kv, T, S, hd), all of one dtype -> y (B, H, T, hd) in q's dtype."""
    B, H, T, hd = q.shape
    Hkv = k.size(1)
    scale = hd ** -0.5
    acc = torch.promote_types(q.dtype, torch.float32)                                # fp32 (fp64 stays)
    with no_autocast(q):
        q5 = q.view(B, Hkv, H // Hkv, T, hd) * scale                                 # as the plain scores
        d = torch.einsum('bkgtd,bktsd->bkgts', q5, depth_k.to(q.dtype)).to(acc)      # (B, H_kv, G, T, S)
        lse = torch.logsumexp(d, dim=-1)                                              # (B, H_kv, G, T)
        a_dep = torch.softmax(d, dim=-1).to(q.dtype)
        y_dep = torch.einsum('bkgts,bktsd->bkgtd', a_dep, depth_v.to(q.dtype))      # (B, H_kv, G, T, hd)
        return joint(q, k, v, lse.reshape(B, H, T), y_dep.reshape(B, H, T, hd))


def joint(q, k, v, lse, y_dep):
    """The joint softmax's output from its depth part: q (B, H, T, hd), k, v (B, H_kv, T, hd), the
    depth scores' logsumexp lse (B, H, T) (fp32, fp64 for fp64) and their softmax-weighted values
    y_dep (B, H, T, hd) -> y (B, H, T, hd) in q's dtype (module docstring: the null key)."""
    B, H, T, hd = q.shape
    Hkv = k.size(1)
    scale = hd ** -0.5
    with no_autocast(q):
        shift = (-lse / scale).to(q.dtype)                                            # (B, H, T)
        # position 0 of keys and queries: the null key, and a dummy query whose output is dropped
        q1 = F.pad(torch.cat((q, shift.unsqueeze(-1)), dim=-1), (0, 0, 1, 0))         # (B, H, 1 + T, hd + 1)
        k1 = F.pad(torch.cat((k, k.new_ones(B, Hkv, T, 1)), dim=-1), (0, 0, 1, 0))   # (B, H_kv, 1 + T, hd + 1)
        v1 = F.pad(v, (0, 1, 1, 0)) + F.pad(v.new_ones(1, 1, 1, 1), (hd, 0, 0, T))  # null value e_hd
        o = F.scaled_dot_product_attention(q1, k1, v1, is_causal=True, scale=scale,
                                           enable_gqa=H != Hkv)[:, :, 1:]             # (B, H, T, hd + 1)
        if shift.dtype == lse.dtype:  # fp32 / fp64: the shift is lse to the last bit
            return (o[..., :hd] + o[..., hd:] * y_dep.to(q.dtype)).to(q.dtype)
        # bf16 / fp16: the kernel shifted by the rounded shift, not by lse: with
        # r = exp(lse + shift * scale) the depth mass is r * o_null out of 1 + (r - 1) o_null
        acc = lse.dtype
        r = torch.exp(lse + shift.to(acc) * scale).unsqueeze(-1)                      # (B, H, T, 1), fp32
        null = o[..., hd:].to(acc)
        return ((o[..., :hd].to(acc) + (r * null) * y_dep.to(acc)) / (1 + (r - 1) * null)).to(q.dtype)


# ---- the depth cache ---------------------------------------------------------------------------

class Cache:
    """One forward's depth slots: K and V (B, H_kv, T, 2L, hd), slots [0, filled) written (`written`:
    weak references to the state entries that stand for them). The reading blocks' scaled queries Q
    and softmax weights A, one row block of G per position p (rows pG .. pG + G - 1 of (N, L G, hd)
    and (N, L G, 2L), N = B H_kv T; `readers`: the positions that read), and, during a backward,
    their score gradients DD and weighted values' gradients GY in the same layout (`done`: the
    positions whose backward has run in backward pass `task`, autograd's graph task): a slot's
    gradient is one product over its readers' rows of the same pass (a pass that reached only some
    blocks, `autograd.grad` with retain_graph, leaves rows that the next pass must not count)."""

    def __init__(self, like, n_slots):
        B, Hkv, T, hd = like.shape
        self.K = torch.empty(B, Hkv, T, n_slots, hd, dtype=like.dtype, device=like.device)
        self.V = torch.empty_like(self.K)
        self.filled, self.written, self.token = 0, [], None
        self.Q = self.A = self.DD = self.GY = None
        self.readers, self.done, self.task = [], [], None

    def holds(self, K, V, p):
        """Whether the state's slot tuples K, V are this cache's slots up to its frontier, at most 2p."""
        if self.filled > 2 * p:
            return False
        return all(r() is K[j] and s() is V[j] for j, (r, s) in enumerate(self.written))

    def read_done(self, p):
        """The read of position p has run its backward in the current backward pass."""
        task = torch._C._current_graph_task_id()
        if task != self.task:  # the first read of this pass: an earlier pass's reads are not its own
            self.done, self.task = [], task
        self.done.append(p)

    def slot_grads(self, j, n):
        """The gradients (dK, dV) (N, n, hd) of slots j .. j + n - 1, which have the same readers
        (2m and 2m + 1: the positions p > m), from those whose backward has run in this pass, in
        q's dtype; (None, None) when there are none."""
        assert (j + n - 1) // 2 == j // 2, "slots 2m and 2m + 1 at most"
        G = self.Q.size(1) // (self.K.size(3) // 2)
        done = self.done if self.task == torch._C._current_graph_task_id() else []
        rows = sorted(p for p in done if 2 * p > j)
        dK = dV = None
        for lo, hi in _runs(rows):  # each run of consecutive positions: one product
            r = slice(lo * G, (hi + 1) * G)
            k = torch.bmm(self.DD[:, r, j:j + n].transpose(1, 2), self.Q[:, r])                  # (N, n, hd)
            v = torch.bmm(self.A[:, r, j:j + n].transpose(1, 2).to(self.GY.dtype), self.GY[:, r])
            dK, dV = (k, v) if dK is None else (dK + k, dV + v)
        return dK, dV


def _runs(xs):
    """Sorted integers -> [(first, last)] of their runs of consecutive values."""
    runs = []
    for x in xs:
        if runs and runs[-1][1] == x - 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    return runs


def alias(t):
    """A tensor on t's memory with a version counter of its own, not a view: what a backward keeps
    of the cache (later writes go to other slots and must not invalidate it)."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.shape,
                                                                t.stride())


class WriteSlots(torch.autograd.Function):
    """token', *entries = WriteSlots.apply(cache, j0, token, K_j0, V_j0, K_j0+1, V_j0+1, ...): copies
    the given (B, H_kv, T, hd) tensors into slots j0, j0 + 1, ... of the cache. Returns a new empty
    token and the slots as the cache holds them (aliases: the state's entries). Backward, after
    every block that read the slots: each slot's gradient from its readers' rows
    (`Cache.slot_grads`) plus that of any other use of its entry, in the dtype of the tensor written."""

    @staticmethod
    def forward(ctx, cache, j0, token, *slots):
        n = len(slots) // 2
        with torch.no_grad():
            for i in range(n):
                cache.K[:, :, :, j0 + i].copy_(slots[2 * i])
                cache.V[:, :, :, j0 + i].copy_(slots[2 * i + 1])
        assert cache.filled == j0, "slots are written in order, once"
        cache.filled = j0 + n
        ctx.cache, ctx.j0, ctx.n, ctx.first = cache, j0, n, token is None
        ctx.dtypes = [t.dtype for t in slots]
        ctx.set_materialize_grads(False)
        out = [torch.empty(0, dtype=cache.K.dtype, device=cache.K.device)]
        for i in range(n):
            out += [alias(cache.K[:, :, :, j0 + i]), alias(cache.V[:, :, :, j0 + i])]
        return tuple(out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dtoken, *douts):
        cache, j0 = ctx.cache, ctx.j0
        B, Hkv, T, _, hd = cache.K.shape
        grads = {}  # slot -> (dK, dV) (N, hd); slots 2m and 2m + 1 in one product
        for j in range(j0, j0 + ctx.n):
            if j not in grads:
                n = 2 if j % 2 == 0 and j + 1 < j0 + ctx.n else 1
                dK, dV = cache.slot_grads(j, n) if cache.done else (None, None)
                for i in range(n):
                    grads[j + i] = (None, None) if dK is None else (dK[:, i], dV[:, i])
        out = []
        for i in range(ctx.n):
            for c in range(2):
                g = grads[j0 + i][c]
                g = None if g is None else g.reshape(B, Hkv, T, hd)
                other = douts[2 * i + c]
                g = other if g is None else g if other is None else g + other
                out.append(None if g is None else g.to(ctx.dtypes[2 * i + c]))
        if ctx.first:  # the cache's first write runs its backward last: the pass is over
            cache.DD = cache.GY = None
            cache.done, cache.task = [], None
        token = None if ctx.first else torch.empty(0, dtype=cache.K.dtype, device=cache.K.device)
        return (None, None, token) + tuple(out)


def _per_token(t, Hkv):
    """(B, H, T, ...) -> (B * H_kv * T, G, ...): a token's G query heads of one key/value head together."""
    B, H, T = t.shape[:3]
    t = t.view(B, Hkv, H // Hkv, T, *t.shape[3:]).transpose(2, 3)
    return t.reshape(B * Hkv * T, H // Hkv, *t.shape[4:])


def _per_head(t, B, Hkv):
    """(B * H_kv * T, G, ...) -> (B, H, T, ...): `_per_token`'s inverse."""
    N, G = t.shape[:2]
    T = N // (B * Hkv)
    return t.view(B, Hkv, T, G, *t.shape[2:]).transpose(2, 3).reshape(B, Hkv * G, T, *t.shape[2:])


def flash_kernel(q):
    """The flash kernel `causal_lse` runs for q (B, H, T, hd): 'cpu' on the CPU, 'cuda' on CUDA for
    bf16 / fp16 with hd a multiple of 8 up to 256, else 'math' (explicit scores)."""
    if q.device.type == 'cpu':
        return 'cpu'
    ok = q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and q.size(-1) % 8 == 0 and q.size(-1) <= 256
    return 'cuda' if ok else 'math'


def causal_lse(q, k, v, scale, kernel=None):
    """Causal attention with its logsumexp: q, k, v (B, H, T, hd), one dtype -> o (B, H, T, hd) in q's
    dtype, lse (B, H, T) fp32 (fp64 for fp64) and `how`, what `causal_lse_backward` needs. kernel:
    'cpu', 'cuda' (the device's flash kernel) or 'math' (explicit (T x T) scores, as the plain
    code); None = `flash_kernel(q)`."""
    kernel = kernel or flash_kernel(q)
    if kernel == 'cpu':
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
        return o, lse, ('cpu',)
    if kernel == 'cuda':
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
        return out[0], out[1], ('cuda',) + tuple(out[2:8])  # cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused
    s = _causal_scores(q, k, scale)                                                    # (B, H, T, T), fp32
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1)).to(q.dtype) @ v, lse, ('math',)


def _causal_scores(q, k, scale):
    T = q.size(2)
    s = (q @ k.transpose(-1, -2) * scale).to(torch.promote_types(q.dtype, torch.float32))
    return s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), float('-inf'))


def causal_lse_backward(dy, q, k, v, y, lse, scale, how):
    """(dq, dk, dv) of the sequence part of a joint softmax whose output is y (B, H, T, hd) and
    logsumexp lse (B, H, T): `causal_lse`'s backward given y and lse in place of its own output and
    logsumexp. Its probabilities exp(s - lse) are then the joint softmax's over the sequence keys and
    its D = rowsum(dy * y) the joint one, so that dS = P (dy . v - D) is the joint gradient's
    sequence block (the merge of split softmaxes, as flash-decoding's)."""
    if how[0] == 'cpu':
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dy, q, k, v, y, lse, 0.0, True, scale=scale)
    if how[0] == 'cuda':
        cq, ck, mq, mk, rng, unused = how[1:]
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dy, q, k, v, y, lse, cq, ck, mq, mk, 0.0, True, rng, unused, scale=scale)
    acc = lse.dtype
    P = torch.exp(_causal_scores(q, k, scale) - lse.unsqueeze(-1))                    # (B, H, T, T)
    dS = P * ((dy @ v.transpose(-1, -2)).to(acc) - (dy.to(acc) * y.to(acc)).sum(-1, keepdim=True))
    dS = dS.to(q.dtype)
    return dS @ k * scale, dS.transpose(-1, -2) @ q * scale, P.to(q.dtype).transpose(-1, -2) @ dy


class TorchOps:
    """The depth part of `DepthAttention` as torch ops (any device, any dtype)."""

    @staticmethod
    def forward(cache, S, q, o, lse_seq):
        """The depth part over slots [0, S) of the cache and its merge with the sequence part
        (o, lse_seq): writes the scaled q and the joint depth weights into the cache's rows of
        position S / 2; returns y (B, H, T, hd) in q's dtype and the joint lse (B, H, T)."""
        B, H, T, hd = q.shape
        Hkv = cache.K.size(1)
        G, N, p = H // Hkv, B * Hkv * T, S // 2
        acc, rows = cache.A.dtype, slice(p * G, (p + 1) * G)
        qg = cache.Q[:, rows]                                                          # (N, G, hd): a view
        torch.mul(_per_token(q, Hkv), hd ** -0.5, out=qg)                              # as the plain scores
        K = cache.K.view(N, -1, hd)[:, :S].to(q.dtype)                                 # (N, S, hd): a view
        V = cache.V.view(N, -1, hd)[:, :S].to(q.dtype)
        d = torch.bmm(qg, K.transpose(1, 2)).to(acc)                                   # (N, G, S)
        lse_dep = torch.logsumexp(d, dim=-1)                                           # (N, G)
        a = cache.A[:, rows, :S]
        torch.exp(d - lse_dep.unsqueeze(-1), out=a)                                    # (N, G, S), fp32
        y_dep = _per_head(torch.bmm(a.to(q.dtype), V), B, Hkv)                         # (B, H, T, hd)
        lse_dep = _per_head(lse_dep, B, Hkv)                                           # (B, H, T)
        lse = torch.logaddexp(lse_seq.to(acc), lse_dep)                                # the joint softmax's
        w = torch.exp(lse_dep - lse)                                                   # its depth mass
        a.mul_(_per_token(w, Hkv).unsqueeze(-1))                                       # the joint depth weights
        return torch.lerp(o, y_dep, w.unsqueeze(-1).to(q.dtype)), lse                  # (B, H, T, hd)

    @staticmethod
    def backward(cache, S, dy, y, dq):
        """The depth part's backward: dd_j = a_j (dy . V_j - dy . y) and dy into the cache's rows of
        position S / 2, q's share dd . K / sqrt(hd) added into dq (B, H, T, hd), in place."""
        B, H, T, hd = dy.shape
        Hkv = cache.K.size(1)
        G, N, dt = H // Hkv, B * Hkv * T, dq.dtype
        rows = slice(S // 2 * G, (S // 2 + 1) * G)
        a = cache.A[:, rows, :S]                                                       # (N, G, S): joint weights
        K = cache.K.view(N, -1, hd)[:, :S].to(dt)                                      # (N, S, hd)
        V = cache.V.view(N, -1, hd)[:, :S].to(dt)
        gy = cache.GY[:, rows]
        gy.copy_(_per_token(dy, Hkv))                                                  # (N, G, hd)
        gV = torch.bmm(gy, V.transpose(1, 2)).to(a.dtype)                              # (N, G, S)
        D = torch.einsum('ngd,ngd->ng', gy, _per_token(y, Hkv)).to(a.dtype)              # dy . y, (N, G)
        dd = a * (gV - D.unsqueeze(-1))                                                # dL/dd_j
        cache.DD[:, rows, :S].copy_(dd)
        dq.add_(_per_head(torch.bmm((dd * hd ** -0.5).to(dt), K), B, Hkv))              # q's depth share


class TritonOps:
    """TorchOps' steps as one launch each of fast/moda_kernels.py (CUDA or Triton's interpreter),
    one program per query row. The cache in another dtype than q, q not fp32 / bf16 / fp16 (fp64),
    or a tensor whose features are not contiguous: TorchOps' code."""

    @staticmethod
    def _torch(cache, q, *more):
        return q.dtype not in (torch.float32, torch.bfloat16, torch.float16) or cache.K.dtype != q.dtype or \
            any(t.stride(-1) != 1 for t in (q,) + more)

    @staticmethod
    def _shape(cache, S, q):
        B, H, T, hd = q.shape
        Hkv = cache.K.size(1)
        G, N = H // Hkv, B * Hkv * T
        rows = slice(S // 2 * G, (S // 2 + 1) * G)
        kv = dict(K=cache.K.view(N, -1, hd)[:, :S], V=cache.V.view(N, -1, hd)[:, :S], s_kv=cache.K.size(3) * hd,
                  s_a=cache.A.stride(0), s_ar=cache.A.stride(1), S=S, T=T, HKV=Hkv, G=G, scale=hd ** -0.5, HD=hd,
                  SP=triton_next_pow2(S), HDP=triton_next_pow2(hd))
        return N * G, rows, kv

    @staticmethod
    def forward(cache, S, q, o, lse_seq):
        if TritonOps._torch(cache, q, o):
            return TorchOps.forward(cache, S, q, o, lse_seq)
        R, rows, kv = TritonOps._shape(cache, S, q)
        y, lse = torch.empty_like(o), torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        Q, A = cache.Q[:, rows], cache.A[:, rows, :S]
        launch('fast.moda_kernels', 'depth_fwd', (R,), reads=('q', 'o', 'ls', 'K', 'V'), writes=('Q', 'A', 'y', 'lse'),
               flops=4 * R * S * kv['HD'], q=q, sq_b=q.stride(0), sq_h=q.stride(1), sq_t=q.stride(2), o=o,
               so_b=o.stride(0), so_h=o.stride(1), so_t=o.stride(2), ls=lse_seq, sl_b=lse_seq.stride(0),
               sl_h=lse_seq.stride(1), sl_t=lse_seq.stride(2), Q=Q, A=A, s_q=cache.Q.stride(0), y=y,
               sy_b=y.stride(0), sy_h=y.stride(1), sy_t=y.stride(2), lse=lse, **kv)
        return y, lse

    @staticmethod
    def backward(cache, S, dy, y, dq):
        if TritonOps._torch(cache, dq, dy, y):
            return TorchOps.backward(cache, S, dy, y, dq)
        R, rows, kv = TritonOps._shape(cache, S, dq)
        A, DD, GY = cache.A[:, rows, :S], cache.DD[:, rows, :S], cache.GY[:, rows]
        launch('fast.moda_kernels', 'depth_bwd', (R,), reads=('dy', 'y', 'K', 'V', 'A', 'dq'),
               writes=('DD', 'GY', 'dq'),
               flops=4 * R * S * kv['HD'], dy=dy, sd_b=dy.stride(0), sd_h=dy.stride(1), sd_t=dy.stride(2), y=y,
               sy_b=y.stride(0), sy_h=y.stride(1), sy_t=y.stride(2), A=A, DD=DD, GY=GY, s_g=cache.GY.stride(0),
               dq=dq, sq_b=dq.stride(0), sq_h=dq.stride(1), sq_t=dq.stride(2), **kv)


def triton_next_pow2(n):
    return 1 << max(0, (n - 1).bit_length())


class DepthAttention(torch.autograd.Function):
    """y = DepthAttention.apply(cache, S, token, ops, q, k, v): MoDA.attention of q (B, H, T, hd)
    over the sequence's k, v (B, H_kv, T, hd) and slots [0, S) of the cache, read in place. y
    (B, H, T, hd) in q's dtype. One softmax over both key sets, in two parts merged by their
    logsumexps (`ops`: TorchOps or TritonOps):
      depth: d_j = (q / sqrt(hd)) . K_j in q's dtype, lse_dep and the weights in fp32 (as the plain
             scores), y_dep = softmax(d) . V in q's dtype;
      sequence: `causal_lse`, o and lse_seq;
      y = o + w (y_dep - o), w = exp(lse_dep - lse), lse = logaddexp(lse_seq, lse_dep).
    The scaled q and the joint depth weights (w softmax(d)) go into the cache's rows of position
    S / 2 (`Cache`). Backward: the sequence part by `causal_lse_backward` with y and lse; the depth
    scores' gradient dd_j = a_j (dy . V_j - dy . y) with the joint weights a, q's share dd . K,
    dd and dy left in the cache's rows for the slots' writers (`Cache.slot_grads`)."""

    @staticmethod
    def forward(ctx, cache, S, token, ops, q, k, v):
        B, H, T, hd = q.shape
        Hkv, L = cache.K.size(1), cache.K.size(3) // 2
        G, N, p = H // Hkv, B * Hkv * T, S // 2
        if cache.Q is None:
            cache.Q = torch.empty(N, L * G, hd, dtype=q.dtype, device=q.device)
            cache.A = torch.empty(N, L * G, 2 * L, dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
        assert cache.Q.dtype == q.dtype and p not in cache.readers, "one read per position, in one dtype"
        with no_autocast(q):
            ke, ve = (k, v) if G == 1 else (k.repeat_interleave(G, 1), v.repeat_interleave(G, 1))
            o, lse_seq, how = causal_lse(q, ke, ve, hd ** -0.5)                        # (B, H, T, hd), (B, H, T)
            y, lse = ops.forward(cache, S, q, o, lse_seq)
        cache.readers.append(p)
        ctx.cache, ctx.S, ctx.how, ctx.ops = cache, S, how, ops
        ctx.save_for_backward(alias(cache.K), alias(cache.V), alias(cache.Q), alias(cache.A),  # each storage once
                              q, ke, ve, y, lse)
        ctx.set_materialize_grads(False)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        _, _, Q, A, q, ke, ve, y, lse = ctx.saved_tensors
        cache, S = ctx.cache, ctx.S
        B, H, T, hd = q.shape
        G = H // cache.K.size(1)
        if cache.DD is None:
            cache.DD = torch.empty(A.shape, dtype=q.dtype, device=A.device)            # (N, L G, 2L)
            cache.GY = torch.empty(Q.shape, dtype=q.dtype, device=Q.device)            # (N, L G, hd)
        if dy is None:
            dy = torch.zeros_like(y)
        with no_autocast(q):
            dq, dk, dv = causal_lse_backward(dy, q, ke, ve, y, lse, hd ** -0.5, ctx.how)
            if G > 1:
                dk, dv = (t.view(B, -1, G, T, hd).sum(2) for t in (dk, dv))
            ctx.ops.backward(cache, S, dy, y, dq)
        cache.read_done(S // 2)
        return None, None, torch.empty(0, dtype=cache.K.dtype, device=cache.K.device), None, dq, dk, dv


def cache_of(res, K, V, p, like):
    """(cache, token) for a block at position p with the state's slot tuples K, V: the cache whose
    slots they are, when its frontier is at most slot 2p; else a new one (2L slots, the dtype and
    device of `like`). Slots [frontier, 2p) are copied in from the tuples (begin's zeros, a skipped
    block's, all of a new cache's), their gradient handed back to them."""
    cache = getattr(K[0], '_moda_cache', None) if p > 0 else None
    if cache is None or not cache.holds(K, V, p):
        cache = Cache(like, 2 * res.cfg.n_layer)
    if cache.filled < 2 * p:
        start = cache.filled
        _write(cache, start, [t for j in range(start, 2 * p) for t in (K[j], V[j])])
    return cache


def _write(cache, j0, slots):
    """Slots j0, j0 + 1, ... of the cache from [K_j0, V_j0, ...]: the state's new entries."""
    cache.token, *entries = WriteSlots.apply(cache, j0, cache.token, *slots)
    for e in entries:
        e._moda_cache = cache  # a state's entries lead to their cache
    cache.written += [(weakref.ref(k), weakref.ref(v)) for k, v in zip(entries[::2], entries[1::2])]
    return entries


def block(ops):
    """MoDA.block on the depth cache with the depth part's steps in `ops` (TorchOps or TritonOps)."""
    @torch.compiler.disable  # Python state (the cache) across blocks: runs eagerly inside a compiled model
    def cached_block(self, state, b, layer, rope):
        return _cached_block(self, state, b, layer, rope, ops)
    return cached_block


def _cached_block(self, state, b, layer, rope, ops):
    """MoDA.block on the depth cache (module docstring): the same state in, the same state out,
    its K and V entries the cache's slots. Generation (a KV cache on the attention) and
    use_depth=False take the plain block."""
    h, K, V, p = state
    if not self.use_depth or getattr(layer.attn, 'cache', None) is not None:
        return MoDA.block(self, state, b, layer, rope)
    if 2 * p + 2 > len(K):
        raise ValueError(f"MoDA's depth cache has {len(K)} slots: an order may run or skip "
                         f"at most n_layer={self.cfg.n_layer} blocks")
    B, T, _ = h.shape
    attn, prm = layer.attn, self.layers[b]
    q, k, v = attn.qkv(prm.attn_norm(h))  # (B, H, T, hd), (B, H_kv, T, hd) x2, before RoPE
    qr, kr = attn.rotate(q, rope), attn.rotate(k, rope)
    cache = cache_of(self, K, V, p, k)
    if p == 0:
        y = attn.attend(qr, kr, v)        # plain causal attention
    else:
        y = DepthAttention.apply(cache, 2 * p, cache.token, ops, qr, kr, v)
    h = h + attn.out(y)
    x = prm.mlp_norm(h)
    slots = [k, v]
    if prm.depth_kv is not None:
        slots += list(prm.depth_kv(x).view(B, T, 2, k.size(1), -1).permute(2, 0, 3, 1, 4))  # 2x (B, H_kv, T, hd)
    entries = _write(cache, 2 * p, slots)
    K, V = K[:2 * p] + tuple(entries[0::2]) + K[2 * p + len(entries) // 2:], \
        V[:2 * p] + tuple(entries[1::2]) + V[2 * p + len(entries) // 2:]
    return h + layer.mlp(x), K, V, p + 1


cached_block = block(TorchOps)
cached_block_triton = block(TritonOps)
