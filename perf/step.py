"""
The cost of one training micro-step, counted without a GPU (docs/performance.md):

    python bench.py --suite=step     # the 400M L = 32 shape, micro-batch 16 x 2048, bf16, fast paths as on CUDA
    python bench.py --suite=step --step_schemes=preln,attnres --step_config=config/attnres_L24.py --batch_size=4

The real model (model.GPT with a scheme of residuals.py) runs one forward and backward
under torch's FakeTensorMode: every tensor has its shape and dtype but no memory and no
values, so the 400M model at micro-batch 16 x 2048 runs on a laptop CPU in seconds. A
dispatch mode (`StepCount`) sees every aten op of forward and backward and counts:

  kernels  one per op that writes a tensor; views, metadata ops and allocations launch
           none (`launches`: an op whose results all alias its inputs without writing
           them, or one of NO_KERNEL)
  bytes    what each such op reads (every distinct input tensor once, a broadcast dim
           once) plus what it writes (its results, an in-place op's self): its HBM
           traffic if nothing stays in cache between kernels
  FLOPs    torch.utils.flop_counter's formulas (matrix products, attention) and cost.py's
           for mv / addmv / dot / addcmul; elementwise work counts 0
  saved    the bytes autograd keeps for the backward (saved-tensor hooks, each storage
           once, weights excluded), as plan.memory.saved_activation_bytes counts them

What a CUDA run would launch, modelled on a CPU build of torch:
  - fake tensors live on the CPU (autograd cannot run on fake CUDA tensors in a CPU
    build) and bf16 autocast is the CPU's; its op lists agree with CUDA's on every op
    this model runs in bf16 (matrix products and attention: bf16; norms, softmax and the
    loss: called on fp32 tensors);
  - attention is one fused kernel forward and one backward (the CPU's flash kernel,
    same inputs, outputs and saved tensors as CUDA's flash attention);
  - F.rms_norm is one kernel forward and two backward (CUDA's fused RMSNorm; the CPU
    decomposes it into five ops);
  - with fast='cuda', the fast paths of fast/ that CUDA selects when Triton and
    liger-kernel are installed: the project's own Triton kernels run up to their launch
    (perf/launch.py), which is recorded as one kernel with the bytes of the tensors it is
    given to read and write; Liger's kernels, and fla-core's AttnRes kernel for the
    comparison rows ('cuda_fla'), are counting stand-ins (`KERNELS`) that read and write
    the tensors the real kernels do, from the packages' sources (liger-kernel 0.8.5
    liger_kernel/ops/mhc.py, fla-core 0.6.0 fla/ops/attnres/fused.py); the torch code
    around every kernel runs as it is.

Time model: Pre-LN's micro-step takes its model FLOPs (model.flops_per_token) at PRELN_MFU
of the peak, what a compiled nanoGPT-class step reaches; a scheme takes that plus the time
of its own ops minus Pre-LN's, each op t = max(FLOPs / (peak x PRELN_MFU), bytes /
(bandwidth x eta_b)) + launch (one stream, no overlap between kernels). The backbone's ops
are the same in both and cancel, so their eager count (below) does not enter a ratio.
eta_b and the launch overhead are unknown and span BW_EFF x LAUNCH_S: a ratio is given at
the middle of that box, with its range over the corners.

Limits: eager (no inductor fusion: compile_regions fuses the elementwise ops inside the
attention and MLP of every scheme alike, and a scheme's own region; a fused region costs
less than counted); the optimizer step is left out (once per step, not per micro-step);
bytes are the traffic with no cache reuse between kernels (the 50 MB L2 of an H100 can
hold a small op's inputs), none inside a kernel; a stand-in's bytes are those its kernel
is written to move, not a measurement.
"""

import contextlib
import math
import statistics
import sys
import time
import types

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry, shape_wrapper

import cost
import fast
from perf.launch import Recorder
from model import GPT, GPTConfig
from residuals import RESIDUALS

aten = torch.ops.aten

