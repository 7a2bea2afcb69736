"""
Fast forms of the HC / mHC routing (`residuals.MultiStream`): the coefficients, the read
x = A_m^T H = sum_s A_m[s] H[s] and the write H' = A_r^T H + beta (x) y, H (B, T, m, d)
(mHC's H_pre, H_res, H_post are A_m, A_r, beta).

- liger_kernel's mHC kernels (liger_kernel.transformers.functional, the study's default mHC
  backend): `liger_coefficients` (mHC: fused x' phi + RMS, gates, Sinkhorn), `liger_read`
  and `liger_write` (HC and mHC: its pre and post_res ops; they take H_res stored (out, in),
  our A_r transposed). CUDA only.
- torch forms with hand-written backwards: `torch_mhc_coefficients` (Sinkhorn rounds that
  keep their gradient in one layout instead of ~4 x iters small autograd nodes) and
  `torch_write` (the write as one batched matmul-add). Any device.
"""

import torch

from residuals import LIGER_SINKHORN_EPS


# ---- liger_kernel (CUDA) -----------------------------------------------------

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


# ---- torch forms (any device) --------------------------------------------------

class SinkhornRounds(torch.autograd.Function):
    """`iters` rounds of P <- P / (sum_first(P) + eps), P <- P / (sum_last(P) + eps) on
    P (..., m, m) > 0, dims (first, last) = (-2, -1) or (-1, -2). Backward per step
    y = P / s, s = sum + eps: dP = (dy - sum(dy * y)) / s, in the saved layout."""

    @staticmethod
    def forward(ctx, P, iters, first, last, eps):
        steps = []
        for _ in range(iters):
            for dim in (first, last):
                s = P.sum(dim, keepdim=True) + eps
                P = P / s
                steps += [P, s]
        ctx.dims = (first, last)
        ctx.save_for_backward(*steps)
        return P

    @staticmethod
    def backward(ctx, g):
        steps = ctx.saved_tensors
        for i in reversed(range(0, len(steps), 2)):
            y, s = steps[i], steps[i + 1]
            dim = ctx.dims[(i // 2) % 2]
            g = (g - (g * y).sum(dim, keepdim=True)) / s
        return g, None, None, None, None


def torch_sinkhorn(logits, iters, order, eps):
    """residuals.sinkhorn with the rounds after the first as `SinkhornRounds`."""
    first, last = (-2, -1) if order == 'liger' else (-1, -2)
    if eps > 0:
        P = torch.softmax(logits, dim=first) + eps
        P = P / (P.sum(last, keepdim=True) + eps)
    else:
        P = torch.softmax(torch.log_softmax(logits, dim=first), dim=last)
    return P if iters == 1 else SinkhornRounds.apply(P, iters - 1, first, last, eps)


def torch_mhc_coefficients(self, H, route):
    """MHC.coefficients with `torch_sinkhorn`."""
    B, T, m, d = H.shape
    x_norm = torch.nn.functional.rms_norm(H.reshape(B, T, m * d), (m * d,), eps=self.cfg.norm_eps)
    l_pre, l_post, l_res = (x_norm @ route.phi).split([m, m, m * m], dim=-1)
    b_pre, b_post, b_res = route.bias.split([m, m, m * m])
    order = self.cfg.mhc_sinkhorn
    H_res = torch_sinkhorn((route.alpha_res * l_res + b_res).view(B, T, m, m), self.cfg.mhc_sinkhorn_iters, order,
                           LIGER_SINKHORN_EPS if order == 'liger' else 0.0)
    return torch.sigmoid(route.alpha_pre * l_pre + b_pre), H_res, 2 * torch.sigmoid(route.alpha_post * l_post + b_post)


def torch_write(self, H, A_r, beta, y):
    """MultiStream.write_streams as one batched matmul-add over the B T tokens,
    H' = A_r^T H + beta y^T per token, with A_r^T made contiguous: the CPU's batched matmul
    then takes its fast path (the plain einsum's layout makes it copy one token at a time)."""
    B, T, m, d = H.shape
    out = torch.baddbmm((beta.unsqueeze(-1) * y.unsqueeze(-2)).reshape(B * T, m, d),
                        A_r.reshape(B * T, m, m).transpose(1, 2).contiguous(), H.reshape(B * T, m, d))
    return out.view(B, T, m, d)
