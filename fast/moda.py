"""
Fast form of MoDA's joint sequence-and-depth attention, `residuals.MoDA.attention(q, k, v,
depth_k, depth_v) -> y`: the same softmax without the explicit (T x (T + S)) score matrix,
on fused `F.scaled_dot_product_attention` (flash attention on CUDA and on the CPU).

The depth part collapses into one key per query: lse_t = log sum_j exp(d_tj) (fp32) and
y_dep,t = softmax(d_t) . V_depth[t]. Shifting query t's sequence scores by -lse_t through one
extra head dimension (q' = [q, -lse / scale], k' = [k, 1]) and prepending a null key (score 0,
value e_hd) that every query sees (a dummy query at position 0 keeps the causal mask square)
makes the kernel return o_t = sum_s a_ts v_s and o_t[hd] = the total depth weight, so
y_t = o_t[:hd] + o_t[hd] * y_dep,t. Exact up to the rounding of the shift in q's dtype,
which is corrected below for bf16 / fp16.

Dtypes as in the plain code, with autocast off so that they stay what is written: the
depth scores d in q's dtype (a matmul of q / sqrt(hd) and the depth keys, as the plain
scores), their softmax and lse in fp32, the depth weights back in q's dtype for their
matmul with the depth values; the depth keys and values are read in their own dtype (never
copied to fp32; a skipped block's zero slot, fp32 among bf16
ones, is cast to q's dtype as autocast casts it for the plain matmuls).
"""

import torch
import torch.nn.functional as F

from residuals import no_autocast


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