# Accelerators: dense bf16 tensor-core peak (FLOP/s) and HBM bandwidth (bytes/s), NVIDIA's
# datasheets (sparsity figures halved): H100 SXM5 80 GB "H100 Tensor Core GPU" datasheet
# (1,979 TFLOPS sparse, 3.35 TB/s); H200 SXM 141 GB datasheet (1,979 sparse, 4.8 TB/s); A100
# SXM 80 GB datasheet (624 sparse, 2,039 GB/s).
SPECS = {
    'H100': dict(peak=989e12, bandwidth=3.35e12, memory=80e9),
    'H200': dict(peak=989e12, bandwidth=4.8e12, memory=141e9),
    'A100': dict(peak=312e12, bandwidth=2.039e12, memory=80e9),
}
BW_EFF = (0.6, 0.75, 0.9)       # achieved / peak HBM bandwidth of a memory-bound kernel (low, mid, high)
LAUNCH_S = (3e-6, 5e-6, 8e-6)   # seconds per kernel: launch and the tail of a short kernel (low, mid, high)
PRELN_MFU = 0.5                 # Pre-LN's model FLOPs utilisation, which sets the matrix products' speed

# ops that launch no kernel although their results do not alias their inputs
NO_KERNEL = {aten._unsafe_view, aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty,
             aten.new_empty_strided, aten.set_, aten.resize_, aten._local_scalar_dense}

# FLOP formulas: torch's registry, CPU flash attention as CUDA's, cost.py's matrix-vector ones
FLOPS = dict(flop_registry)
FLOPS[aten._scaled_dot_product_flash_attention_for_cpu] = flop_registry[aten._scaled_dot_product_flash_attention]
FLOPS[aten._scaled_dot_product_flash_attention_for_cpu_backward] = \
    flop_registry[aten._scaled_dot_product_flash_attention_backward]
FLOPS.update({aten.mv: shape_wrapper(cost._mv_flops), aten.addmv: shape_wrapper(cost._addmv_flops),
              aten.dot: shape_wrapper(cost._dot_flops), aten.addcmul: shape_wrapper(cost._addcmul_flops)})


def _nll_bytes(args, out):
    # nll_loss forward reads one log-probability per row and the targets; writes the loss
    x, target = args[0], args[1]
    return target.numel() * (target.element_size() + x.element_size()) + sum(tensor_bytes(t) for t in out)


def _nll_backward_bytes(args, out):
    # nll_loss backward writes the whole gradient (zeros and one entry per row); reads the targets
    return tensor_bytes(args[2]) + tensor_bytes(out)


def _embedding_bytes(args, out):
    # a lookup reads the rows it returns, not the whole table
    return tensor_bytes(args[1]) + 2 * tensor_bytes(out)


# ops that touch only part of an input: their bytes, (args, out) -> bytes
GATHER_BYTES = {aten.nll_loss_forward: _nll_bytes, aten.nll_loss_backward: _nll_backward_bytes,
                aten.embedding: _embedding_bytes}


def launches(func):
    """Whether aten op `func` launches a kernel: it writes a tensor (an in-place op, or a
    result that is not a view of an input) and is not an allocation (NO_KERNEL)."""
    if func.overloadpacket in NO_KERNEL:
        return False
    rets = func._schema.returns
    if any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
        return True
    return any(r.alias_info is None and str(r.type) in ('Tensor', 'Tensor[]', 'Tensor?', 'List[Tensor]')
               for r in rets)


def tensor_bytes(t):
    """Bytes of the elements t addresses (a broadcast, stride-0 dim counts once)."""
    return math.prod(n for n, s in zip(t.shape, t.stride()) if s != 0) * t.element_size()


