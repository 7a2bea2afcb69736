"""bench.py: the plain GPT it measures the scheme interface against, the timing table, the fast
suite (fast paths on / off) and the compile suite's step as train.py compiles it, at tiny shapes
on the CPU. Times are not checked (performance is measured, not asserted): what is checked is
that each row measures what it says.
Run: python -m pytest tests/test_bench.py -q"""

import json
import math

import pytest
import torch

import bench
from model import GPT, GPTConfig

TINY = ['--n_layer=2', '--n_embd=32', '--n_head=2', '--block_size=16', '--batch_size=2', '--vocab_size=64',
        '--device=cpu', '--steps=2', '--rounds=2', '--warmup=1', '--threads=1', '--out=']


def test_plain_gpt_is_preln_given_the_same_weights():
    """PlainGPT, written apart from model.py and residuals.py, gives Pre-LN's loss and logits
    on Pre-LN's weights: the reference of the 'xplain' column is the same model."""
    cfg = GPTConfig(n_layer=3, n_embd=32, n_head=4, n_kv_head=2, block_size=16, vocab_size=64, residual='preln')
    torch.manual_seed(0)
    gpt = GPT(cfg)
    for p in gpt.parameters():  # away from the init (norm gains of 1), so that every weight matters
        p.data.add_(0.05 * torch.randn_like(p))
    plain = bench.PlainGPT(cfg)
    plain.load_state_dict(bench.plain_state_dict(gpt.state_dict()))
    assert plain.num_params() == gpt.num_params()
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    (a, la), (b, lb) = gpt(x, x), plain(x, x)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert lb.item() == pytest.approx(la.item(), rel=1e-6)
    with pytest.raises(KeyError, match='no place in PlainGPT'):
        bench.plain_state_dict(GPT(GPTConfig(**{**vars(cfg), 'residual': 'hc'})).state_dict())


def test_bench_table_rows_and_ratios(capsys):
    rows = bench.main(TINY + ['--schemes=preln,attnres,hc'])
    by = {r['name']: r for r in rows}
    assert list(by) == ['preln', 'attnres', 'hc', 'plain']
    assert by['preln']['train_vs_preln'] == 1.0 and by['plain']['params'] == by['preln']['params']
    for r in rows:  # each ratio is of this row's own rounds
        assert r['train_ms'] > 0 and len(r['train_ms_rounds']) == 2 and math.isfinite(r['train_vs_plain'])
    assert by['attnres']['target'] == bench.TARGETS['attnres'] and by['attnres']['target_vs'] == 'preln'
    assert by['attnres']['saved_bytes'] > by['preln']['saved_bytes']  # the depth sources stay for backward
    out = capsys.readouterr().out
    assert 'fast=auto' in out and ('PASS' in out or 'FAIL' in out)


def test_fast_suite_pairs_plain_and_fast(capsys):
    """--suite=fast: one row per scheme that has a fast path on the CPU, naming its paths; the two
    models of a row start from the same weights (same loss at the first step)."""
    rows = bench.main(TINY + ['--suite=fast', '--schemes=preln,attnres,mhc,sandwich'])
    assert [r['scheme'] for r in rows] == ['attnres', 'mhc']
    assert rows[0]['paths'] == ['attnres_group_torch']
    assert rows[1]['paths'] == ['mhc_streams_torch']
    for r in rows:
        assert r['plain_ms'] > 0 and r['fast_ms'] > 0 and r['fast_vs_plain'] > 0
    out = capsys.readouterr().out
    assert 'sandwich: no fast path on cpu' in out and '| attnres | attnres_group_torch |' in out


@pytest.mark.slow
def test_compile_one_compiles_the_regions_train_py_compiles():
    """The compile suite times GPT.compile_regions (what train.py --compile=True runs), not a
    whole-model graph: one graph per region kind and no recompile over the timed steps; with
    fast paths on, the AttnRes read is the fast path's and its region is not compiled."""
    from torch._dynamo.utils import counters
    kw = dict(n_layer=3, n_embd=32, n_head=2, block_size=16, vocab_size=64, residual='attnres')
    torch._dynamo.reset()
    counters.clear()
    plain = bench.compile_one(kw, 2, 'float32', torch.device('cpu'), steps=1)
    assert plain['loss_finite'] and plain['recompiles'] == 0 and plain['graphs'] >= 3
    torch._dynamo.reset()
    counters.clear()
    fast = bench.compile_one(kw, 2, 'float32', torch.device('cpu'), steps=1, fast_setting=True)
    assert fast['loss_finite'] and fast['recompiles'] == 0
    assert fast['graphs'] < plain['graphs']  # the read's region is replaced, not compiled


def test_compile_suite_pairs_each_round_with_its_own_pre_ln(monkeypatch):
    """With compile_repeats, a scheme's ratio is the median of its ratios to Pre-LN's compile
    in the same round, not a ratio of medians: rounds (Pre-LN 10 s, mHC 19 s), (20, 22),
    (12, 15.6) give ratios 1.9, 1.1, 1.3 -> 1.30 (the ratio of medians would be 19 / 12)."""
    import subprocess
    times = iter([10.0, 19.0, 20.0, 22.0, 12.0, 15.6])

    def fake_run(cmd, **kw):
        assert kw['env']['TORCHINDUCTOR_CACHE_DIR']  # each compile in its own cold cache
        t = next(times)
        res = dict(compile_s=t, compile_cpu_s=t, step_ms=2 * t, graphs=2, graph_breaks=0, recompiles=0, loss_finite=True)
        return subprocess.CompletedProcess(cmd, 0, 'RESULT ' + json.dumps(res) + '\n', '')

    monkeypatch.setattr(subprocess, 'run', fake_run)
    rows = bench.compile_suite(['preln', 'mhc'], [32], dict(n_embd=64), 4, 'float32', torch.device('cpu'), 1, 1,
                               log=lambda *_: None, repeats=3)
    pre, mhc = rows
    assert pre['compile_cpu_s'] == 12.0 and mhc['compile_cpu_s'] == 19.0  # medians of the rounds
    assert mhc['cpu_vs_preln_rounds'] == pytest.approx([1.9, 1.1, 1.3])
    assert mhc['cpu_vs_preln'] == pytest.approx(1.3) and mhc['repeats'] == 3
    assert '| mhc | 19 (1.30×, 1.10–1.90) |' in bench.format_compile_table(rows)
    with pytest.raises(ValueError, match='compile each scheme at least once'):
        bench.compile_suite(['preln'], [4], {}, 4, 'float32', torch.device('cpu'), 1, 1, repeats=0)


@pytest.mark.parametrize('argv,msg', [(['--suite=fastest'], "use 'bench', 'fast'"),
                                      (['--fast=sometimes'], "fast must be 'auto', True or False")])
def test_bad_settings_are_one_line(argv, msg):
    with pytest.raises(SystemExit) as e:
        bench.main(TINY + argv)
    assert msg in str(e.value)
