"""
MoDA with its depth cache kept once: a fast form of residuals.MoDA.block (arXiv 2603.15619)
with the same inputs and outputs.

The plain block stacks the 2p depth keys and values it reads into new (B, H_kv, T, 2p, hd)
tensors, and autograd keeps each stack: sum_p 2p = L(L - 1) slots saved and copied per step.
Here the slots live in one preallocated cache (B, H_kv, T, 2L, hd) per keys and values, in
the slots' dtype: each is written once (slot 2p: the block's own k (before RoPE) and v, slot
2p + 1: depth_kv of its FFN input) and every later block reads it in place; the cache is kept
once for the backward, nothing is stacked.

  forward   the sequence attention on the flash kernel, which returns its logsumexp, then
            the depth part and the joint softmax merged exactly in fp32 (`DepthAttention`):
            lse = logaddexp(lse_seq, lse_depth), y = e^(lse_seq - lse) o_seq + e^(lse_depth - lse)
            o_depth; scores and softmax in fp32 as in the plain code (which rounds the scores
            to q's dtype first: here they stay fp32)
  backward  the flash kernel's backward with the joint output and logsumexp gives the
            sequence part of the joint softmax's gradient exactly; the depth part adds
            dq = sum_j ds_j K_j / sqrt(hd), ds_j = a_j (dy . V_j - dy . y); a block hands
            (q, dy, lse, dy . y) to the cache (`Cache.stash`), and each block's slots take
            their gradient from all the blocks that read them at once, when autograd reaches
            the block that wrote them (`WriteSlots`): dK_j = sum ds_j q / sqrt(hd),
            dV_j = sum a_j dy over the readers, with a_j recomputed from q . K_j and lse.

A chain of empty "token" tensors orders the backward: each block's read takes the token of the
last write before it, so a write's backward runs after every read of its slots. A state's K and
V tuples hold the cache's slots as written (the other entries as given: begin's zeros, a
skipped block's); a state whose slots are not the frontier of its cache (a state continued
twice, or one from the plain code) gets a cache of its own, its slots copied in, their gradient
handed back to them. `TorchOps` (any device) and `TritonOps` (fast/moda_kernels.py: CUDA or
Triton's interpreter) are two forms of the depth steps; `block(ops)` gives the method.

`sdpa_attention` (MoDA.attention with a null key on SDPA) is the earlier fast form of the joint
softmax alone, kept as a measured comparison (tools/gpu_check.py).
"""

import torch
import torch.nn.functional as F

from fast.launch import launch
from residuals import MoDA, no_autocast

TOKEN = '_moda_token'  # attribute of the cache's keys tensor: the token of its last write


# ---- the sequence part on the flash kernel, with its logsumexp -------------------------------

def _flash_ok(q):
    return q.device.type == 'cpu' or (q.dtype in (torch.float16, torch.bfloat16) and q.size(-1) % 8 == 0
                                      and q.size(-1) <= 256)


def seq_attention(q, k, v, scale):
    """Causal attention of q (B, H, T, hd) on k, v (B, H, T, hd) -> (o in q's dtype, lse (B, H, T) fp32
    (fp64 for fp64)): the flash kernel where it applies (the CPU's, CUDA's for 16-bit), else the
    scores explicitly."""
    if q.device.type == 'cpu':
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
        return o, lse
    if _flash_ok(q):
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
        return out[0], out[1]
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device).tril(), float('-inf'))
    lse = torch.logsumexp(s, -1)
    return (torch.exp(s - lse.unsqueeze(-1)) @ v.float()).to(q.dtype), lse


def seq_attention_backward(dy, q, k, v, y, lse, scale):
    """The gradients of the causal sequence part of a joint softmax whose output y and logsumexp lse
    (over sequence and depth keys) are given: the flash backward computes P = exp(S - lse) and
    dy . y from them, so its dq, dk, dv are the joint softmax's for the sequence keys."""
    if q.device.type == 'cpu':
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dy, q, k, v, y, lse, 0.0, True, scale=scale)
    if _flash_ok(q):
        B, H, T, _ = q.shape
        cum = torch.empty(0, dtype=torch.int32, device=q.device)
        seed = torch.empty((), dtype=torch.int64, device=q.device)
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dy, q, k, v, y, lse.float(), cum, cum, T, T, 0.0, True, seed, seed, scale=scale)[:3]
    f = torch.float32 if q.dtype != torch.float64 else torch.float64
    qf, kf, vf, dyf = q.to(f), k.to(f), v.to(f), dy.to(f)
    s = (qf @ kf.transpose(-1, -2)) * scale
    s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=q.device).tril(), float('-inf'))
    P = torch.exp(s - lse.unsqueeze(-1))
    ds = P * (dyf @ vf.transpose(-1, -2) - (dyf * y.to(f)).sum(-1, keepdim=True))
    return (ds @ kf * scale).to(q.dtype), (ds.transpose(-1, -2) @ qf * scale).to(k.dtype), \
        (P.transpose(-1, -2) @ dyf).to(v.dtype)