class StepCount(TorchDispatchMode):
    """Counts kernels, bytes and FLOPs of every op run under it (module docstring);
    `ops` keeps (flops, bytes) per kernel for the time model, `by_op` the totals per op name."""

    def __init__(self):
        super().__init__()
        self.kernels = self.bytes = self.flops = 0
        self.ops, self.by_op = [], {}

    def record(self, name, reads, writes, flops=0, dedupe=False, nbytes=0):
        """One kernel `name` reading `reads` and writing `writes` (tensors; None skipped),
        plus `nbytes`; dedupe: a tensor passed twice is read once."""
        if dedupe:
            reads = list({id(t): t for t in reads}.values())
        n = nbytes + sum(tensor_bytes(t) for t in reads if t is not None) + \
            sum(tensor_bytes(t) for t in writes if t is not None)
        self.kernels += 1
        self.bytes += n
        self.flops += flops
        self.ops.append((flops, n))
        k = self.by_op.setdefault(name, [0, 0, 0])
        k[0], k[1], k[2] = k[0] + 1, k[1] + n, k[2] + flops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if launches(func):
            ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            written = [a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            if written:  # in place: what it writes is an argument (read-modify-write)
                outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)][:len(written)] or ins[:1]
            f = FLOPS[func.overloadpacket](*args, **kwargs, out_val=out) if func.overloadpacket in FLOPS else 0
            name = str(func.overloadpacket).removeprefix('aten.')
            if func.overloadpacket in GATHER_BYTES:
                self.record(name, [], [], f, nbytes=GATHER_BYTES[func.overloadpacket](args, out))
            else:
                self.record(name, ins, outs, f, dedupe=True)
        return out


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """While active, `nbytes` = the bytes autograd saves for the backward: each storage once
    (views of one tensor, and a tensor saved twice, count once), storages in `exclude`
    (storage ids, `storage_id`: weights and buffers) not at all."""

    def __init__(self, exclude=()):
        self.exclude, self.seen = set(exclude), {}
        super().__init__(self.pack, lambda t: t)

    def pack(self, t):
        s = t.untyped_storage()
        if storage_id(t) not in self.exclude:
            self.seen[storage_id(t)] = s.nbytes()
        return t

    @property
    def nbytes(self):
        return sum(self.seen.values())


def storage_id(t):
    """An id of t's storage, also for fake tensors (whose data pointers are all 0)."""
    return t.untyped_storage()._cdata


_ACTIVE = []  # the StepCount the stand-ins record their kernels in


def launch(name, reads, writes, flops=0):
    if _ACTIVE:
        _ACTIVE[-1].record(name, reads, writes, flops)


# -----------------------------------------------------------------------------
# stand-ins for the kernels a CUDA run launches where the CPU runs other code


class FusedRMSNorm(torch.autograd.Function):
    """CUDA's fused RMSNorm: one kernel forward (reads x, g; writes y and 1/rms per row),
    backward one for the input's gradient and one for the gain's (each reads dy and x)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32)
        launch('rms_norm (fused)', [x, weight], [y, rstd])
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, gy):
        x, weight, rstd = ctx.saved_tensors
        gx = torch.empty_like(x)
        launch('rms_norm_backward (fused)', [gy, x, weight, rstd], [gx])
        gw = None
        if weight is not None and ctx.needs_input_grad[1]:
            gw = torch.empty_like(weight)
            launch('rms_norm_backward gain (fused)', [gy, x, rstd], [gw])
        return gx, gw, None


class CudaForms(TorchFunctionMode):
    """Routes F.rms_norm to `FusedRMSNorm`, as CUDA runs it (one kernel, not five)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.rms_norm or func is torch.rms_norm:
            x, shape, weight, eps = (list(args) + [None, None])[:4]
            weight, eps = kwargs.get('weight', weight), kwargs.get('eps', eps)
            assert len(shape) == 1, "one normalised dim"
            return FusedRMSNorm.apply(x, weight, eps)
        return func(*args, **kwargs)


