"""perf/step.py, the micro-step counted under fake tensors: its counts on hand-countable ops,
its FLOPs against cost.py's formulas, its time model on a hand-made count."""

import pytest
import torch

import bench
import cost
from model import GPT, GPTConfig
from perf import step


def counted(fn, *args):
    with step.StepCount() as c:
        fn(*args)
    return c


def test_matmul_is_one_kernel_of_2mnk_flops_and_its_operands_bytes():
    m, k, n = 6, 5, 3
    a, b = torch.randn(m, k), torch.randn(k, n)
    c = counted(torch.mm, a, b)
    assert (c.kernels, c.flops, c.bytes) == (1, 2 * m * n * k, (m * k + k * n + m * n) * 4)
    c = counted(torch.mm, a.bfloat16(), b.bfloat16())
    assert c.bytes == (m * k + k * n + m * n) * 2


def test_elementwise_add_reads_both_and_writes_one():
    x, y = torch.randn(4, 7), torch.randn(4, 7)
    c = counted(torch.add, x, y)
    assert (c.kernels, c.flops, c.bytes) == (1, 0, 3 * 28 * 4)
    c = counted(torch.add, x, torch.randn(7))            # a broadcast row is read once
    assert c.bytes == (28 + 7 + 28) * 4
    c = counted(torch.mul, x, x)                         # one tensor passed twice is read once
    assert c.bytes == 2 * 28 * 4
    c = counted(lambda t: t.add_(1.0), x)                # in place: read and write self
    assert (c.kernels, c.bytes) == (1, 2 * 28 * 4)


def test_views_launch_nothing():
    x = torch.randn(4, 6)
    c = counted(lambda t: (t.view(24), t.t(), t[1:], t[:, 2], t.transpose(0, 1), t.unsqueeze(0).expand(3, 4, 6),
                           t.reshape(2, 12), t.split(2), t.detach(), torch.empty(5), torch.empty_like(t)), x)
    assert (c.kernels, c.bytes, c.flops) == (0, 0, 0)
    c = counted(lambda t: t.t().contiguous(), x)          # a copy is a kernel
    assert (c.kernels, c.bytes) == (1, 2 * 24 * 4)


def test_saved_bytes_of_a_known_graph():
    a = torch.randn(8, 16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(16, 4))
    saved = step.SavedBytes([step.storage_id(w)])
    with saved:
        h = a @ w                     # saves a (and w: excluded)
        s = h.exp()                   # saves its result
        z = (s * s.view(4, 8).view(8, 4)).sum()  # saves s and a view of it: one storage
    assert saved.nbytes == (8 * 16 + 8 * 4) * 4
    z.backward()


def tiny(residual, **kw):
    return GPTConfig(n_layer=2, n_embd=32, n_head=2, vocab_size=64, block_size=16, residual=residual, **kw)


def test_gpt_step_flops_equal_cost_formula():
    """Forward + backward of the matrix products: 3x cost.forward_flops (full attention, LM head
    on every position) for the projections, MLP and head; 1 + 2.5 for the attention
    (flash attention's backward recomputes the scores)."""
    B, T = 3, 16
    cfg = tiny('preln')
    c = step.count_step(cfg, B, T, fast_paths='off', dtype=None)
    fwd = cost.forward_flops(cfg.n_layer, cfg.n_embd, T, n_head=cfg.n_head, vocab_size=cfg.vocab_size,
                             attention='full', logits='all')
    attn = cfg.n_layer * 4 * T * T * cfg.n_embd
    assert c['flops'] == B * (3 * (fwd - attn) + 3.5 * attn)
    assert c['model_flops'] == GPT(cfg).flops_per_token(T) * B * T


@pytest.mark.parametrize('scheme', ['attnres', 'blockattnres', 'mhc'])
def test_kernel_stand_in_flops_equal_cost_extra_flops(scheme):
    """The grouped AttnRes read's launches and Liger's mHC ops, as counted on CUDA, do 3x cost.py's
    extra forward FLOPs (fla's per-read kernel too)."""
    B, T = 2, 16
    cfg = tiny(scheme, attnres_blocks=2)
    c = step.count_step(cfg, B, T, fast_paths='cuda_liger' if scheme == 'mhc' else 'cuda')
    base = step.count_step(tiny('preln'), B, T, fast_paths='cuda')
    extra = cost.extra_flops(scheme, cfg.n_layer, cfg.n_embd, T, n_head=cfg.n_head, attnres_blocks=2,
                             appendix_d=False)
    assert c['flops'] - base['flops'] == 3 * B * extra
    assert c['paths'] == {'attnres': ['attnres_group_triton'],
                          'blockattnres': ['blockattnres_group_triton', 'blockattnres_sum_triton'],
                          'mhc': ['mhc_coeffs_liger', 'streams_read_liger', 'streams_write_liger']}[scheme]
    if scheme != 'mhc':
        fla = step.count_step(cfg, B, T, fast_paths='cuda_fla')
        assert fla['flops'] - base['flops'] == 3 * B * extra and fla['paths'] == ['attnres_read_fla']


