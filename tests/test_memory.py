"""The training-memory plan of plan/memory.py (train_memory, step_bytes, fit_bytes, auto_micro_batch,
oom_message) and train.py's auto_batch and out-of-memory line, on the CPU. The plan is checked
against bytes measured on real training micro-steps (autograd's saved tensors, and every tensor
alive through forward and backward), in fp32 and under bf16 autocast, for every scheme, with the
fast paths off and on; and against hand counts where they exist. Its parts against measured
parts: the peak resident memory of real AdamW steps and of a real compiled step. And the plan
against the device's memory: the CPU's free memory, and the headline on a CPU under an
address-space limit, stopped in one line before its first step.
Run: python -m pytest tests/test_memory.py -q  (-m slow adds the inductor-compiled step)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plan import memory  # noqa: E402
import fast  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from residuals import RESIDUALS  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / 'tests'))
from test_train import data_dir  # noqa: E402,F401  (the tiny corpus fixture)

WITH_FAST_PATHS = ('attnres', 'blockattnres', 'hc', 'mhc', 'moda')  # the schemes fast/ has CPU forms for
AUTOCAST = {'float32': None, 'bfloat16': torch.autocast('cpu', dtype=torch.bfloat16)}


def tiny(residual, **kw):
    return GPTConfig(**{**dict(n_layer=3, n_embd=32, n_head=2, block_size=64, vocab_size=61, residual=residual,
                               mhc_sinkhorn_iters=4), **kw})


def built(cfg, fast_on):
    torch.manual_seed(0)
    model = GPT(cfg)
    paths = fast.setup(model, fast_on, 'cpu')
    assert bool(paths) == (fast_on and cfg.residual in WITH_FAST_PATHS)
    return model


def measured(model, B, T, dtype):
    """step_bytes of one micro-step at (B, T), gradients allocated (a later micro-step)."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    idx = torch.randint(0, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(1))
    return memory.step_bytes(model, idx, AUTOCAST[dtype])


def linear_weights(model):
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


CASES = [(r, d, f) for r in RESIDUALS for d in ('float32', 'bfloat16') for f in (False, True)
         if not f or r in WITH_FAST_PATHS]


@pytest.mark.parametrize('residual, dtype, fast_on', CASES)
def test_plan_matches_the_bytes_of_a_real_micro_step(residual, dtype, fast_on):
    """Probed at 2 x 3 small shapes (B 2, 3; T 8, 16, 24), the plan at 5 x 48 tokens against a
    real micro-step there: its saved bytes (weight copies + activations) and its peak (+ the
    backward's share) within 10% each. Two instruments measure the step: autograd's saved-tensor
    hooks and a dispatch mode that follows every tensor alive; they must agree after the forward."""
    cfg = tiny(residual)
    model = built(cfg, fast_on)
    mem = memory.train_memory(cfg, 5, 48, 'cpu', dtype, probe_tokens=8, model=model)
    real = measured(model, 5, 48, dtype)
    assert real['live'] == pytest.approx(real['saved'], abs=64)  # the loss scalar apart
    saved = mem['weight_copies'] + mem['activations']
    assert saved == pytest.approx(real['saved'], rel=0.10)
    assert saved + mem['backward'] == pytest.approx(real['peak'], rel=0.10)
    parts = ('params', 'grads', 'adamw', 'weight_copies', 'activations', 'backward')
    assert mem['total'] == sum(mem[k] for k in parts)


def constant_bytes(model, dtype):
    """Hand count of the saved bytes that grow with neither batch nor length: under bf16
    autocast, each Linear's weight cast once (2 bytes a weight), and Sandwich's output norms'
    gains cast to their bf16 input (2 d bytes, 2L of them); the loss's count of targets (int64, 8 bytes)
    and LM-head gradient (fp32, model.lm_head_loss), which keeps no bf16 copy of the head."""
    cfg, head = model.config, model.lm_head.weight.numel()
    n = 8 + 4 * head
    if dtype == 'bfloat16':
        n += 2 * (linear_weights(model) - head) + (2 * cfg.n_embd * 2 * cfg.n_layer if cfg.residual == 'sandwich' else 0)
    return n  # mHC's gates alpha_pre, alpha_post, alpha_res are scalars: nothing of theirs is kept


@pytest.mark.parametrize('residual', list(RESIDUALS))
def test_autocast_weight_copies_count_once(residual):
    """The plan's constant part equals the hand count (`constant_bytes`), whatever the batch
    and length: autocast's weight copies are made once per forward, not per token. Activations
    grow linearly with the batch."""
    cfg = tiny(residual)
    model = built(cfg, False)
    small = memory.train_memory(cfg, 1, 16, 'cpu', 'bfloat16', probe_tokens=8, model=model)
    large = memory.train_memory(cfg, 64, 64, 'cpu', 'bfloat16', probe_tokens=8, model=model)
    assert small['weight_copies'] == large['weight_copies'] == constant_bytes(model, 'bfloat16')
    fp32 = memory.train_memory(cfg, 64, 64, 'cpu', 'float32', probe_tokens=8, model=model)
    assert fp32['weight_copies'] == constant_bytes(model, 'float32')
    one, two = (memory.train_memory(cfg, B, 64, 'cpu', 'bfloat16', probe_tokens=8, model=model)['activations']
                for B in (1, 2))
    assert large['activations'] - one == pytest.approx(63 * (two - one), rel=1e-6)