class FlaAttnRes(torch.autograd.Function):
    """fla-core 0.6.0's FusedAttnresFunction (fla/ops/attnres/fused.py): forward kernel reads
    the n sources (N, D) and writes o (N, D), 1/rms and logits (n, N) and lse (N), fp32;
    backward's dv kernel reads the sources again (checkpoint_level=1 recomputes the mix from
    them first: twice) and writes every source's gradient and dqw (N, D) fp32, then a kernel
    sums dqw into dq and dw. The weights p are torch ops on (logit, lse), as in fla."""

    @staticmethod
    def forward(ctx, query, rms_weight, scale, level, *sources):
        n, (N, D) = len(sources), sources[0].shape
        f32 = torch.float32
        o = sources[0].new_empty(N, D)
        o_pre = sources[0].new_empty(N, D) if level == 0 else None
        lse, rstd, logit = o.new_empty(N, dtype=f32), o.new_empty(n, N, dtype=f32), o.new_empty(n, N, dtype=f32)
        launch('fla attnres_fwd', [query, rms_weight, *sources], [o, o_pre, rstd, logit, lse], 4 * n * N * D)
        ctx.save_for_backward(query, rms_weight, o_pre, rstd, logit, lse, *sources)
        ctx.level = level
        p = (logit * scale - lse).exp()
        ctx.mark_non_differentiable(p)
        return o, p

    @staticmethod
    def backward(ctx, do, dp):
        query, w, o_pre, rstd, logit, lse, *sources = ctx.saved_tensors
        n, (N, D) = len(sources), sources[0].shape
        dvs = [torch.empty_like(s) for s in sources]
        dqw, dq, dw = do.new_empty(N, D, dtype=torch.float32), torch.empty_like(query), torch.empty_like(w)
        reads = [do, query, w, rstd, logit, lse] + list(sources) * (2 if ctx.level == 1 else 1) + [o_pre]
        launch('fla attnres_bwd_dv', reads, dvs + [dqw], 8 * n * N * D)
        launch('fla attnres_bwd_dqdw', [dqw, query, w], [dq, dw])
        return dq, dw, None, None, *dvs


def fla_fused_attnres(query, residuals, rms_weight, output_rms_weight=None, rms_eps=1e-6, scale=1.0,
                      return_weights=False, checkpoint_level=1):
    """Stand-in of fla.ops.attnres.fused_attnres (same signature and results)."""
    assert output_rms_weight is None, "the fused output norm is not used by fast/attnres.py"
    shape = residuals[0].shape
    flat = [r.reshape(-1, shape[-1]).contiguous() for r in residuals]
    o, p = FlaAttnRes.apply(query, rms_weight, scale, checkpoint_level, *flat)
    o = o.view(shape)
    return (o, p.view(len(residuals), *shape[:-1])) if return_weights else o


