"""The training-memory plan of cost.py (train_memory, step_bytes, fit_bytes, auto_micro_batch,
oom_message) and train.py's auto_batch and out-of-memory line, on the CPU. The plan is checked
against bytes measured on real training micro-steps (autograd's saved tensors, and every tensor
alive through forward and backward), in fp32 and under bf16 autocast, for every scheme, with the
fast paths off and on; and against hand counts where they exist.
Run: python -m pytest tests/test_memory.py -q"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cost  # noqa: E402
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
    return cost.step_bytes(model, idx, AUTOCAST[dtype])


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
    mem = cost.train_memory(cfg, 5, 48, 'cpu', dtype, probe_tokens=8, model=model)
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
    gains cast to their bf16 input (2 d bytes, 2L of them); mHC's gate vector [a_pre x m, a_post x m,
    a_res x m²] per sublayer (fp32, any dtype); the loss's count of targets (int64, 8 bytes)
    and LM-head gradient (fp32, model.lm_head_loss), which keeps no bf16 copy of the head."""
    cfg, head = model.config, model.lm_head.weight.numel()
    n = 8 + 4 * head
    if dtype == 'bfloat16':
        n += 2 * (linear_weights(model) - head) + (2 * cfg.n_embd * 2 * cfg.n_layer if cfg.residual == 'sandwich' else 0)
    if cfg.residual == 'mhc':
        m = cfg.hc_streams
        n += 4 * (m * m + 2 * m) * 2 * cfg.n_layer
    return n


@pytest.mark.parametrize('residual', list(RESIDUALS))
def test_autocast_weight_copies_count_once(residual):
    """The plan's constant part equals the hand count (`constant_bytes`), whatever the batch
    and length: autocast's weight copies are made once per forward, not per token. Activations
    grow linearly with the batch."""
    cfg = tiny(residual)
    model = built(cfg, False)
    small = cost.train_memory(cfg, 1, 16, 'cpu', 'bfloat16', probe_tokens=8, model=model)
    large = cost.train_memory(cfg, 64, 64, 'cpu', 'bfloat16', probe_tokens=8, model=model)
    assert small['weight_copies'] == large['weight_copies'] == constant_bytes(model, 'bfloat16')
    fp32 = cost.train_memory(cfg, 64, 64, 'cpu', 'float32', probe_tokens=8, model=model)
    assert fp32['weight_copies'] == constant_bytes(model, 'float32')
    one, two = (cost.train_memory(cfg, B, 64, 'cpu', 'bfloat16', probe_tokens=8, model=model)['activations']
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
        points = {(B, T): cost.step_bytes(model, torch.randint(0, 61, (B, T)))['saved']
                  for B, T in cost.probe_shapes(64, 8)}
        c = cost.fit_bytes(points)
        assert c[5] == pytest.approx(0 if fast_on else 8 * H * (L - 1), abs=1e-6)  # B T²
        assert c[2] == pytest.approx(0 if fast_on else L - 1, abs=1e-6)            # T², the masks


def test_fit_bytes_recovers_each_kind_of_term():
    """A hand-made byte count with every term of the fit, and one without T² terms from two lengths."""
    def f(B, T):
        return 1000 + 7 * T + 3 * T * T + B * (11 + 13 * T + 5 * T * T)
    shapes = cost.probe_shapes(64, 8)
    assert cost.fit_bytes({s: f(*s) for s in shapes}) == pytest.approx((1000, 7, 3, 11, 13, 5), abs=1e-6)
    two = {(B, T): 1000 + B * 13 * T for B in (2, 3) for T in (8, 16)}
    assert cost.fit_bytes(two) == pytest.approx((1000, 0, 0, 0, 13, 0), abs=1e-6)


def test_the_peak_is_the_most_over_the_ops_at_the_planned_shape(monkeypatch):
    """Two ops hold the most memory at different sizes: a weight's gradient (50,000 bytes,
    whatever the batch) at the small probe shapes, the logits' gradient (100 bytes a token) at
    the planned 64 x 64. The plan fits each op's bytes and takes the most at 64 x 64: 409,600;
    fitting the probes' peaks instead would say 50,000."""
    def fake(model, idx, ctx=None):
        B, T = idx.shape
        ops = [50_000, 100 * B * T]
        return dict(saved=0, live=0, peak=max(ops), timeline=ops)
    monkeypatch.setattr(cost, 'step_bytes', fake)
    cfg = tiny('preln')
    mem = cost.train_memory(cfg, 64, 64, probe_tokens=8, model=GPT(cfg))
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
    eager = cost.train_memory(cfg, 5, 48, 'cpu', dtype, probe_tokens=8, model=model)
    comp = cost.train_memory(cfg, 5, 48, 'cpu', dtype, probe_tokens=8, model=model, compiled=True)
    model.compile_regions()
    idx = torch.randint(0, cfg.vocab_size, (5, 48))
    with AUTOCAST[dtype] or torch.autocast('cpu', enabled=False):
        model(idx, idx)[1].backward()
    real = cost.saved_activation_bytes(model, idx, idx, AUTOCAST[dtype])
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
    mem = cost.train_memory(cfg, 2, 16, model=model)
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
    assert cost.auto_micro_batch(512, lambda b: (10 + 3 * b) * gib, 40 * gib) == (8, 64)
    assert cost.auto_micro_batch(512, lambda b: (10 + 3 * b) * gib, 80 * gib) == (16, 32)
    assert cost.auto_micro_batch(6, lambda b: b, 100) == (6, 1)
    with pytest.raises(ValueError, match='even a micro-batch of 1 sequence'):
        cost.auto_micro_batch(512, lambda b: (10 + 3 * b) * gib, 12 * gib)


def test_oom_message_names_config_micro_batch_and_fix():
    msg = cost.oom_message(tiny('attnres', n_layer=32), 16, 2048, 32, 'compiling', 'config/attnres_L32.py')
    assert msg.startswith('out of memory while compiling: config/attnres_L32.py (attnres L=32 d=32)')
    assert 'micro-batch 16 x 2048' in msg and '--auto_batch=True' in msg
    assert '--batch_size=8 --gradient_accumulation_steps=64' in msg and '\n' not in msg
    assert '--fsdp=True' in cost.oom_message(tiny('preln'), 1, 2048, 512)  # one sequence: another fix


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
    'planning': (f"import torch, cost; cost.step_bytes = lambda *a, **k: {RAISE}",
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
    assert r.stderr.strip().splitlines() == ["error: " + cost.oom_message(shape, 4, 32, 2, where, str(cfg_file))], \
        r.stderr[-3000:]


def test_auto_batch_keeps_the_global_batch(data_dir, tmp_path):  # noqa: F811
    """16 sequences per step asked as 16 x 1; a budget that fits about 5 sequences gives
    micro-batch 4 x 4 accumulation steps (from the same prediction)."""
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=32, vocab_size=257)
    torch.manual_seed(1337)
    mem = cost.train_memory(cfg, 16, 32, model=GPT(cfg))
    budget_gib = (mem['total'] - 16 * mem['per_sequence'] + 5.2 * mem['per_sequence']) / 0.9 / 2**30
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
    mem = cost.memory_main(str(cfg), compiled=False)
    budget_gib = (mem['total'] + 0.05 * mem['per_sequence']) / 2**30
    assert cost.memory_main(str(cfg), budget_gib=budget_gib, compiled=False)['auto'] == (2, 2)
    with pytest.raises(ValueError, match='budget_gib'):
        cost.memory_main(str(cfg), budget_gib=0, compiled=False)