# ---- the depth steps, in torch --------------------------------------------------------------

def _groups(t, Hkv):
    """(B, H, T, hd) -> (B, H_kv, G, T, hd)."""
    B, H, T, hd = t.shape
    return t.view(B, Hkv, H // Hkv, T, hd)


class TorchOps:
    """The depth steps in torch ops, on any device; math in fp32 (fp64 for fp64)."""

    @staticmethod
    def forward(q, Kc, Vc, S, o, lse_seq, scale):
        """The depth part of block reading slots [0, S) of the cache Kc, Vc (B, H_kv, T, 2L, hd), merged
        with the sequence part (o, lse_seq): -> (y in q's dtype, lse (B, H, T))."""
        acc = torch.promote_types(q.dtype, torch.float32)
        B, H, T, hd = q.shape
        q5 = _groups(q, Kc.size(1)).to(acc)
        d = torch.einsum('bkgtd,bktsd->bkgts', q5, Kc[:, :, :, :S].to(acc)) * scale    # (B, H_kv, G, T, S)
        lse_d = torch.logsumexp(d, -1)
        y_d = torch.einsum('bkgts,bktsd->bkgtd', torch.exp(d - lse_d.unsqueeze(-1)), Vc[:, :, :, :S].to(acc))
        lse_d, y_d = lse_d.reshape(B, H, T), y_d.reshape(B, H, T, hd)
        lse = torch.logaddexp(lse_seq.to(acc), lse_d)
        y = torch.exp(lse_seq - lse).unsqueeze(-1) * o.to(acc) + torch.exp(lse_d - lse).unsqueeze(-1) * y_d
        return y.to(q.dtype), lse

    @staticmethod
    def backward(q, Kc, Vc, S, dy, y, lse, dq_seq, scale):
        """The depth part's dq added to the sequence part's: -> (dq in q's dtype, D = dy . y (B, H, T))."""
        acc = torch.promote_types(q.dtype, torch.float32)
        Hkv = Kc.size(1)
        D = (dy.to(acc) * y.to(acc)).sum(-1)
        q5, dy5 = _groups(q, Hkv).to(acc), _groups(dy, Hkv).to(acc)
        K, V = Kc[:, :, :, :S].to(acc), Vc[:, :, :, :S].to(acc)
        a = torch.exp(torch.einsum('bkgtd,bktsd->bkgts', q5, K) * scale - _groups(lse.unsqueeze(-1), Hkv))
        ds = a * (torch.einsum('bkgtd,bktsd->bkgts', dy5, V) - _groups(D.unsqueeze(-1), Hkv))
        dq = torch.einsum('bkgts,bktsd->bkgtd', ds, K).reshape(q.shape) * scale
        return (dq_seq.to(acc) + dq).to(q.dtype), D

    @staticmethod
    def slot_grads(Kc, Vc, j0, n, readers, scale):
        """The gradients of slots j0 .. j0 + n - 1 from the readers (S, q, dy, lse, D) that read them
        (slot j by the readers with S > j): [(dK_j, dV_j)] (B, H_kv, T, hd) in fp32 (fp64)."""
        acc = torch.promote_types(Kc.dtype, torch.float32)
        Hkv = Kc.size(1)
        out = []
        for j in range(j0, j0 + n):
            Kj, Vj = Kc[:, :, :, j].to(acc), Vc[:, :, :, j].to(acc)                         # (B, H_kv, T, hd)
            dK, dV = torch.zeros_like(Kj), torch.zeros_like(Vj)
            for S, q, dy, lse, D in readers:
                if S <= j:
                    continue
                q5, dy5 = _groups(q, Hkv).to(acc), _groups(dy, Hkv).to(acc)                 # (B, H_kv, G, T, hd)
                a = torch.exp((q5 * Kj.unsqueeze(2)).sum(-1) * scale - _groups(lse.unsqueeze(-1), Hkv)[..., 0])
                ds = a * ((dy5 * Vj.unsqueeze(2)).sum(-1) - _groups(D.unsqueeze(-1), Hkv)[..., 0])
                dK += (ds.unsqueeze(-1) * q5).sum(2) * scale
                dV += (a.unsqueeze(-1) * dy5).sum(2)
            out.append((dK, dV))
        return out



def _pow2(n):
    return 1 << max(n - 1, 0).bit_length()


def _strides(t):
    assert t.stride(-1) == 1, "the feature dim is contiguous"
    return t.stride(0), t.stride(1), t.stride(2)


class TritonOps:
    """The depth steps as launches of fast/moda_kernels.py (fp32 math; CUDA or Triton's interpreter).
    fp64 takes TorchOps' code instead (on the same device)."""

    BT = 64  # tokens per program

    @staticmethod
    def _consts(q, Kc):
        B, H, T, hd = q.shape
        Hkv = Kc.size(1)
        return dict(Hkv=Hkv, T=T, NS=Kc.size(3), hd=hd, G=H // Hkv, GP=_pow2(H // Hkv), BT=TritonOps.BT,
                    HD=max(16, _pow2(hd))), (triton_cdiv(T, TritonOps.BT), B * Hkv)

    @staticmethod
    def forward(q, Kc, Vc, S, o, lse_seq, scale):
        if q.dtype == torch.float64:
            return TorchOps.forward(q, Kc, Vc, S, o, lse_seq, scale)
        consts, grid = TritonOps._consts(q, Kc)
        y = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        lse_seq = lse_seq.float().contiguous()
        (sqb, sqh, sqt), (sob, soh, sot) = _strides(q), _strides(o)
        launch('fast.moda_kernels', 'depth_fwd', grid, reads=('q', 'o', 'lse_seq', 'Kc', 'Vc'), writes=('y', 'lse'),
               flops=4 * q.numel() * S, num_warps=4, q=q, sqb=sqb, sqh=sqh, sqt=sqt, o=o, sob=sob, soh=soh, sot=sot,
               lse_seq=lse_seq, Kc=Kc[:, :, :, :S], Vc=Vc[:, :, :, :S], y=y, lse=lse, S=S, scale=scale, **consts)
        return y, lse

    @staticmethod
    def backward(q, Kc, Vc, S, dy, y, lse, dq_seq, scale):
        if q.dtype == torch.float64:
            return TorchOps.backward(q, Kc, Vc, S, dy, y, lse, dq_seq, scale)
        consts, grid = TritonOps._consts(q, Kc)
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        D = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        y = y.contiguous()
        (sqb, sqh, sqt), (sdb, sdh, sdt), (sgb, sgh, sgt) = _strides(q), _strides(dy), _strides(dq_seq)
        launch('fast.moda_kernels', 'depth_bwd', grid, reads=('q', 'dy', 'yy', 'lse', 'dq_seq', 'Kc', 'Vc'),
               writes=('dq', 'D'), flops=6 * q.numel() * S, num_warps=4, q=q, sqb=sqb, sqh=sqh, sqt=sqt, dy=dy,
               sdb=sdb, sdh=sdh, sdt=sdt, yy=y, lse=lse, dq_seq=dq_seq, sgb=sgb, sgh=sgh, sgt=sgt,
               Kc=Kc[:, :, :, :S], Vc=Vc[:, :, :, :S], dq=dq, D=D, S=S, scale=scale, **consts)
        return dq, D

    @staticmethod
    def slot_grads(Kc, Vc, j0, n, readers, scale):
        if Kc.dtype == torch.float64:
            return TorchOps.slot_grads(Kc, Vc, j0, n, readers, scale)
        out, j = [], j0
        while j < j0 + n:
            mine = [r for r in readers if r[0] > j]
            pair = j + 1 < j0 + n and all(r[0] > j + 1 for r in mine)   # the next slot has the same readers
            out += TritonOps._slots(Kc, Vc, j, 2 if pair else 1, mine, scale)
            j += 2 if pair else 1
        return out

    @staticmethod
    def _slots(Kc, Vc, j, nslot, readers, scale):
        B, Hkv, T, NS, hd = Kc.shape
        grads = [torch.empty(B, Hkv, T, hd, dtype=Kc.dtype, device=Kc.device) for _ in range(2 * nslot)]
        if not readers:
            return [(g.zero_(), h.zero_()) for g, h in zip(grads[::2], grads[1::2])]
        q0, dy0 = readers[0][1], readers[0][2]
        qs = [r[1] if r[1].stride() == q0.stride() else r[1].contiguous() for r in readers]
        dys = [r[2] if r[2].stride() == dy0.stride() else r[2].contiguous() for r in readers]
        if any(t.stride() != qs[0].stride() for t in qs) or any(t.stride() != dys[0].stride() for t in dys):
            qs, dys = [t.contiguous() for t in qs], [t.contiguous() for t in dys]
        consts, grid = TritonOps._consts(qs[0], Kc)
        pad = _pow2(len(readers)) - len(readers)
        dummy = torch.empty(1, dtype=torch.float32, device=Kc.device)

        def padded(ts):  # a power-of-2 tuple (fewer compiled variants), padded with its own dtype
            return tuple(ts) + tuple(torch.empty(1, dtype=ts[0].dtype, device=Kc.device) for _ in range(pad))
        (sqb, sqh, sqt), (sdb, sdh, sdt) = _strides(qs[0]), _strides(dys[0])
        launch('fast.moda_kernels', 'slot_bwd', grid, reads=('Kc', 'Vc', 'qs', 'dys', 'lses', 'Ds'),
               writes=('dK0', 'dV0') + (('dK1', 'dV1') if nslot == 2 else ()),
               flops=8 * sum(r[1].numel() for r in readers) * nslot, num_warps=4,
               Kc=Kc[:, :, :, j:j + nslot], Vc=Vc[:, :, :, j:j + nslot],
               qs=padded(qs), sqb=sqb, sqh=sqh, sqt=sqt, dys=padded(dys), sdb=sdb, sdh=sdh, sdt=sdt,
               lses=padded([r[3] for r in readers]), Ds=padded([r[4] for r in readers]), R=len(readers),
               dK0=grads[0], dV0=grads[1], dK1=grads[2] if nslot == 2 else dummy,
               dV1=grads[3] if nslot == 2 else dummy, scale=scale, NSLOT=nslot, **consts)
        return list(zip(grads[::2], grads[1::2]))


def triton_cdiv(a, b):
    return -(-a // b)


def task():
    return torch._C._current_graph_task_id()


class Meta:
    """What the cache knows besides its tensors: the slots written so far (the frontier) and,
    per backward pass, what each reading block stashed. Holds no reference to the cache."""

    def __init__(self, ops):
        self.ops, self.filled = ops, 0
        self.stash = {}   # backward pass -> [(S, q, dy, lse, D)]


class DepthAttention(torch.autograd.Function):
    """y = DepthAttention.apply(meta, S, scale, Kc, Vc, token, q, k, v): the joint softmax of q (B, H,
    T, hd) over the causal keys k and values v (B, H_kv, T, hd; v is the cache's slot 2p, v_slot,
    which the flash kernel reads and keeps) and the depth slots [0, S) of the cache Kc, Vc."""

    @staticmethod
    def forward(ctx, meta, S, scale, Kc, Vc, token, q, k, v, v_slot):
        G = q.size(1) // k.size(1)
        kk, vv = (k, v_slot) if G == 1 else (k.repeat_interleave(G, 1), v_slot.repeat_interleave(G, 1))
        with no_autocast(q):
            o, lse = seq_attention(q, kk, vv, scale)
            if S > 0:
                y, lse = meta.ops.forward(q, Kc, Vc, S, o, lse, scale)
            else:
                y = o
        ctx.meta, ctx.S, ctx.scale, ctx.G, ctx.token = meta, S, scale, G, token is not None
        ctx.save_for_backward(Kc, Vc, q, kk, vv, y, lse)
        ctx.set_materialize_grads(False)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        Kc, Vc, q, kk, vv, y, lse = ctx.saved_tensors
        meta, S, scale, G = ctx.meta, ctx.S, ctx.scale, ctx.G
        if dy is None:
            return (None,) * 10
        with no_autocast(q):
            dq, dk, dv = seq_attention_backward(dy, q, kk, vv, y, lse, scale)
            if S > 0:
                dq, D = meta.ops.backward(q, Kc, Vc, S, dy, y, lse, dq, scale)
                meta.stash.setdefault(task(), []).append((S, q, dy, lse, D))
        if G > 1:
            dk, dv = (t.unflatten(1, (-1, G)).sum(2) for t in (dk, dv))
        token = torch.zeros(0, dtype=Kc.dtype, device=Kc.device) if ctx.token else None  # the empty token's
        return None, None, None, None, None, token, dq, dk, dv, None


class WriteSlots(torch.autograd.Function):
    """token', *slots' = WriteSlots.apply(meta, j0, scale, Kc, Vc, copy, token, K_j0, V_j0, ...): the
    slots j0 .. j0 + n - 1 of the cache, written from the given tensors ((B, H_kv, T, hd) each;
    copy: whether to copy them in here, or they were copied before). Returns a new token (empty)
    and the slots as the cache holds them: aliases with version counters of their own (later
    writes touch other slots), a state's entries, whose gradient from any other use is added to
    the slots'. Backward: each slot's gradient from all the blocks that read it (Meta.stash), in
    one pass over each reader (`ops.slot_grads`), in the dtype of the tensor it was written from."""

    @staticmethod
    def forward(ctx, meta, j0, scale, Kc, Vc, copy, token, *slots):
        n = len(slots) // 2
        if copy:
            with torch.no_grad():
                for i in range(n):
                    Kc[:, :, :, j0 + i].copy_(slots[2 * i])
                    Vc[:, :, :, j0 + i].copy_(slots[2 * i + 1])
        meta.filled = max(meta.filled, j0 + n)
        ctx.meta, ctx.j0, ctx.n, ctx.scale, ctx.first = meta, j0, n, scale, token is None
        ctx.dtypes = [t.dtype for t in slots]
        ctx.save_for_backward(Kc, Vc)
        ctx.set_materialize_grads(False)
        out = [torch.empty(0, dtype=Kc.dtype, device=Kc.device)]
        for i in range(n):
            out += [alias(Kc[:, :, :, j0 + i]), alias(Vc[:, :, :, j0 + i])]
        return tuple(out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dtoken, *douts):
        Kc, Vc = ctx.saved_tensors
        meta, j0, n = ctx.meta, ctx.j0, ctx.n
        t = task()
        readers = [r for r in meta.stash.get(t, []) if r[0] > j0]
        if ctx.first:  # the cache's first write runs its backward last: every read has stashed
            meta.stash.pop(t, None)
        with no_autocast(Kc):
            pairs = meta.ops.slot_grads(Kc, Vc, j0, n, readers, ctx.scale) if readers else [(None, None)] * n
        grads = []
        for i, (dK, dV) in enumerate(pairs):
            for g, other, dtype in ((dK, douts[2 * i], ctx.dtypes[2 * i]), (dV, douts[2 * i + 1], ctx.dtypes[2 * i + 1])):
                g = other if g is None else g if other is None else g + other
                grads.append(None if g is None else g.to(dtype))
        return (None,) * 7 + tuple(grads)


# ---- the cache of a state, and the block ---------------------------------------------------

def _is_slot(t, Kc, j):
    """Whether tensor t is slot j of the cache Kc (B, H_kv, T, 2L, hd): its memory, as a view."""
    return (isinstance(t, torch.Tensor) and t.untyped_storage()._cdata == Kc.untyped_storage()._cdata
            and t.storage_offset() == Kc.storage_offset() + j * Kc.stride(3) and t.shape == Kc[:, :, :, j].shape
            and t.stride() == Kc[:, :, :, j].stride())


def cache_of(res, K, V, p, like, ops):
    """(Kc, Vc, meta, token) for a block at position p with the state's slot tuples K, V: the
    cache whose slots they are, when its frontier is at most slot 2p; else a new one (2L slots, the
    dtype and device of `like`). Slots [frontier, 2p) are copied in from the tuples (skipped
    blocks' zeros; all of a new cache's), their gradient handed back to them."""
    owner = getattr(K[0], '_moda_cache', None) if p > 0 else None
    if owner is not None:
        Kc, Vc = owner
        meta = Kc._moda_meta
        if not (meta.filled <= 2 * p and all(_is_slot(K[j], Kc, j) and _is_slot(V[j], Vc, j)
                                             for j in range(meta.filled))):
            owner = None  # a state continued twice, or slots that are not this cache's: a cache of its own
    if owner is not None:
        token, start = getattr(Kc, TOKEN), meta.filled
    else:
        B, Hkv, T, hd = like.shape
        Kc = torch.empty(B, Hkv, T, 2 * res.cfg.n_layer, hd, dtype=like.dtype, device=like.device)
        Vc = torch.empty_like(Kc)
        meta, token, start = Meta(ops), None, 0
        Kc._moda_meta = meta
    if start < 2 * p:
        slots = [t for j in range(start, 2 * p) for t in (K[j], V[j])]
        token, *written = WriteSlots.apply(meta, start, like.size(-1) ** -0.5, alias(Kc), alias(Vc), True, token,
                                           *slots)
        setattr(Kc, TOKEN, token)
    return Kc, Vc, meta, token


def alias(t):
    """A tensor on t's memory with a version counter of its own, not a view: what a backward keeps
    of the cache (later writes go to other slots, through the cache, and must not invalidate it)."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.shape,
                                                                t.stride())


def _slot_tuple(slots, j, t):
    return slots[:j] + (t,) + slots[j + 1:]


def block(ops):
    """MoDA.block(state, b, layer, rope) on the depth cache with `ops` (module docstring)."""
    @torch.compiler.disable
    def cached(self, state, b, layer, rope):
        h, K, V, p = state
        if 2 * p + 2 > len(K):
            raise ValueError(f"MoDA's depth cache has {len(K)} slots: an order may run or skip "
                             f"at most n_layer={self.cfg.n_layer} blocks")
        if not self.use_depth:
            return MoDA.block(self, state, b, layer, rope)
        attn, prm = layer.attn, self.layers[b]
        q, k, v = attn.qkv(prm.attn_norm(h))  # (B, H, T, hd), (B, H_kv, T, hd) x2, before RoPE
        qr, kr = attn.rotate(q, rope), attn.rotate(k, rope)
        Kc, Vc, meta, token = cache_of(self, K, V, p, k, ops)
        with torch.no_grad():  # slot 2p before the attention: the flash kernel reads v from it
            Kc[:, :, :, 2 * p].copy_(k)
            Vc[:, :, :, 2 * p].copy_(v)
        scale = q.size(-1) ** -0.5
        y = DepthAttention.apply(meta, 2 * p, scale, alias(Kc), alias(Vc), token, qr, kr, v, alias(Vc[:, :, :, 2 * p]))
        h = h + attn.out(y)
        x = prm.mlp_norm(h)
        slots = [k, v]
        if prm.depth_kv is not None:
            B, T, _ = h.shape
            slots += list(prm.depth_kv(x).view(B, T, 2, k.size(1), -1).permute(2, 0, 3, 1, 4))  # 2x (B, H_kv, T, hd)
            with torch.no_grad():
                Kc[:, :, :, 2 * p + 1].copy_(slots[2])
                Vc[:, :, :, 2 * p + 1].copy_(slots[3])
        token, *written = WriteSlots.apply(meta, 2 * p, scale, alias(Kc), alias(Vc), False, token, *slots)
        setattr(Kc, TOKEN, token)
        for t in written:
            t._moda_cache = (Kc, Vc)  # the state's entries lead to their cache
        for i in range(len(written) // 2):
            K, V = _slot_tuple(K, 2 * p + i, written[2 * i]), _slot_tuple(V, 2 * p + i, written[2 * i + 1])
        return h + layer.mlp(x), K, V, p + 1
    return cached


# ---- the joint softmax alone on SDPA: a measured comparison ------------------------------------

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
        y_dep, lse = y_dep.reshape(B, H, T, hd), lse.reshape(B, H, T)
        shift = (-lse / scale).to(q.dtype)                                            # (B, H, T)
        # position 0 of keys and queries: the null key, and a dummy query whose output is dropped
        q1 = F.pad(torch.cat((q, shift.unsqueeze(-1)), dim=-1), (0, 0, 1, 0))         # (B, H, 1 + T, hd + 1)
        k1 = F.pad(torch.cat((k, k.new_ones(B, Hkv, T, 1)), dim=-1), (0, 0, 1, 0))   # (B, H_kv, 1 + T, hd + 1)
        v1 = F.pad(v, (0, 1, 1, 0)) + F.pad(v.new_ones(1, 1, 1, 1), (hd, 0, 0, T))  # null value e_hd
        o = F.scaled_dot_product_attention(q1, k1, v1, is_causal=True, scale=scale,
                                           enable_gqa=H != Hkv)[:, :, 1:]             # (B, H, T, hd + 1)
        if shift.dtype == lse.dtype:  # fp32 / fp64: the shift is lse to the last bit
            return (o[..., :hd] + o[..., hd:] * y_dep).to(q.dtype)
        # bf16 / fp16: the kernel shifted by the rounded shift, not by lse: with
        # r = exp(lse + shift * scale) the depth mass is r * o_null out of 1 + (r - 1) o_null
        r = torch.exp(lse + shift.to(acc) * scale).unsqueeze(-1)                      # (B, H, T, 1), fp32
        null = o[..., hd:].to(acc)
        return ((o[..., :hd].to(acc) + (r * null) * y_dep.to(acc)) / (1 + (r - 1) * null)).to(q.dtype)