@pytest.mark.parametrize('L, H', [(3, 2), (4, 4)])
def test_moda_plain_attention_grows_as_the_square_of_the_length(L, H):
    """MoDA's plain attention keeps, per block that reads depth slots (L - 1 of them), the fp32
    softmax over T + S columns and a contiguous copy of its T sequence columns: 2 x 4 x H bytes per
    query and key, 8 H (L - 1) bytes x T² per sequence; and a T x T bool causal mask shared by the
    batch. The fast path (SDPA with a null key) keeps no T x T tensor. fit_bytes finds both exactly."""
    for fast_on in (False, True):
        model = built(tiny('moda', n_layer=L, n_head=H), fast_on)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        points = {(B, T): memory.step_bytes(model, torch.randint(0, 61, (B, T)))['saved']
                  for B, T in memory.probe_shapes(64, 8)}
        c = memory.fit_bytes(points)
        assert c[5] == pytest.approx(0 if fast_on else 8 * H * (L - 1), abs=1e-6)  # B T²
        assert c[2] == pytest.approx(0 if fast_on else L - 1, abs=1e-6)            # T², the masks


def test_fit_bytes_recovers_each_kind_of_term():
    """A hand-made byte count with every term of the fit, and one without T² terms from two lengths."""
    def f(B, T):
        return 1000 + 7 * T + 3 * T * T + B * (11 + 13 * T + 5 * T * T)
    shapes = memory.probe_shapes(64, 8)
    assert memory.fit_bytes({s: f(*s) for s in shapes}) == pytest.approx((1000, 7, 3, 11, 13, 5), abs=1e-6)
    two = {(B, T): 1000 + B * 13 * T for B in (2, 3) for T in (8, 16)}
    assert memory.fit_bytes(two) == pytest.approx((1000, 0, 0, 0, 13, 0), abs=1e-6)


def test_the_peak_is_the_most_over_the_ops_at_the_planned_shape(monkeypatch):
    """Two ops hold the most memory at different sizes: a weight's gradient (50,000 bytes,
    whatever the batch) at the small probe shapes, the logits' gradient (100 bytes a token) at
    the planned 64 x 64. The plan fits each op's bytes and takes the most at 64 x 64: 409,600;
    fitting the probes' peaks instead would say 50,000."""
    def fake(model, idx, ctx=None):
        B, T = idx.shape
        ops = [50_000, 100 * B * T]
        return dict(saved=0, live=0, peak=max(ops), timeline=ops)
    monkeypatch.setattr(memory, 'step_bytes', fake)
    cfg = tiny('preln')
    mem = memory.train_memory(cfg, 64, 64, probe_tokens=8, model=GPT(cfg))
    assert mem['backward'] == 100 * 64 * 64 and mem['predict'](1) - mem['total'] + mem['backward'] == 50_000
    assert mem['per_sequence'] == 100 * 64


@pytest.mark.slow
@pytest.mark.parametrize('residual, dtype, fast_on', [('preln', 'bfloat16', False), ('attnres', 'bfloat16', False),
                                                      ('attnres', 'float32', True)])
def test_compiled_plan_matches_inductor(residual, dtype, fast_on):
    """With compiled=True the saved bytes come from inductor's partition (traced, no code
    generated); against a model compiled by GPT.compile_regions with inductor, within 10%; and
    the compiled model keeps less than the eager one (it recomputes cheap ops)."""
    cfg = tiny(residual)
    model = built(cfg, fast_on)
    eager = memory.train_memory(cfg, 5, 48, 'cpu', dtype, probe_tokens=8, model=model)
    comp = memory.train_memory(cfg, 5, 48, 'cpu', dtype, probe_tokens=8, model=model, compiled=True)
    model.compile_regions()
    idx = torch.randint(0, cfg.vocab_size, (5, 48))
    with AUTOCAST[dtype] or torch.autocast('cpu', enabled=False):
        model(idx, idx)[1].backward()
    real = memory.saved_activation_bytes(model, idx, idx, AUTOCAST[dtype])
    torch._dynamo.reset()
    assert comp['weight_copies'] + comp['activations'] == pytest.approx(real, rel=0.10)
    assert comp['activations'] < eager['activations']