class LigerCoeffs(torch.autograd.Function):
    """liger-kernel 0.8.5's LigerMHCCoeffsFunction: mm+norm kernel (reads x (N, m d), phi;
    writes mix (N, M) fp32 and 1/rms), split+Sinkhorn kernel (writes the three coefficient
    tensors and the Sinkhorn history (N, tmax, m, m) fp32 it saves); backward: the Sinkhorn
    kernel on the history, its torch glue on (N, M), the mm+norm backward kernel."""

    @staticmethod
    def forward(ctx, x, phi, b, a_pre, a_post, a_res, tmax, post_mult):
        hc, c = x.shape[-2:]
        N, K, M = x.numel() // (hc * c), hc * c, phi.size(1)
        f32 = torch.float32
        xm = x.contiguous().view(N, K)
        mix, invr = xm.new_empty(N, M, dtype=f32), xm.new_empty(N, dtype=f32)
        launch('liger mhc_mm_norm_fwd', [xm, phi], [mix, invr], 2 * N * K * M)
        pre, post, res = mix.new_empty(N, hc), mix.new_empty(N, hc), mix.new_empty(N, hc, hc)
        hist = mix.new_empty(N, tmax, hc, hc)
        launch('liger mhc_split_sinkhorn_fwd', [mix, b, a_pre, a_post, a_res], [pre, post, res, hist])
        ctx.save_for_backward(xm, phi, b, mix, invr, a_pre, a_post, a_res, hist)
        ctx.meta = x.shape, hc, post_mult
        outer = x.shape[:-2]
        return pre.view(*outer, hc), post.view(*outer, hc), res.view(*outer, hc, hc)

    @staticmethod
    def backward(ctx, g_pre, g_post, g_res):
        xm, phi, b, mix, invr, a_pre, a_post, a_res, hist = ctx.saved_tensors
        shape, hc, post_mult = ctx.meta
        N, K, M = xm.size(0), xm.size(1), mix.size(1)
        g_pre, g_post, g_res = g_pre.reshape(N, hc), g_post.reshape(N, hc), g_res.reshape(N, hc, hc)
        g_res_logits = torch.empty_like(g_res)
        launch('liger mhc_sinkhorn_bwd', [mix, b, a_res, g_res, hist], [g_res_logits])
        # liger's torch glue (ops/mhc.py, LigerMHCCoeffsFunction.backward)
        m_pre, m_post, m_res = mix.split([hc, hc, hc * hc], dim=1)
        s = torch.sigmoid(m_pre * a_pre + b[:hc])
        gl_pre = g_pre * (s * (1.0 - s))
        s = torch.sigmoid(m_post * a_post + b[hc:2 * hc])
        gl_post = g_post * (post_mult * s * (1.0 - s))
        gl_res = g_res_logits.reshape(N, hc * hc)
        grad_mix = torch.empty_like(mix)
        grad_b = torch.zeros_like(b)
        ga = []
        for j, (gl, a, mpart) in enumerate(((gl_pre, a_pre, m_pre), (gl_post, a_post, m_post), (gl_res, a_res, m_res))):
            lo = (0, hc, 2 * hc)[j]
            aten.slice(grad_mix, 1, lo, lo + gl.size(1)).copy_(gl * a)
            aten.slice(grad_b, 0, lo, lo + gl.size(1)).copy_(gl.sum(0))
            ga.append((gl * mpart).sum())
        gx, gphi = torch.empty_like(xm), torch.zeros(K, M, dtype=torch.float32)
        launch('liger mhc_mm_norm_bwd', [xm, phi, mix, invr, grad_mix], [gx, gphi], 4 * N * K * M)
        return gx.view(shape), gphi, grad_b, *ga, None, None


def liger_mhc_coeffs(x, phi, b, alpha_pre, alpha_post, alpha_res, *, allow_fp32=False, tmax=20, rms_eps=1e-6,
                     pre_eps=0.0, sinkhorn_eps=1e-6, post_mult=2.0):
    """Stand-in of liger_kernel.transformers.functional.liger_mhc_coeffs -> (pre, post, res)."""
    return LigerCoeffs.apply(x, phi.contiguous(), b, alpha_pre, alpha_post, alpha_res, tmax, post_mult)


class LigerPre(torch.autograd.Function):
    """liger's LigerMHCPreFunction: x = sum_s h[s] H[s] in one kernel; backward one kernel."""

    @staticmethod
    def forward(ctx, x, h):
        hc, c = x.shape[-2:]
        out = x.new_empty(*x.shape[:-2], c, dtype=torch.float32)
        launch('liger mhc_pre_fwd', [x, h], [out], 2 * x.numel())
        ctx.save_for_backward(x, h)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, go):
        x, h = ctx.saved_tensors
        gx, gh = torch.empty_like(x, dtype=torch.float32), torch.zeros(h.shape, dtype=torch.float32)
        launch('liger mhc_pre_bwd', [x, h, go], [gx, gh], 4 * x.numel())
        return gx.to(x.dtype), gh


class LigerPostRes(torch.autograd.Function):
    """liger's LigerMHCPostResFunction: H' = H_res^T H + h_post f in one kernel (fp32 out);
    backward one kernel writing the gradients of H, f, h_post and H_res."""

    @staticmethod
    def forward(ctx, x, f, h_post, h_res):
        hc = x.size(-2)
        h_post, h_res = h_post.contiguous(), h_res.contiguous()
        out = torch.empty_like(x, dtype=torch.float32)
        launch('liger mhc_post_res_fwd', [x, f, h_post, h_res], [out], 2 * x.numel() * (hc + 1))
        ctx.save_for_backward(x, f, h_post, h_res)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, go):
        x, f, h_post, h_res = ctx.saved_tensors
        hc = x.size(-2)
        gx, gf = torch.empty_like(x, dtype=torch.float32), torch.empty_like(f, dtype=torch.float32)
        gpost, gres = torch.zeros(h_post.shape), torch.zeros(h_res.shape)
        launch('liger mhc_post_res_bwd', [x, f, h_post, h_res, go], [gx, gf, gpost, gres], 4 * x.numel() * (hc + 1))
        return gx.to(x.dtype), gf.to(f.dtype), gpost, gres