@pytest.mark.parametrize('scheme', ['hc', 'mhc'])
def test_the_fused_kernels_declare_the_work_they_do(scheme):
    """HC's and mHC's stream steps, as counted on CUDA: at least 3x cost.py's extra forward FLOPs
    (forward and backward of the same matrix work) and at most 4.5x (what they recompute instead of
    keeping: the writes of the streams); every launch of fast/'s kernels declares its FLOPs."""
    B, T = 2, 16
    cfg = tiny(scheme)
    c = step.count_step(cfg, B, T, fast_paths='cuda')
    base = step.count_step(tiny('preln'), B, T, fast_paths='cuda')
    extra = cost.extra_flops(scheme, cfg.n_layer, cfg.n_embd, T, n_head=cfg.n_head, appendix_d=False)
    assert c['paths'] == [f'{scheme}_streams_triton']
    assert 3 * B * extra <= c['flops'] - base['flops'] <= 4.5 * B * extra
    kernels = {k: v for k, v in c['by_op'].items() if k.startswith('stream_kernels.')}
    assert kernels and all(v[2] > 0 for v in kernels.values()), kernels


def test_fla_stand_in_moves_the_bytes_of_its_kernels():
    """One fla read over n sources (N, D) bf16: forward reads them once and writes o and the
    fp32 statistics; backward (checkpoint_level=1) reads them twice, writes each gradient."""
    n, N, D = 3, 10, 8
    srcs = [torch.randn(N, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(n)]
    q, g = torch.randn(D, requires_grad=True), torch.randn(D, requires_grad=True)
    c = step.StepCount()
    step._ACTIVE.append(c)
    try:
        o, p = step.fla_fused_attnres(q, srcs, g, return_weights=True)
        fwd = c.by_op['fla attnres_fwd']
        assert fwd[:2] == [1, n * N * D * 2 + 2 * D * 4 + N * D * 2 + (2 * n * N + N) * 4]
        o.float().sum().backward()
        bwd = c.by_op['fla attnres_bwd_dv']
        assert bwd[1] == N * D * 2 + 2 * D * 4 + (2 * n * N + N) * 4 + 2 * n * N * D * 2 + n * N * D * 2 + N * D * 4
    finally:
        step._ACTIVE.pop()


def test_time_model_on_a_hand_made_count():
    spec = dict(peak=1e15, bandwidth=1e12)
    preln = dict(model_flops=0.5 * 1e15 * 0.1, ops=[(1e12, 1e9)])        # Pre-LN: 0.1 s at 50% MFU
    extra_bytes = 1e10
    scheme = dict(ops=preln['ops'] + [(0, extra_bytes)] * 2)             # two memory-bound kernels more
    est = step.estimate({'preln': preln, 'hc': scheme}, spec, mfu=0.5)
    ms, ratio, lo, hi = est['hc']
    mid = 0.1 + 2 * (extra_bytes / (1e12 * step.BW_EFF[1]) + step.LAUNCH_S[1])
    assert ms == pytest.approx(1e3 * mid) and ratio == pytest.approx(mid / 0.1)
    assert lo == pytest.approx((0.1 + 2 * (extra_bytes / (1e12 * step.BW_EFF[2]) + step.LAUNCH_S[0])) / 0.1)
    assert hi == pytest.approx((0.1 + 2 * (extra_bytes / (1e12 * step.BW_EFF[0]) + step.LAUNCH_S[2])) / 0.1)
    assert est['preln'][1:] == (1.0, 1.0, 1.0)


def test_bench_step_suite_runs_and_rejects_bad_settings(capsys):
    argv = ['--suite=step', '--step_config=', '--n_layer=2', '--n_embd=32', '--n_head=2', '--block_size=16',
            '--batch_size=2', '--vocab_size=64', '--step_schemes=attnres,hc', '--out=']
    counts = bench.main(argv)
    assert list(counts) == ['preln', 'attnres', 'hc', 'attnres (fla)', 'hc (liger)']
    assert counts['hc']['paths'] == ['hc_streams_triton']
    assert counts['attnres (fla)']['paths'] == ['attnres_read_fla']
    assert counts['hc (liger)']['paths'] == ['streams_read_liger', 'streams_write_liger']
    out = capsys.readouterr().out
    assert 'estimated, CPU fake-tensor count, no GPU measured' in out and '| attnres |' in out
    assert "attnres: the grouped read's step" in out and "on fla-core's per-read kernel, H200, estimated" in out
    assert "hc: the fused stream steps' step" in out and "on Liger's mHC ops, H200, estimated" in out
    with pytest.raises(SystemExit, match="step_fast='gpu'"):
        bench.main(argv + ['--step_fast=gpu'])
    with pytest.raises(SystemExit, match='unknown scheme'):
        bench.main(argv + ['--step_schemes=nope'])


# -----------------------------------------------------------------------------
# hand-countable counts at the places a wrong count would hide

def test_an_expanded_stride_0_input_is_read_once_per_distinct_element():
    """x (4, 7) + y (7,).expand(4, 7): y's broadcast dim has stride 0 and is read once, 7 floats,
    not 28 (a count of the broadcast dim at full size)."""
    x, y = torch.randn(4, 7), torch.randn(7)
    expanded = y.expand(4, 7)
    assert expanded.stride() == (0, 1) and step.tensor_bytes(expanded) == 7 * 4
    c = counted(torch.add, x, expanded)
    assert (c.kernels, c.bytes) == (1, (28 + 7 + 28) * 4)
    assert step.tensor_bytes(torch.randn(3, 1).expand(3, 5)) == 3 * 4  # the other dim broadcast


def test_an_embedding_lookup_reads_the_rows_it_returns_not_the_table():
    """F.embedding of 6 ids in a (1000, 8) table: reads 6 int64 ids and 6 rows of 8 floats and
    writes 6 x 8 floats; the table's 32,000 bytes are never all read."""
    table, ids = torch.randn(1000, 8), torch.tensor([[1, 5, 9], [0, 0, 999]])
    c = counted(torch.nn.functional.embedding, ids, table)
    assert (c.kernels, c.bytes, c.flops) == (1, 6 * 8 + 2 * 6 * 8 * 4, 0)


def test_an_op_takes_the_longer_of_its_compute_and_its_memory_time():
    """Roofline: a kernel of 2 ms of FLOPs and 1 ms of bytes takes 2 ms (+ its launch), not 3:
    max, not sum; and 1 ms of FLOPs with 4 ms of bytes takes 4."""
    spec = dict(peak=1e12, bandwidth=1e9)
    t = step.step_time([(2e9, 1e6)], spec, eta_c=1.0, eta_b=1.0, launch_s=0.0)
    assert t == pytest.approx(2e-3)
    assert step.step_time([(1e9, 4e6)], spec, 1.0, 1.0, 1e-6) == pytest.approx(4e-3 + 1e-6)
    assert step.step_time([(2e9, 1e6), (1e9, 4e6)], spec, 0.5, 0.5, 0.0) == pytest.approx(4e-3 + 8e-3)


def test_each_accelerator_row_is_its_datasheet():
    """Dense bf16 peak (the datasheets' sparse figure halved), HBM bandwidth, memory: NVIDIA's
    H100 SXM5 80 GB (1,979 TFLOPS sparse, 3.35 TB/s), H200 SXM 141 GB (1,979 sparse, 4.8 TB/s),
    A100 SXM 80 GB (624 sparse, 2,039 GB/s); and the peak agrees with model.py's MFU table."""
    import model
    sheets = {'H100': (1979e12 / 2, 3.35e12, 80e9), 'H200': (1979e12 / 2, 4.8e12, 141e9),
              'A100': (624e12 / 2, 2.039e12, 80e9)}
    assert set(step.SPECS) == set(sheets)
    for name, (peak, bandwidth, memory) in sheets.items():
        spec = step.SPECS[name]
        assert (spec['peak'], spec['bandwidth'], spec['memory']) == pytest.approx((peak, bandwidth, memory), rel=1e-3)
        assert dict(model.PEAK_FLOPS)[name] == pytest.approx(spec['peak'], rel=1e-3)


def test_the_per_op_table_adds_up_to_the_step_and_names_aten_ops():
    """count_step's by_op (kernels, bytes, FLOPs per op name, the table docs/performance.md
    prints) sums to its totals, its ops list holds one (FLOPs, bytes) per kernel, and the names
    are aten's without the prefix ('mm', 'bmm' or 'addmm' for the matrix products)."""
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64)
    c = step.count_step(cfg, 2, 16, fast_paths='off', dtype=None)
    rows = c['by_op'].values()
    assert c['kernels'] > 0 and sum(k for k, _, _ in rows) == c['kernels'] == len(c['ops'])
    assert sum(b for _, b, _ in rows) == c['bytes'] == sum(b for _, b in c['ops'])
    assert sum(f for _, _, f in rows) == c['flops'] == sum(f for f, _ in c['ops']) > 0
    assert not any(name.startswith('aten.') for name in c['by_op']) and {'mm', 'addmm', 'bmm'} & set(c['by_op'])