def test_weights_grads_and_adamw_state_are_16_bytes_per_parameter():
    """params + grads + AdamW from the formula against the tensors after one real step."""
    cfg = tiny('hc')
    model = GPT(cfg)
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    model(idx, idx)[1].backward()
    opt.step()
    mem = memory.train_memory(cfg, 2, 16, model=model)
    weights = sum(p.nbytes for p in model.parameters())
    grads = sum(p.grad.nbytes for p in model.parameters())
    state = sum(t.nbytes for s in opt.state.values() for k, t in s.items() if k in ('exp_avg', 'exp_avg_sq'))
    assert (mem['params'], mem['grads'], mem['adamw']) == (weights, grads, state)
    assert all(p.grad is not None for p in model.parameters())  # the probes left the gradients as they were
    assert grads == sum(p.grad.nbytes for p in model.parameters())


def test_auto_micro_batch_takes_the_largest_divisor_that_fits():
    # 512 sequences per step, 10 GiB fixed + 3 GiB per sequence, 40 GiB: 10 fits (40), but
    # the micro-batch must divide 512, so 8 (34 GiB) with 64 accumulation steps
    gib = 2**30
    assert memory.auto_micro_batch(512, lambda b: (10 + 3 * b) * gib, 40 * gib) == (8, 64)
    assert memory.auto_micro_batch(512, lambda b: (10 + 3 * b) * gib, 80 * gib) == (16, 32)
    assert memory.auto_micro_batch(6, lambda b: b, 100) == (6, 1)
    with pytest.raises(ValueError, match='even a micro-batch of 1 sequence'):
        memory.auto_micro_batch(512, lambda b: (10 + 3 * b) * gib, 12 * gib)


def test_oom_message_names_config_micro_batch_and_fix():
    msg = memory.oom_message(tiny('attnres', n_layer=32), 16, 2048, 32, 'compiling', 'config/attnres_L32.py')
    assert msg.startswith('out of memory while compiling: config/attnres_L32.py (attnres L=32 d=32)')
    assert 'micro-batch 16 x 2048' in msg and '--auto_batch=True' in msg
    assert '--batch_size=8 --gradient_accumulation_steps=64' in msg and '\n' not in msg
    assert '--fsdp=True' in memory.oom_message(tiny('preln'), 1, 2048, 512)  # one sequence: another fix


def run_train(args, patch=''):
    """train.py in a subprocess, after the Python lines `patch` (e.g. making an op raise
    torch.OutOfMemoryError, as a CUDA allocation failure would)."""
    code = patch + f"\nimport runpy, sys; sys.argv = ['train.py'] + {list(args)!r}; runpy.run_path('train.py', run_name='__main__')"
    env = dict(os.environ, OMP_NUM_THREADS='1')
    return subprocess.run([sys.executable, '-c', code], cwd=REPO, capture_output=True, text=True, env=env, timeout=600)


TINY = ['--device=cpu', '--compile=False', '--n_layer=2', '--n_embd=32', '--n_head=2', '--block_size=32',
        '--log_interval=1', '--eval_iters=1', '--max_iters=2', '--eval_interval=2']
RAISE = "(_ for _ in ()).throw(torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB'))"
OOM_POINTS = {  # where: (patch, extra arguments, what the line says about the moment)
    'building': (f"import torch, model; model.GPT.to = lambda self, *a, **k: {RAISE}", [], None),
    'planning': (f"import torch, plan.memory; plan.memory.step_bytes = lambda *a, **k: {RAISE}",
                 ['--auto_batch=True', '--memory_gib=1.0'], None),
    'compile_regions': (f"import torch, model; model.GPT.compile_regions = lambda self, *a, **k: {RAISE}",
                        ['--compile=True'], None),
    'inside_compilation': ("import torch, torch._inductor.compile_fx as c\n"
                           f"c.compile_fx = lambda *a, **k: {RAISE}", ['--compile=True'], 'compiling'),
    'forward': (f"import torch, model; model.GPT.forward = lambda self, *a, **k: {RAISE}", [], None),
    'backward': (f"import torch; torch.Tensor.backward = lambda self, *a, **k: {RAISE}", [], None),
    'optimizer_step': (f"import torch; torch.optim.AdamW.step = lambda self, *a, **k: {RAISE}", [], None),
}


@pytest.mark.parametrize('point', list(OOM_POINTS))
def test_out_of_memory_at_any_point_is_one_line(point, data_dir, tmp_path):  # noqa: F811
    """An OutOfMemoryError raised while building, planning, compiling (also wrapped by
    torch.compile's BackendCompilerFailed), in the forward, the backward or the optimizer step:
    exactly one stderr line naming the config file, the micro-batch, the global accumulation
    steps and the fix."""
    patch, extra, where = OOM_POINTS[point]
    cfg_file = tmp_path / 'tiny.py'
    cfg_file.write_text("batch_size = 4\ngradient_accumulation_steps = 2\n")
    r = run_train([str(cfg_file)] + TINY + [f'--data_dir={data_dir}', f'--out_dir={tmp_path / "o"}'] + extra, patch)
    assert r.returncode == 1
    shape = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=32, vocab_size=257)
    assert r.stderr.strip().splitlines() == ["error: " + memory.oom_message(shape, 4, 32, 2, where, str(cfg_file))], \
        r.stderr[-3000:]


