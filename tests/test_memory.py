"""The training-memory model of cost.py (train_memory, auto_micro_batch, oom_message) and
train.py's auto_batch and out-of-memory line, on the CPU.
Run: python -m pytest tests/test_memory.py -q"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cost  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from residuals import RESIDUALS  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / 'tests'))
from test_train import data_dir  # noqa: E402,F401  (the tiny corpus fixture)


def tiny(residual, **kw):
    return GPTConfig(**{**dict(n_layer=3, n_embd=32, n_head=2, block_size=64, vocab_size=61, residual=residual), **kw})


@pytest.mark.parametrize('residual', list(RESIDUALS))
def test_predicted_activations_match_measured_saved_bytes(residual):
    """The activation term, probed on one 8-token sequence and scaled, against the bytes
    autograd saves at 3 x 40 tokens, measured with saved_tensors_hooks: within 10% for
    every scheme (it would not be if a scheme saved T x T scores or per-batch constants)."""
    torch.manual_seed(0)
    cfg = tiny(residual)
    model = GPT(cfg)
    pred = cost.train_memory(cfg, 3, 40, probe_tokens=8, model=model)['activations']
    idx = torch.randint(0, cfg.vocab_size, (3, 40))
    measured = cost.saved_activation_bytes(model, idx, idx)
    assert pred == pytest.approx(measured, rel=0.10)


@pytest.mark.parametrize('residual', list(RESIDUALS))
def test_compiled_read_workspace_is_the_route(residual, monkeypatch):
    """The workspace term is the bytes of the route the scheme opens, the one gradient
    buffer its reads add into (built here by calling begin, as if compiling and eagerly
    with grad enabled, so the formula in route_bytes_per_token is checked against the real
    tensor); 0 without a route. Compiled, AttnRes, Block AttnRes and MoDA have one;
    eagerly, the AttnRes two only."""
    cfg = tiny(residual, n_kv_head=1)
    model = GPT(cfg)
    B, T = 3, 40
    monkeypatch.setattr(torch.compiler, 'is_compiling', lambda: True)
    state = model.residual.begin(torch.zeros(B, T, cfg.n_embd))
    route = [s for s in (state if isinstance(state, tuple) else ()) if isinstance(s, torch.Tensor)
             and s.dim() >= 4 and s.stride()[0] == 0]  # the zero-stride route, if any
    monkeypatch.undo()
    mem = cost.train_memory(cfg, B, T, probe_tokens=8, model=model, compiled=True)
    assert (len(route) == 1) == (residual in ('attnres', 'blockattnres', 'moda'))
    want = route[0].numel() * route[0].element_size() if route else 0
    assert mem['read_workspace'] == want
    assert mem['total'] == pytest.approx(sum(v for k, v in mem.items() if k not in ('total', 'activations_per_token', 'per_sequence')))
    state = model.residual.begin(torch.zeros(B, T, cfg.n_embd))
    eager = [s for s in (state if isinstance(state, tuple) else ()) if isinstance(s, torch.Tensor)
             and s.dim() >= 4 and s.stride()[0] == 0]
    assert (len(eager) == 1) == (residual in ('attnres', 'blockattnres'))
    want = eager[0].numel() * eager[0].element_size() if eager else 0
    assert cost.train_memory(cfg, B, T, probe_tokens=8, model=model)['read_workspace'] == want


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
    assert mem['logits_grad'] == 4 * 2 * 16 * cfg.vocab_size
    assert mem['total'] == pytest.approx(mem['params'] + mem['grads'] + mem['adamw'] + mem['activations']
                                         + mem['logits_grad'])


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
    msg = cost.oom_message(tiny('attnres', n_layer=32), 16, 2048, 32)
    assert 'attnres L=32' in msg and 'micro-batch 16 x 2048' in msg and '--auto_batch=True' in msg
    assert '\n' not in msg


def run_train(args, inject_oom=False):
    """train.py in a subprocess; inject_oom makes every forward raise torch.OutOfMemoryError,
    as a CUDA allocation failure would."""
    patch = ("import torch, model; "
             "model.GPT.forward = lambda self, *a, **k: (_ for _ in ()).throw("
             "torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')); ") if inject_oom else ''
    code = patch + f"import runpy, sys; sys.argv = ['train.py'] + {list(args)!r}; runpy.run_path('train.py', run_name='__main__')"
    env = dict(os.environ, OMP_NUM_THREADS='1')
    return subprocess.run([sys.executable, '-c', code], cwd=REPO, capture_output=True, text=True, env=env, timeout=600)


TINY = ['--device=cpu', '--compile=False', '--n_layer=2', '--n_embd=32', '--n_head=2', '--block_size=32',
        '--log_interval=1', '--eval_iters=1', '--max_iters=2', '--eval_interval=2']


def test_out_of_memory_is_one_line(data_dir, tmp_path):  # noqa: F811
    r = run_train(TINY + [f'--data_dir={data_dir}', f'--out_dir={tmp_path / "o"}', '--batch_size=4',
                          '--gradient_accumulation_steps=2'], inject_oom=True)
    assert r.returncode == 1
    err = r.stderr.strip().splitlines()
    assert err == ["error: " + cost.oom_message(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=32,
                                                          vocab_size=257), 4, 32, 2)], r.stderr[-2000:]


def test_auto_batch_keeps_the_global_batch(data_dir, tmp_path):  # noqa: F811
    """16 sequences per step asked as 16 x 1; a budget that fits about 5 sequences of
    activations gives micro-batch 4 x 4 accumulation steps (from the same prediction)."""
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=32, vocab_size=257)
    torch.manual_seed(1337)
    mem = cost.train_memory(cfg, 16, 32, model=GPT(cfg))
    per_seq = (mem['activations'] + mem['logits_grad']) / 16
    fixed = mem['total'] - 16 * per_seq
    budget_gib = (fixed + 5.2 * per_seq) / 0.9 / 2**30
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
    fixed = mem['params'] + mem['grads'] + mem['adamw']
    budget_gib = (fixed + 4.05 * mem['per_sequence']) / 2**30
    assert cost.memory_main(str(cfg), budget_gib=budget_gib, compiled=False)['auto'] == (2, 2)
    with pytest.raises(ValueError, match='budget_gib'):
        cost.memory_main(str(cfg), budget_gib=0, compiled=False)
