"""
Fast form of HC's coefficients, `residuals.HC.coefficients(H, route) -> (A_m, A_r, beta)`:
the same math with the normalised streams never built. With r = 1/rms(H) per stream
(eps 1e-8) and W = [W_alpha | w_beta] (d, m + 2),

    Z = tanh(H_bar W) = tanh(r * (H W)),   [A_m | A_r] = static_alpha + s_alpha Z[:m+1],
    beta = static_beta + s_beta Z[m+1]

`HCProjection` computes r * (H W) from one pass over H for r and one matrix product, and its
backward from (m + 2)-wide per-token tensors (dZ the gradient of r * (H W)):
dH = (r dZ) W^T - H r^3 (dZ . H W) / d and dW = H^T (r dZ). The plain code builds H_bar
(B, T, m, d) fp32, multiplies it twice, sums two gradients of that size and runs RMSNorm's
backward over it.
"""

import torch


class HCProjection(torch.autograd.Function):
    """Za, Zb = HCProjection.apply(H, Wa, wb, eps): H (..., d), Wa (d, k), wb (d,) -> the
    columns of [Wa | wb] of H W / rms(H): Za (..., k), Zb (...,), rms(H) = sqrt(mean(H^2) +
    eps) over the last dim. Saves H (the streams, alive anyway), 1/rms and H W; an output
    left unused gives its weight no gradient (None), as in the plain code."""

    @staticmethod
    def forward(ctx, H, Wa, wb, eps):
        d = H.size(-1)
        W = torch.cat([Wa, wb.unsqueeze(-1)], dim=-1)                       # (d, k + 1)
        r = torch.rsqrt(torch.linalg.vecdot(H, H) / d + eps).unsqueeze(-1)   # (..., 1)
        P = H @ W                                                           # (..., k + 1)
        ctx.save_for_backward(H, W, r, P)
        ctx.set_materialize_grads(False)
        Z = P * r
        return Z[..., :-1], Z[..., -1]

    @staticmethod
    def backward(ctx, dZa, dZb):
        H, W, r, P = ctx.saved_tensors
        d, k = H.size(-1), W.size(-1)
        dZ = torch.cat([torch.zeros_like(P[..., :-1]) if dZa is None else dZa,
                        (torch.zeros_like(P[..., -1]) if dZb is None else dZb).unsqueeze(-1)], dim=-1)
        dP = dZ * r                                                         # (..., k + 1)
        c = (dZ * P).sum(-1, keepdim=True) * r.pow(3) / -d                 # dL/dr * dr/dH per H entry
        dH = (dP @ W.t()).addcmul_(H, c)                                     # (..., d)
        dW = H.reshape(-1, d).t() @ dP.reshape(-1, k)                       # (d, k + 1)
        return (dH, None if dZa is None else dW[:, :-1], None if dZb is None else dW[:, -1], None)


def torch_hc_coefficients(self, H, r):
    """HC.coefficients with `HCProjection`: H (B, T, m, d) fp32 -> A_m (B, T, m),
    A_r (B, T, m, m), beta (B, T, m)."""
    Za, Zb = HCProjection.apply(H, r.dynamic_alpha, r.dynamic_beta, 1e-8)   # (B, T, m, m + 1), (B, T, m)
    C = r.static_alpha + r.alpha_scale * torch.tanh(Za)                     # [A_m | A_r]
    w = r.static_beta + r.beta_scale * torch.tanh(Zb)
    return C[..., 0].contiguous(), C[..., 1:].contiguous(), w