def test_auto_batch_fills_90_percent_and_keeps_the_global_batch(data_dir, tmp_path):  # noqa: F811
    """16 sequences per step asked as 16 x 1, and a budget of predict(8) / 0.95: all of it holds a
    micro-batch of 8, 90% of it only 4 (hand-worked from the plan). auto_batch gives 4 x 4
    accumulation steps, the global batch unchanged."""
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=32, vocab_size=257)
    torch.manual_seed(1337)
    mem = memory.train_memory(cfg, 16, 32, model=GPT(cfg))
    budget = mem['predict'](8) / 0.95
    assert mem['predict'](4) <= 0.9 * budget < mem['predict'](8) <= budget  # the case is what it says
    budget_gib = budget / 2**30
    r = run_train(TINY + [f'--data_dir={data_dir}', f'--out_dir={tmp_path / "o"}', '--batch_size=16',
                          '--gradient_accumulation_steps=1', '--auto_batch=True', f'--memory_gib={budget_gib!r}'])
    assert r.returncode == 0, r.stderr[-2000:]
    assert 'auto_batch: micro-batch 4, gradient_accumulation_steps 4' in r.stdout
    assert 'tokens per iteration: 4 accum x 1 procs x 4 seqs x 32 tokens = 512' in r.stdout
    assert 'predicted peak training memory' in r.stdout


def test_cost_budget_plans_like_auto_batch(tmp_path):
    """cost.py --memory --budget_gib fills AUTO_BATCH_FILL (90%) of the budget, as train.py's
    auto_batch does: a budget that fits 4 sequences only at 100% gets 2; a budget of 0 is an
    error, not silently ignored."""
    cfg = tmp_path / 'tiny.py'
    cfg.write_text("n_layer = 2\nn_embd = 32\nn_head = 2\nblock_size = 64\nvocab_size = 61\n"
                   "residual = 'attnres'\nbatch_size = 4\ngradient_accumulation_steps = 1\n")
    mem = memory.memory_main(str(cfg), compiled=False)
    budget_gib = (mem['total'] + 0.05 * mem['per_sequence']) / 2**30
    assert memory.memory_main(str(cfg), budget_gib=budget_gib, compiled=False)['auto'] == (2, 2)
    with pytest.raises(ValueError, match='budget_gib'):
        memory.memory_main(str(cfg), budget_gib=0, compiled=False)


# -----------------------------------------------------------------------------
# the plan's parts against measured parts


@pytest.mark.parametrize('residual', ['preln', 'attnres', 'mhc'])
def test_activations_leave_out_the_weight_copies(residual):
    """Under bf16 autocast at 1 x 8 tokens, where autocast's weight copies are a large share of
    what autograd keeps: `weight_copies` is the hand count, and `activations` are the measured
    saved bytes less that count, to 1%. A plan that counts the copies in both parts is off by the
    whole count (over 20% of the activations here)."""
    cfg = tiny(residual)
    model = built(cfg, False)
    mem = memory.train_memory(cfg, 1, 8, 'cpu', 'bfloat16', probe_tokens=8, model=model)
    real = measured(model, 1, 8, 'bfloat16')
    const = constant_bytes(model, 'bfloat16')
    assert const > 0.2 * (real['saved'] - const)  # the case is sharp
    assert mem['weight_copies'] == const
    assert mem['activations'] == pytest.approx(real['saved'] - const, rel=0.01)


PEAK_RSS = r"""
import json, sys, torch
from model import GPT, GPTConfig
from plan import memory
args = json.loads(sys.argv[1])


def status(key):  # bytes, from /proc/self/status
    return next(int(ln.split()[1]) * 1024 for ln in open('/proc/self/status') if ln.startswith(key + ':'))


def step(model, idx, optimizer=None, micro_steps=1):  # as train.py: micro-steps, AdamW, gradients to None
    for _ in range(micro_steps):
        model(idx, idx)[1].backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


cfg = GPTConfig(**args['cfg'])
B, T = args['shape']
warm = GPT(GPTConfig(**{**args['cfg'], 'n_layer': 1}))  # imports and first-call set-up, before counting
memory.train_memory(warm.config, 2, 8, model=warm, probe_tokens=8)  # and the probes' own
step(warm, torch.randint(0, cfg.vocab_size, (2, 8)), warm.configure_optimizers(0.1, 1e-3, (0.9, 0.95)))
del warm
torch.manual_seed(0)
idx = torch.randint(0, cfg.vocab_size, (B, T))
before = status('VmRSS')
model = GPT(cfg)
compiled = args['backend'] != 'eager'
plan = memory.train_memory(cfg, B, T, model=model, probe_tokens=8, compiled=compiled)
eager = memory.train_memory(cfg, B, T, model=model, probe_tokens=8) if compiled else plan
out = {k: v for k, v in plan.items() if k != 'predict'}
out['eager_total'] = eager['total']
if not compiled:  # two optimizer steps of two micro-steps from the weights alone: all the run allocates
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    open('/proc/self/clear_refs', 'w').write('5')  # the peak RSS starts again from now
    for _ in range(2):
        step(model, idx, optimizer, micro_steps=2)
    out['measured_total'] = status('VmHWM') - before
else:  # a later micro-step of the compiled model, gradients allocated: above the weights and gradients
    model.compile_regions(backend=args['backend'])
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with torch._dynamo.config.patch(assume_static_by_default=False):
        for _ in range(2):  # compiles
            step(model, idx)
        base = status('VmRSS')
        open('/proc/self/clear_refs', 'w').write('5')
        step(model, idx)
    out['measured_step'] = status('VmHWM') - base
print(json.dumps(out))
"""