def liger_mhc_pre(x, h_pre):
    return LigerPre.apply(x, h_pre)


def liger_mhc_post_res(x, f_out, h_post, h_res):
    return LigerPostRes.apply(x, f_out, h_post, h_res)


# module name -> stand-in functions, put in sys.modules while a count runs
KERNELS = {
    'fla.ops.attnres': dict(fused_attnres=fla_fused_attnres),
    'liger_kernel.transformers.functional': dict(liger_mhc_coeffs=liger_mhc_coeffs, liger_mhc_pre=liger_mhc_pre,
                                                 liger_mhc_post_res=liger_mhc_post_res),
}


@contextlib.contextmanager
def kernel_stand_ins():
    """Makes `from fla.ops.attnres import fused_attnres` (and liger's functional ops) import
    the counting stand-ins; the modules that were there before are put back after."""
    import fast.attnres
    names = sorted({'.'.join(k.split('.')[:i]) for k in KERNELS for i in range(1, k.count('.') + 2)})
    before = {n: sys.modules.get(n) for n in names}
    fla_kernel = fast.attnres.fla_kernel  # pins fla's launch configs: nothing to pin in a stand-in
    try:
        for n in names:
            sys.modules[n] = types.ModuleType(n)
        for n, fns in KERNELS.items():
            vars(sys.modules[n]).update(fns)
        fast.attnres.fla_kernel = lambda: fla_fused_attnres
        yield
    finally:
        fast.attnres.fla_kernel = fla_kernel
        for n, m in before.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def cuda_paths(model, kernels=True, fla=False, liger=False):
    """The fast paths fast.select picks on CUDA: with kernels=True as if Triton, fla-core and
    liger-kernel were installed, else the torch forms (a CUDA run without them); fla=True puts
    fla-core's per-read kernel (fast.FLA_READ) in place of the grouped AttnRes read, liger=True
    Liger's mHC ops (fast.LIGER_PATHS) in place of the fused stream steps of HC and mHC: the
    published kernels they are measured against."""
    res, chosen = model.residual, {}
    if fla and isinstance(res, fast.FLA_READ.scheme):
        chosen = {'read': fast.FLA_READ, 'read_at': None, 'block': None}
    if liger and isinstance(res, fast.LIGER_PATHS[1].scheme):  # MultiStream: HC and mHC
        chosen = {p.method: p for p in fast.LIGER_PATHS if isinstance(res, p.scheme) and p.applies(model.config)}
        chosen['block'] = None
    for p in fast.FAST_PATHS:
        if isinstance(res, p.scheme) and p.method not in chosen and p.applies(model.config) \
                and (kernels or p.package is None):
            chosen[p.method] = p
    return [p for p in chosen.values() if p is not None]


# -----------------------------------------------------------------------------
# the count


def count_step(cfg, batch, seq_len, fast_paths='cuda', dtype=torch.bfloat16, cuda_forms=True):
    """One training micro-step of GPT(cfg) on (batch, seq_len) tokens under fake tensors:
    forward under `dtype` autocast (None: none), loss, backward, every parameter's gradient
    already allocated (accumulated in place, as on every micro-step after the first).
    fast_paths: 'cuda' (fast/'s Triton launches recorded), 'cuda_fla' (the same with fla-core's
    per-read AttnRes kernel in place of the grouped read), 'cuda_liger' (the same with Liger's mHC
    ops, as stand-ins, in place of HC's and mHC's fused stream steps), 'cuda_torch' (fast/'s
    torch forms) or 'off'.
    cuda_forms: F.rms_norm as CUDA's fused kernel. Returns dict(kernels, bytes, flops,
    saved (bytes), ops [(flops, bytes)], by_op {name: [kernels, bytes, flops]}, paths,
    params, model_flops (model.flops_per_token x tokens)). Raises ValueError for a bad
    fast_paths."""
    if fast_paths not in ('cuda', 'cuda_fla', 'cuda_liger', 'cuda_torch', 'off'):
        raise ValueError(f"fast_paths={fast_paths!r}: use 'cuda', 'cuda_fla', 'cuda_liger', 'cuda_torch' or 'off'")
    cfg = GPTConfig(**{**vars(cfg), 'block_size': max(cfg.block_size, seq_len)})
    with torch.device('meta'):
        model = GPT(cfg)
    paths = [] if fast_paths == 'off' else cuda_paths(model, kernels=fast_paths != 'cuda_torch',
                                                      fla=fast_paths == 'cuda_fla', liger=fast_paths == 'cuda_liger')
    counter = StepCount()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device='cpu')
        saved = SavedBytes(storage_id(t) for t in list(model.parameters()) + list(model.buffers()))
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        idx = torch.empty(batch, seq_len, dtype=torch.long)
        fast.enable(model, paths)
        autocast = torch.autocast('cpu', dtype=dtype) if dtype is not None else contextlib.nullcontext()
        forms = CudaForms() if cuda_forms else contextlib.nullcontext()
        _ACTIVE.append(counter)
        recorder = Recorder(lambda name, reads, writes, flops: counter.record(name, reads, writes, flops, dedupe=True))
        try:
            with kernel_stand_ins(), forms, counter, recorder:
                with saved, autocast:
                    _, loss = model(idx, idx)
                loss.backward()
        finally:
            _ACTIVE.pop()
    return dict(kernels=counter.kernels, bytes=counter.bytes, flops=counter.flops, saved=saved.nbytes, ops=counter.ops,
                by_op=counter.by_op, paths=[p.name for p in paths], params=model.num_params(),
                model_flops=model.flops_per_token(seq_len) * batch * seq_len)


# -----------------------------------------------------------------------------
# the time model


def step_time(ops, spec, eta_c, eta_b, launch_s):
    """Seconds of one micro-step: sum over kernels of max(flops / (peak eta_c),
    bytes / (bandwidth eta_b)) + launch_s."""
    fc, bb = spec['peak'] * eta_c, spec['bandwidth'] * eta_b
    return sum(max(f / fc, b / bb) for f, b in ops) + launch_s * len(ops)


def estimate(counts, spec, mfu=PRELN_MFU):
    """{scheme: (ms, ratio, lo, hi)} on `spec`: the micro-step in ms and its ratio to Pre-LN
    at the middle of BW_EFF x LAUNCH_S, and the ratio's range over the box's corners.
    Pre-LN takes its model FLOPs at `mfu`; a scheme takes that plus the step_time of its
    ops minus Pre-LN's (matrix products at eta_c = mfu). counts: {scheme: count_step
    result}, with 'preln'."""
    base = counts['preln']['model_flops'] / (mfu * spec['peak'])
    out = {}
    for s, c in counts.items():
        ts = []
        for eta_b, ls in [(BW_EFF[1], LAUNCH_S[1])] + [(e, l) for e in (BW_EFF[0], BW_EFF[2])
                                                          for l in (LAUNCH_S[0], LAUNCH_S[2])]:
            extra = step_time(c['ops'], spec, mfu, eta_b, ls) - step_time(counts['preln']['ops'], spec, mfu, eta_b, ls)
            ts.append(base + extra)
        out[s] = (1e3 * ts[0], ts[0] / base, min(ts) / base, max(ts) / base)
    return out