def peak_rss(backend, shape, **cfg):
    """PEAK_RSS in a fresh process: the plan and the peak resident memory of real steps. glibc
    is told to map every block of 64 KiB or more on its own (MALLOC_MMAP_THRESHOLD_), so a freed
    tensor leaves the resident set at once and the peak RSS follows the bytes alive."""
    if not os.path.exists('/proc/self/clear_refs'):
        pytest.skip('needs Linux /proc (peak RSS reset)')
    env = dict(os.environ, OMP_NUM_THREADS='1', MALLOC_MMAP_THRESHOLD_='65536')
    arg = json.dumps(dict(cfg=cfg, shape=shape, backend=backend))
    r = subprocess.run([sys.executable, '-c', PEAK_RSS, arg], cwd=REPO, capture_output=True, text=True, env=env,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_total_matches_the_peak_of_real_steps_with_adamw():
    """The plan's total (weights, gradients, AdamW's two moments, activations, backward) against
    the peak resident memory of two optimizer steps of two micro-steps each from the freshly built
    model, to 10%. The model is mostly weights (vocab 8192, d 64, 1 x 32 tokens): a plan that
    counted the weights or the gradients twice would be 20% over, AdamW's state twice 40%."""
    got = peak_rss('eager', (1, 32), n_layer=2, n_embd=64, n_head=2, block_size=64, vocab_size=8192,
                   residual='attnres')
    assert got['params'] + got['grads'] + got['adamw'] > 0.5 * got['total']  # the case is sharp
    assert got['total'] == pytest.approx(got['measured_total'], rel=0.10), got


@pytest.mark.parametrize('backend', [memory.PARTITION_BACKEND, pytest.param('inductor', marks=pytest.mark.slow)])
def test_compiled_plan_matches_the_peak_of_a_compiled_step(backend):
    """The compiled plan (saved bytes from inductor's partition, the backward's share from the
    eager model) against the peak resident memory of a micro-step of the model compiled by
    GPT.compile_regions, to 5% (measured: 0.3%); the eager plan is more than 10% over it (14%), so
    the test tells the two apart. PARTITION_BACKEND runs the partitioned graphs (seconds to compile); inductor generates
    and compiles C++ (minutes on 2 cores: slow)."""
    got = peak_rss(backend, (8, 128), n_layer=2, n_embd=64, n_head=2, block_size=128, vocab_size=4096,
                   residual='attnres')
    planned = got['weight_copies'] + got['activations'] + got['backward']
    eager = got['eager_total'] - got['params'] - got['grads'] - got['adamw']
    assert planned == pytest.approx(got['measured_step'], rel=0.05), got
    assert eager > 1.10 * got['measured_step'], got


def test_probe_shapes_at_short_block_sizes():
    """Hand-worked: three lengths t, 2t, 3t with t = min(probe tokens, block_size // 3), none past
    block_size, at batch 2 and 3; fewer lengths only below block_size 3."""
    assert memory.probe_shapes(64, 32) == [(2, 21), (2, 42), (2, 63), (3, 21), (3, 42), (3, 63)]
    assert memory.probe_shapes(64, 64) == [(2, 21), (2, 42), (2, 63), (3, 21), (3, 42), (3, 63)]
    assert memory.probe_shapes(32, 32) == [(2, 10), (2, 20), (2, 30), (3, 10), (3, 20), (3, 30)]
    assert memory.probe_shapes(3, 32) == [(2, 1), (2, 2), (2, 3), (3, 1), (3, 2), (3, 3)]
    assert memory.probe_shapes(2, 32) == [(2, 1), (2, 2), (3, 1), (3, 2)]
    assert memory.probe_shapes(1, 64) == [(2, 1), (3, 1)]
    assert memory.probe_shapes(2048, 32) == [(2, 32), (2, 64), (2, 96), (3, 32), (3, 64), (3, 96)]


@pytest.mark.parametrize('block_size', [32, 64])
def test_plan_at_a_short_block_size_matches_a_real_micro_step(block_size):
    """Plain MoDA (its T x T score matrix adds a T² term) at block_size 32 and 64 with the CPU's
    default probe tokens: the probes stay within block_size, and the plan at block_size - 5
    tokens, 4 sequences, matches a real micro-step there: saved bytes to 1%, peak to 10%."""
    cfg = tiny('moda', block_size=block_size)
    model = built(cfg, False)
    T = block_size - 5
    mem = memory.train_memory(cfg, 4, T, 'cpu', model=model)
    real = measured(model, 4, T, 'float32')
    assert mem['weight_copies'] + mem['activations'] == pytest.approx(real['saved'], rel=0.01)
    assert mem['weight_copies'] + mem['activations'] + mem['backward'] == pytest.approx(real['peak'], rel=0.10)


# -----------------------------------------------------------------------------
# the plan against the device's memory


def fake_plan(fixed_gib, per_sequence_gib, batch):
    gib = 2**30
    predict = lambda b: round((fixed_gib + per_sequence_gib * b) * gib)  # noqa: E731
    return dict(total=predict(batch), predict=predict)


def test_fit_message_names_planned_and_available_bytes_and_the_fix():
    """Hand-worked: 10 GiB fixed + 3 GiB a sequence, micro-batch 16 x 4 steps per process on 2
    processes (128 sequences in all), 40 GiB: 58 GiB planned. At 90% (36 GiB) the largest
    micro-batch dividing 64 that fits is 8 (34 GiB), 8 steps per process, 16 on the command line."""
    gib = 2**30
    mem = fake_plan(10, 3, 16)
    msg = memory.fit_message(mem, 16, 2048, 4, 40 * gib, 'MemAvailable', 0.9, processes=2)
    assert '\n' not in msg and 'micro-batch 16 x 2048' in msg
    assert f'{58 * gib:,} bytes' in msg and f'{40 * gib:,} bytes' in msg and '90% of' in msg
    assert '--auto_batch=True' in msg and '--batch_size=8 --gradient_accumulation_steps=16' in msg
    # the edge: a plan a byte under 90% fits, a byte over does not; on CUDA (fill 1) all of it
    assert memory.fit_message(dict(mem, total=36 * gib - 1), 16, 2048, 4, 40 * gib, 'x', 0.9) is None
    assert memory.fit_message(dict(mem, total=36 * gib + 1), 16, 2048, 4, 40 * gib, 'x', 0.9) is not None
    assert memory.fit_message(dict(mem, total=40 * gib), 16, 2048, 4, 40 * gib, 'x', 1.0) is None
    tight = memory.fit_message(fake_plan(10, 30, 16), 16, 2048, 4, 40 * gib, 'x', 0.9)
    assert 'even a micro-batch of 1 sequence does not fit' in tight


def test_cgroup_free_memory_v1_and_v2(tmp_path):
    """Hand-made cgroup trees: v2, a 8 GiB limit with 5 GiB used of which 1 GiB inactive file
    pages (reclaimable): 4 GiB free; a parent's lower limit wins. v1 likewise; 'max' or a v1
    'unlimited' (2^63 - 4096) is no limit."""
    gib = 2**30
    v2 = tmp_path / 'v2'
    (v2 / 'job' / 'step').mkdir(parents=True)
    for d, limit, used, inactive in ((v2 / 'job', 'max', 9 * gib, 0), (v2 / 'job' / 'step', 8 * gib, 5 * gib, gib)):
        (d / 'memory.max').write_text(f"{limit}\n")
        (d / 'memory.current').write_text(f"{used}\n")
        (d / 'memory.stat').write_text(f"anon 123\ninactive_file {inactive}\n")
    (tmp_path / 'cg2').write_text("0::/job/step\n")
    assert memory._cgroup_free(str(v2), str(tmp_path / 'cg2')) == (4 * gib, str(v2 / 'job' / 'step' / 'memory.max'))
    (v2 / 'job' / 'memory.max').write_text(f"{10 * gib}\n")  # the parent: 10 - 9 = 1 GiB free
    assert memory._cgroup_free(str(v2), str(tmp_path / 'cg2'))[0] == gib
    v1 = tmp_path / 'v1'
    (v1 / 'memory' / 'docker').mkdir(parents=True)
    (v1 / 'memory' / 'memory.limit_in_bytes').write_text("9223372036854771712\n")
    (v1 / 'memory' / 'memory.usage_in_bytes').write_text(f"{50 * gib}\n")
    (v1 / 'memory' / 'docker' / 'memory.limit_in_bytes').write_text(f"{6 * gib}\n")
    (v1 / 'memory' / 'docker' / 'memory.usage_in_bytes').write_text(f"{3 * gib}\n")
    (v1 / 'memory' / 'docker' / 'memory.stat').write_text(f"inactive_file 7\ntotal_inactive_file {gib}\n")
    (tmp_path / 'cg1').write_text("5:cpu,cpuacct:/docker\n4:memory:/docker\n0::/\n")
    assert memory._cgroup_free(str(v1), str(tmp_path / 'cg1'))[0] == 4 * gib
    (tmp_path / 'cg0').write_text("4:memory:/\n")
    assert memory._cgroup_free(str(v1), str(tmp_path / 'cg0')) == (None, None)


def test_cpu_memory_adds_the_weights_held_and_shares_among_local_processes(monkeypatch):
    """device_memory('cpu') = free bytes / LOCAL_WORLD_SIZE + the bytes the model's weights and
    buffers already hold (the plan counts them; the free memory no longer does)."""
    model = GPT(tiny('preln'))
    held = sum(t.nbytes for t in list(model.parameters()) + list(model.buffers()))
    monkeypatch.setattr(memory, 'cpu_free_bytes', lambda: (6000, 'MemAvailable'))
    assert memory.device_memory('cpu', model) == (6000 + held, 'MemAvailable')
    monkeypatch.setenv('LOCAL_WORLD_SIZE', '3')
    assert memory.device_memory('cpu', model) == (2000 + held, 'MemAvailable, shared by 3 processes')


LINUX = pytest.mark.skipif(not sys.platform.startswith('linux'), reason='RLIMIT_AS and /proc: Linux')
HEADLINE = ['config/attnres_L32.py', '--device=cpu', '--n_layer=2', '--n_embd=64', '--n_head=2',
            '--vocab_size=50280']  # the headline at a tiny width, the GPT-2 vocabulary of the shipped data
AS_LIMIT = 4 * 10**9  # bytes of address space: a few GB where the headline's micro-batch plans 20 GB


@pytest.fixture(scope='module')
def headline_data(tmp_path_factory):
    """Random byte tokens, enough for one batch of 16 x 2049 in each split."""
    d = tmp_path_factory.mktemp('headline_data')
    rng = np.random.default_rng(0)
    for split in ('train', 'val'):
        rng.integers(0, 256, size=40_000, dtype=np.uint16).tofile(d / f'{split}.bin')
    (d / 'meta.json').write_text(json.dumps({'vocab_size': 257, 'tokenizer': 'byte'}))
    return d


def train_limited(args, limit=AS_LIMIT):
    """train.py in a subprocess whose address space is capped at `limit` bytes (RLIMIT_AS, as
    `ulimit -v` or `prlimit --as`): an allocation past it fails at once instead of growing into
    the machine's memory, so an unplanned run cannot reach the OOM killer here."""
    import resource

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    env = dict(os.environ, OMP_NUM_THREADS='1')
    return subprocess.run([sys.executable, 'train.py'] + args, cwd=REPO, capture_output=True, text=True, env=env,
                          timeout=600, preexec_fn=cap)


@LINUX
def test_headline_on_a_cpu_stops_in_one_line_before_its_first_step(headline_data, tmp_path):
    """The headline config on a CPU at its micro-batch 16 x 2048, 4 GB of address space: one line
    naming the planned and available bytes and the fix, before any evaluation or step; the
    micro-batch it names fits what was available."""
    r = train_limited(HEADLINE + [f'--data_dir={headline_data}', f'--out_dir={tmp_path / "o"}'])
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    [line] = r.stderr.strip().splitlines()
    assert line.startswith('error: the run does not fit in memory: its plan needs ') and 'RLIMIT_AS' in line, line
    assert 'micro-batch 16 x 2048 tokens' in line and '--auto_batch=True' in line and '--batch_size=' in line
    planned, available = (int(line.split(' bytes)')[k].rsplit('(', 1)[1].replace(',', '')) for k in (0, 1))
    assert planned > 0.9 * available and available < AS_LIMIT
    assert r.stdout.strip().splitlines()[-1].startswith('predicted peak training memory')  # nothing ran after it
    assert not (tmp_path / 'o' / 'ckpt.pt').exists()


@LINUX
def test_auto_batch_on_a_cpu_fits_the_free_memory(headline_data, tmp_path):
    """--auto_batch=True on a CPU, no --memory_gib: the headline at 16 x 256 tokens under 3 GB of
    address space picks a smaller micro-batch from the memory the CPU has, keeps the global batch,
    and its step runs inside the limit."""
    r = train_limited(HEADLINE + [f'--data_dir={headline_data}', f'--out_dir={tmp_path / "o"}', '--block_size=256',
                                  '--batch_size=16', '--gradient_accumulation_steps=1', '--auto_batch=True',
                                  '--max_iters=1', '--eval_iters=1', '--eval_interval=1'], limit=3 * 10**9)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert 'RLIMIT_AS' in r.stdout
    [plan] = [ln for ln in r.stdout.splitlines() if ln.startswith('auto_batch: ')]
    micro, accum = (int(w.strip(',')) for w in plan.split()[2::2])
    assert micro < 16 and micro * accum == 16, plan


# -----------------------------------------------------------------------------
# a plan that fits in memory: deep models probed through three shallow copies


@pytest.mark.parametrize('residual, kw, within, on', [('preln', {}, 1e-9, False), ('hc', {}, 1e-9, False),
                                                      ('attnres', {}, 0.05, False),
                                                      ('blockattnres', {'attnres_blocks': 4}, 1e-9, False),
                                                      ('moda', {}, 0.10, False), ('moda', {}, 0.05, True)],
                         ids=['preln', 'hc', 'attnres', 'blockattnres', 'moda', 'moda-depth-cache'])
def test_a_deep_model_planned_from_three_shallow_copies_matches_its_own_probe(residual, kw, within, on):
    """L = 16 planned at depths L0, 2 L0, 3 L0 (the smallest at which the scheme is itself: Block
    AttnRes in 4 blocks needs 2L a multiple of 4, L0 = 4; MoDA's one block has no depth, L0 = 2)
    and extrapolated in depth: the total and the prediction at another micro-batch equal the whole
    model's probe (exactly where the bytes grow with depth as a polynomial of degree 2; AttnRes's
    within 5%, MoDA's plain blocks within 10% and MoDA's depth cache, which GPU runs use, within 5%:
    docs/gpu.md)."""
    cfg = GPTConfig(n_layer=16, n_embd=64, n_head=4, block_size=96, vocab_size=300, residual=residual, **kw)
    depths = memory.probe_depths(cfg)
    assert depths == {'blockattnres': (4, 8, 12), 'moda': (2, 4, 6)}.get(residual, (1, 2, 3))
    torch.manual_seed(0)
    model = GPT(cfg)
    paths = fast.setup(model, on, 'cpu')
    whole = memory.train_memory(cfg, 4, 96, model=model)
    shallow = memory.train_memory_by_depth(cfg, 4, 96, depths=depths, fast=paths or None)
    assert shallow['params'] == whole['params'] and shallow['adamw'] == whole['adamw']
    for B in (4, 9):
        assert shallow['predict'](B) == pytest.approx(whole['predict'](B), rel=within), B
    assert shallow['total'] == pytest.approx(whole['total'], rel=within)


def test_probe_depths_need_three_below_the_model():
    cfg = GPTConfig(n_layer=3, n_embd=32, n_head=2, block_size=32, vocab_size=300)
    assert memory.probe_depths(cfg) is None  # 3 x 1 is the model itself: probe it
    assert memory.probe_depths(GPTConfig(**{**cfg.__dict__, 'n_layer': 4})) == (1, 2, 3)
    block = GPTConfig(n_layer=12, n_embd=32, n_head=2, block_size=32, vocab_size=300, residual='blockattnres',
                      attnres_blocks=4)
    assert memory.probe_depths(block) is None  # 4, 8, 12: the last is the model's own depth


def test_the_static_bytes_are_held_before_the_model_is_built(data_dir, tmp_path):  # noqa: F811
    """16 bytes per parameter more than 90% of --memory_gib: one line before the model is built
    (no 'model:' line, no probe)."""
    from test_train import TINY, one_line_error, train
    r = train(*TINY, f'--data_dir={data_dir}', f'--out_dir={tmp_path / "o"}', '--memory_gib=0.0005', check=False)
    one_line_error(r, 'its 43,232 parameters alone need', '16 bytes each', '--memory_gib=0.0005')
    assert 'predicted peak' not in r.stdout and 'model:' not in r.stdout
    r = train(*TINY, f'--data_dir={data_dir}', f'--out_dir={tmp_path / "p"}', '--memory_gib=0.001', '--max_iters=1',
              check=False)  # 0.69 MB of static bytes in 0.9 x 1.05 MB: past the hold, then the plan decides
    assert 'alone need' not in r.stderr and 'predicted peak' in r.stdout


@LINUX
@pytest.mark.slow
def test_the_full_width_headline_under_8_gib_stops_in_one_line(tmp_path):
    """`python train.py config/attnres_L32.py` at its own width (399M parameters) on a CPU under an
    8 GiB address-space limit: its plan probes three shallow copies, not the 32-block model (whose
    probe alone took 10.8 GiB), and the run stops in one line before its first step."""
    d = tmp_path / 'data'
    d.mkdir()
    rng = np.random.default_rng(0)
    for split in ('train', 'val'):
        rng.integers(0, 256, size=40_000, dtype=np.uint16).tofile(d / f'{split}.bin')
    (d / 'meta.json').write_text(json.dumps({'vocab_size': 257, 'tokenizer': 'byte'}))
    r = train_limited(['config/attnres_L32.py', '--device=cpu', '--vocab_size=50280', f'--data_dir={d}',
                       f'--out_dir={tmp_path / "o"}'], limit=8 * 2**30)
    assert r.returncode == 1 and 'Traceback' not in r.stderr, r.stderr[-3000:]
    [line] = r.stderr.strip().splitlines()
    assert line.startswith('error: the run does not fit in memory') and 'RLIMIT_AS' in line, line
    assert 'at depths 1, 2, 3, extrapolated' in r.stdout