def format_table(counts, specs=SPECS):
    """The markdown table of `run`'s counts: per scheme its counts, its memory (saved
    activations, and with 16 bytes a parameter for fp32 weights, gradients and AdamW's two
    moments) and, per accelerator, `estimate`'s ms, ratio and range."""
    base = counts['preln']
    head = ['scheme', 'fast paths', 'kernels', 'HBM traffic', 'TFLOP', 'saved', '+ weights, grads, AdamW'] + \
        [f'{g} ms (× Pre-LN, range)' for g in specs]
    est = {g: estimate(counts, spec) for g, spec in specs.items()}
    lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
    for s, c in counts.items():
        extra = '' if s == 'preln' else f" ({c['kernels'] - base['kernels']:+,})"
        cells = [s, ', '.join(c['paths']) or '-', f"{c['kernels']:,}{extra}", f"{c['bytes'] / 1e12:.2f} TB",
                 f"{c['flops'] / 1e12:.1f}", f"{c['saved'] / 2 ** 30:.1f} GiB",
                 f"{(c['saved'] + 16 * c['params']) / 2 ** 30:.1f} GiB"]
        for g in specs:
            ms, r, lo, hi = est[g][s]
            cells.append(f"{ms:.0f} ({r:.2f}×, {lo:.2f}–{hi:.2f})")
        lines.append('| ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def top_ops(count, base=None, n=8):
    """The n op names with the most bytes above `base`'s (another count): (name, kernels, bytes)."""
    b = base['by_op'] if base else {}
    rows = [(k, v[0] - b.get(k, [0, 0])[0], v[1] - b.get(k, [0, 0])[1]) for k, v in count['by_op'].items()]
    return sorted(rows, key=lambda r: -r[2])[:n]


FLA = ' (fla)'  # the suffix of a row counted with fla-core's AttnRes read (fast_paths 'cuda_fla')
LIGER = ' (liger)'  # the suffix of a row counted with Liger's mHC ops (fast_paths 'cuda_liger')


def run(schemes, cfg_kw, batch, seq_len, fast_paths='cuda', log=print, compare_fla=True):
    """count_step for Pre-LN and every scheme (a progress bar over them); with fast_paths 'cuda'
    and compare_fla, each AttnRes scheme also as '<scheme> (fla)', on fla-core's per-read kernel,
    and HC and mHC as '<scheme> (liger)', on Liger's mHC ops. Returns {row: count}."""
    from tqdm import tqdm
    names = ['preln'] + [s for s in dict.fromkeys(schemes) if s != 'preln']
    rows = [(s, s, fast_paths) for s in names]
    if compare_fla and fast_paths == 'cuda':
        rows += [(s + FLA, s, 'cuda_fla') for s in names
                 if issubclass(RESIDUALS[s], fast.FLA_READ.scheme)]
        rows += [(s + LIGER, s, 'cuda_liger') for s in names
                 if issubclass(RESIDUALS[s], fast.LIGER_PATHS[1].scheme)]
    counts = {}
    bar = tqdm(rows, desc='step', unit='count', file=sys.stderr, disable=None)
    for row, s, paths in bar:
        bar.set_postfix_str(row)
        t0 = time.perf_counter()
        counts[row] = count_step(GPTConfig(**{**cfg_kw, 'residual': s}), batch, seq_len, paths)
        counts[row]['count_s'] = time.perf_counter() - t0
    return counts


def summary(counts):
    """The JSON-able part of the counts (no per-op list)."""
    return {s: {k: v for k, v in c.items() if k != 'ops'} for s, c in counts.items()}


def shape_of(config_file):
    """{n_layer, n_embd, n_head, n_kv_head, block_size, batch_size, vocab_size} from a train.py
    config file (config/*_L32.py): its literal assignments to those names, read with
    ast.literal_eval (nothing in the file runs); GPTConfig's defaults for those it lacks.
    Raises ValueError for a missing file or a non-literal value."""
    import ast
    keys = ('n_layer', 'n_embd', 'n_head', 'n_kv_head', 'block_size', 'batch_size', 'vocab_size')
    d = GPTConfig()
    shape = {k: getattr(d, k, None) for k in keys}
    shape['n_kv_head'], shape['batch_size'] = None, 16
    try:
        with open(config_file) as f:
            tree = ast.parse(f.read(), config_file)
    except OSError as e:
        raise ValueError(f"cannot read config file {config_file!r}: {e.strerror}") from None
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and getattr(node.targets[0], 'id', None) in keys:
            try:
                shape[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                raise ValueError(f"{config_file}: {node.targets[0].id} is not a literal") from None
    return shape
