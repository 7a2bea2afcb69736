"""
Tests of study/sweep.py: skip / resume / start decisions and the command lines built for
them (the training subprocess is replaced by a recorder), option parsing, and
collect + plot from fake summary.json / metrics.jsonl files.

    python -m pytest tests/test_sweep.py -q
"""

import json
import math
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from study import families, mini, results, sweep  # noqa: E402


def _run_at(out_dir):
    """The family run whose out_dir this is (any seed), or None."""
    base = out_dir.split('_seed')[0]
    return next((r for r in families.all_runs() if r.out_dir == base), None)


def _write_summary(root, out_dir, val_loss, n_params=None, finished=True, max_iters=None):
    """A finished run's summary.json as train.py writes it, at its config's planned length
    (max_iters, or tokens_per_param x n_params tokens) unless max_iters is given."""
    run = _run_at(out_dir)
    config = run.config if run else {}
    tokens = 409600
    if 'max_iters' not in config and 'tokens_per_param' in config:
        n_params = n_params or run.total
        tokens = round(config['tokens_per_param'] * n_params)
    max_iters = max_iters or config.get('max_iters', 100)
    d = root / out_dir
    d.mkdir(parents=True, exist_ok=True)
    (d / 'summary.json').write_text(json.dumps(dict(finished=finished, iter=max_iters, max_iters=max_iters, val_loss=val_loss,
                                                    train_loss=val_loss - 0.05, n_params=n_params, tokens=tokens)))


def _write_partial(root, out_dir, val_losses, torn=True):
    """An interrupted run: ckpt.pt + metrics.jsonl with evals, train-only lines, a torn last line."""
    d = root / out_dir
    d.mkdir(parents=True, exist_ok=True)
    (d / 'ckpt.pt').write_bytes(b'fake')
    lines = []
    for i, v in enumerate(val_losses):
        lines.append(json.dumps(dict(iter=10 * i, tokens=40960 * i, train_loss=v + 0.3, val_loss=v, lr=1e-3)))
        lines.append(json.dumps(dict(iter=10 * i + 5, tokens=40960 * i + 20480, train_loss=v - 0.7, lr=1e-3)))
    text = "\n".join(lines) + "\n" + ('{"iter": 99, "val_lo' if torn else '')
    (d / 'metrics.jsonl').write_text(text)


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A fake checkout: generated configs, a train.py placeholder; sweep.ROOT points at it."""
    families.write_configs(root=tmp_path)
    (tmp_path / 'train.py').write_text("raise SystemExit('not run in tests')\n")
    for dataset in ('fineweb_edu', 'fineweb_edu_byte'):
        (tmp_path / 'data' / dataset).mkdir(parents=True)
        (tmp_path / 'data' / dataset / 'train.bin').write_bytes(b'')
    monkeypatch.setattr(sweep, 'ROOT', str(tmp_path))
    return tmp_path


class Recorder:
    """Stands in for run_command (sweep's and mini's): records (cmd, cwd); 'finishes' runs unless told to fail."""

    def __init__(self, root, fail=()):
        self.root, self.fail, self.calls, self.probes = root, set(fail), [], []

    def __call__(self, cmd, cwd):
        if 'probe.py' in cmd:
            self.probes.append(cmd)
            return 0
        self.calls.append((cmd, cwd))
        config = next(a for a in cmd if a.startswith('config/'))
        run = next(r for r in families.all_runs() if r.config_path == config)
        if run.name in self.fail:
            return 3
        _write_summary(self.root, run.out_dir, 1.5)
        return 0


def test_skip_resume_start_commands(repo, monkeypatch):
    _write_summary(repo, 'out/mini/preln_L2', 1.4)                 # finished -> skipped
    _write_partial(repo, 'out/mini/attnres_L2', [2.0, 1.8])        # ckpt.pt -> resumed
    _write_summary(repo, 'out/mini/hc_L2', 9.9, finished=False)    # summary but not finished, no ckpt -> new
    rec = Recorder(repo)
    monkeypatch.setattr(sweep, 'run_command', rec)
    failures = sweep.sweep('mini', shapes=[2], extra=['--eval_iters=2', '--betas=(0.9,0.95)'])
    assert failures == []
    py = sys.executable
    assert [c for c, _ in rec.calls] == [
        [py, 'train.py', 'config/mini/attnres_L2.py', '--init_from=resume', '--eval_iters=2', '--betas=(0.9,0.95)'],
        [py, 'train.py', 'config/mini/hc_L2.py', '--eval_iters=2', '--betas=(0.9,0.95)'],
        [py, 'train.py', 'config/mini/mhc_L2.py', '--eval_iters=2', '--betas=(0.9,0.95)'],
    ]
    assert all(cwd == str(repo) for _, cwd in rec.calls)
    # a second sweep has nothing left to do
    rec.calls.clear()
    assert sweep.sweep('mini', shapes=[2]) == [] and rec.calls == []


def test_failures_do_not_stop_the_sweep(repo, monkeypatch, capsys):
    rec = Recorder(repo, fail={'attnres_L4'})
    monkeypatch.setattr(sweep, 'run_command', rec)
    rc = sweep.main(['family=mini', 'schemes=preln,attnres', 'shapes=2,4'])
    assert rc == 1
    ran = [c[2] for c, _ in rec.calls]
    assert ran == ['config/mini/preln_L2.py', 'config/mini/attnres_L2.py',
                   'config/mini/preln_L4.py', 'config/mini/attnres_L4.py']
    err = capsys.readouterr().err
    assert '1 run(s) failed' in err and 'attnres_L4: exit status 3' in err
    # the sweep collected what finished
    res = json.loads((repo / 'out' / 'mini' / 'results.json').read_text())
    status = {r['name']: r['status'] for r in res['runs']}
    assert status['preln_L4'] == 'finished' and status['attnres_L4'] == 'missing'
    # the mini family probes the L = 8 checkpoints of every seed: none finished here
    assert rec.probes == []


def test_probe_step_can_be_turned_off(repo, monkeypatch):
    rec = Recorder(repo)
    monkeypatch.setattr(sweep, 'run_command', rec)
    monkeypatch.setattr(mini, 'run_command', rec)  # the mini study's probe step
    assert sweep.main(['family=mini', 'schemes=preln,hc', 'shapes=8', 'probe=False']) == 0
    assert len(rec.calls) == 2 and rec.probes == []
    assert sweep.main(['family=mini', 'schemes=preln,hc', 'shapes=8']) == 0  # all finished: probe only
    assert len(rec.calls) == 2
    # one probe.py per deepest checkpoint (every seed of every mini scheme that finished)
    assert sorted(a for c in rec.probes for a in c if a.startswith('--ckpt=')) == \
        ['--ckpt=out/mini/hc_L8/ckpt.pt', '--ckpt=out/mini/preln_L8/ckpt.pt']


def test_exit_zero_without_summary_is_a_failure(repo, monkeypatch):
    monkeypatch.setattr(sweep, 'run_command', lambda cmd, cwd: 0)
    failures = sweep.sweep('mini', schemes=['preln'], shapes=[8])
    assert failures == [('preln_L8', 'exited 0 but out_dir has no finished summary.json')]


def test_print_mode_commands(repo, monkeypatch, capsys):
    monkeypatch.setattr(sweep, 'run_command', lambda *a: pytest.fail("print mode must not run anything"))
    _write_partial(repo, 'out/main/attnres_L32', [3.0])
    _write_summary(repo, 'out/main/preln_L32', 2.8)
    assert sweep.main(['--family=main', '--schemes=preln,attnres', '--shapes=32', '--run=print']) == 0
    out = capsys.readouterr().out
    assert 'torchrun --standalone --nproc_per_node=8 train.py config/attnres_L32.py --init_from=resume' in out
    assert 'preln_L32 (out/main/preln_L32): finished, skipped' in out
    assert 'train.py config/preln_L32.py' not in out
    assert sweep.main(['family=onepointsix', 'schemes=hc', 'shapes=54', 'run=print', 'nnodes=4',
                       'nproc_per_node=8']) == 0
    out = capsys.readouterr().out
    assert ('torchrun --nnodes=4 --node_rank=$NODE_RANK --nproc_per_node=8 --master_addr=$MASTER_ADDR '
            '--master_port=29500 train.py config/onepointsix/hc_L54.py') in out


def test_local_multi_gpu_uses_torchrun(repo, monkeypatch):
    rec = Recorder(repo)
    monkeypatch.setattr(sweep, 'run_command', rec)
    sweep.sweep('main', schemes=['hc'], shapes=[70], nproc_per_node=8)
    (cmd, _), = rec.calls
    assert cmd == [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=8',
                   'train.py', 'config/hc_L70.py']


def test_parse_args():
    o = sweep.parse_args(['family=main', '--schemes=preln,hc', 'shapes=16,32',
                          'extra=--device=cpu,--betas=(0.9,0.95)', 'plot_only=true'])
    assert o['family'] == 'main' and o['schemes'] == ['preln', 'hc'] and o['shapes'] == [16, 32]
    assert o['extra'] == ['--device=cpu', '--betas=(0.9,0.95)'] and o['plot_only'] is True
    for bad, msg in [(['schemes=preln'], 'give a family'), (['family=huge'], 'unknown family'),
                     (['family=main', 'colour=red'], 'unknown option'), (['family=main', 'shapes=a'], 'depths'),
                     (['family=main', 'nproc_per_node=0'], 'positive integer'), (['family', 'main'], 'key=value')]:
        with pytest.raises(ValueError, match=msg):
            sweep.parse_args(bad)


def test_bad_options_exit_with_one_line(repo, capsys):
    assert sweep.main(['family=main', 'extra=--out_dir=x']) == 2
    assert 'sweep sets out_dir' in capsys.readouterr().err
    assert sweep.main(['family=main', 'run=cluster']) == 2
    assert 'run=local or run=print' in capsys.readouterr().err
    assert sweep.main(['family=main', 'schemes=nope']) == 2
    (repo / 'data' / 'fineweb_edu_byte' / 'train.bin').unlink()
    assert sweep.main(['family=mini']) == 2
    assert 'data/fineweb_edu_byte/train.bin not found' in capsys.readouterr().err
    assert sweep.main(['family=mini', 'run=print']) == 0  # printing needs no data here
    (repo / 'train.py').unlink()
    assert sweep.main(['family=mini']) == 2
    assert 'train.py not found' in capsys.readouterr().err


# -----------------------------------------------------------------------------
# collect + plot


def _png_size(path):
    data = Path(path).read_bytes()
    assert data[:8] == b'\x89PNG\r\n\x1a\n'
    return struct.unpack('>II', data[16:24])  # IHDR width, height


def test_collect_values(tmp_path):
    _write_summary(tmp_path, 'out/mini/preln_L4', 1.61, n_params=870_000)
    _write_partial(tmp_path, 'out/mini/hc_L4', [2.5, 2.1, 1.9])
    rows = sweep.collect('mini', root=str(tmp_path))
    saved = json.loads((tmp_path / 'out' / 'mini' / 'results.json').read_text())
    assert saved['family'] == 'mini' and saved['runs'] == rows
    by = {r['name']: r for r in rows}
    assert len(rows) == len(families.runs('mini'))
    fin = by['preln_L4']
    assert (fin['status'], fin['val_loss'], fin['n_params'], fin['params_M']) == ('finished', 1.61, 870_000, 0.87)
    part = by['hc_L4']
    # the last *validation* loss, not the last train loss, and the torn line is skipped
    assert (part['status'], part['val_loss'], part['iter']) == ('unfinished', 1.9, 20)
    run = next(r for r in families.runs('mini') if r.name == 'hc_L4')
    assert part['params_M'] == run.total / 1e6 and part['ratio'] == run.d / run.L
    assert by['attnres_L8']['status'] == 'missing' and by['attnres_L8']['val_loss'] is None


def test_plots_two_panels_when_both_families_have_results(tmp_path):
    root = str(tmp_path)
    # main's L=16, 20 are not fixed-backbone shapes: one panel
    for i, r in enumerate(families.runs('main', schemes=['preln', 'attnres'], shapes=[16, 20])):
        _write_summary(tmp_path, r.out_dir, 2.8 - 0.01 * i)
    rows = sweep.collect('main', root=root)
    (one,) = sweep.plot('main', rows, root=root)
    assert one.endswith('loss_vs_ratio.png')
    w1, h1 = _png_size(one)
    _write_partial(tmp_path, 'out/fixed_backbone/hc_L16', [2.9])  # d=1248: its own run
    (two,) = sweep.plot('main', rows, root=root)
    w2, h2 = _png_size(two)
    assert h2 == h1 and w2 == 2 * w1  # a second (fixed-backbone) panel
    # main's L=24 (d=1024) is also a fixed-backbone run: it shows up there
    _write_summary(tmp_path, 'out/main/preln_L24', 2.75)
    fb = {r['name']: r for r in sweep.collect('fixed_backbone', root=root)}
    assert fb['preln_L24']['status'] == 'finished' and fb['preln_L24']['out_dir'] == 'out/main/preln_L24'


def test_cross_scale_size_plot(tmp_path):
    root = str(tmp_path)
    assert sweep.plot('cross_scale', root=root) == []  # nothing to plot yet
    for r in families.runs('cross_scale', schemes=['preln', 'hc']):
        _write_summary(tmp_path, r.out_dir, 3.5 - r.total / 1e9)
    rows = sweep.collect('cross_scale', root=root)
    paths = sweep.plot('cross_scale', rows, root=root)
    assert sorted(Path(p).name for p in paths) == ['loss_vs_ratio.png', 'loss_vs_size.png']
    w, _ = _png_size(next(p for p in paths if p.endswith('loss_vs_size.png')))
    hc_only = sweep.plot('cross_scale', [r for r in rows if r['scheme'] == 'hc'], root=root)
    w1, _ = _png_size(next(p for p in hc_only if p.endswith('loss_vs_size.png')))
    assert w > w1  # one panel per scheme
    assert sum(r['status'] == 'finished' for r in rows) == 24  # 400M rows read main's out_dirs


def test_plot_only_cli(repo, capsys):
    _write_summary(repo, 'out/mini/preln_L2', 1.7, max_iters=461)  # the mini study reads runs of its planned length
    assert sweep.main(['family=mini', 'plot_only=True']) == 0
    assert (repo / 'out' / 'mini' / 'loss_vs_ratio.png').exists()
    assert '1 finished, 0 unfinished, 13 missing' in capsys.readouterr().out


# -----------------------------------------------------------------------------
# seeds


def test_seeds_train_seed_by_seed_into_their_own_out_dirs(repo, monkeypatch):
    rec = Recorder(repo)
    _write_partial(repo, 'out/mini/hc_L2_seed1', [2.0])  # an interrupted seed resumes with its seed
    seen = []

    def run(cmd, cwd):
        seen.append(cmd)
        out = next((a.split('=', 1)[1] for a in cmd if a.startswith('--out_dir=')), None)
        if out is None:
            return rec(cmd, cwd)
        _write_summary(repo, out, 1.5)
        return 0
    monkeypatch.setattr(sweep, 'run_command', run)
    assert sweep.sweep('mini', schemes=['preln', 'hc'], shapes=[2], seeds=3) == []
    py = sys.executable
    assert seen == [
        [py, 'train.py', 'config/mini/preln_L2.py'],
        [py, 'train.py', 'config/mini/hc_L2.py'],
        [py, 'train.py', 'config/mini/preln_L2.py', '--out_dir=out/mini/preln_L2_seed1', '--seed=1338'],
        [py, 'train.py', 'config/mini/hc_L2.py', '--out_dir=out/mini/hc_L2_seed1', '--seed=1338', '--init_from=resume'],
        [py, 'train.py', 'config/mini/preln_L2.py', '--out_dir=out/mini/preln_L2_seed2', '--seed=1339'],
        [py, 'train.py', 'config/mini/hc_L2.py', '--out_dir=out/mini/hc_L2_seed2', '--seed=1339'],
    ]
    assert sweep.parse_args(['family=mini', 'seeds=3'])['seeds'] == 3
    seen.clear()  # one seed index alone (one process per seed): only its runs
    _write_partial(repo, 'out/mini/hc_L4_seed2', [2.0])
    assert sweep.sweep('mini', schemes=['hc'], shapes=[2, 4], seed=2) == []
    assert seen == [[py, 'train.py', 'config/mini/hc_L4.py', '--out_dir=out/mini/hc_L4_seed2', '--seed=1339',
                     '--init_from=resume']]
    assert sweep.parse_args(['family=mini', 'seed=0'])['seed'] == 0
    with pytest.raises(ValueError, match='positive integer'):
        sweep.parse_args(['family=mini', 'seeds=0'])
    with pytest.raises(ValueError, match='seed index'):
        sweep.seeded(families.runs('mini')[0], -1)


def test_seed_summary_mean_and_standard_error(tmp_path):
    losses = {'preln_L4': [1.80, 1.84, 1.82], 'hc_L4': [1.70, 1.78], 'attnres_L4': [1.75]}
    for name, vals in losses.items():
        for k, v in enumerate(vals):
            _write_summary(tmp_path, f"out/mini/{name}" + (f"_seed{k}" if k else ''), v)
    _write_partial(tmp_path, 'out/mini/preln_L8_seed1', [2.0])  # unfinished: not in the mean
    rows = sweep.collect('mini', root=str(tmp_path))
    saved = json.loads((tmp_path / 'out' / 'mini' / 'results.json').read_text())
    summ = {(s['scheme'], s['L']): s for s in saved['summary']}
    p = summ[('preln', 4)]
    assert p['n_seeds'] == 3 and p['mean'] == pytest.approx(1.82)
    assert p['se'] == pytest.approx(0.02 / math.sqrt(3))  # sample std 0.02 over sqrt(3)
    assert summ[('hc', 4)]['se'] == pytest.approx(0.04) and summ[('attnres', 4)]['se'] is None
    assert ('preln', 8) not in summ and len(rows) == 14 + 2 + 1 + 1
    table = sweep.format_summary(rows)
    assert '| 4 (32) | 1.820 ± 0.012 (3) | 1.740 ± 0.040 (2) | 1.750 (1) |' in table
    assert 'L = 4: best hc; others preln +0.080 ± 0.042' in table
    (png,) = sweep.plot('mini', rows, root=str(tmp_path))
    assert _png_size(png)[0] > 0


def test_a_run_of_another_length_is_left_out_of_every_summary(repo, monkeypatch, capsys):
    # a shortened smoke test (`extra=--max_iters=5`) finished into the real out_dir of a
    # fixed-length run, and a token-budget run trained on half its tokens per parameter
    _write_summary(repo, 'out/mini/preln_L2', 2.9, max_iters=5)
    _write_summary(repo, 'out/mini/preln_L2_seed1', 1.8)
    main = next(r for r in families.runs('main') if 'max_iters' not in r.config)
    n = main.total
    tpp = main.config['tokens_per_param']
    for k, tokens in ((0, tpp * n / 2), (1, tpp * n * 1.002), (2, tpp * n * 2)):  # half / the last step's overshoot / twice
        out = results.seeded(main, k).out_dir
        _write_summary(repo, out, 3.0 + k, n_params=n)
        s = json.loads((repo / out / 'summary.json').read_text())
        (repo / out / 'summary.json').write_text(json.dumps(dict(s, tokens=int(tokens))))
    # summaries that lack what the check needs, or hold it as text, are not the planned run either
    for k, change in ((2, dict(max_iters=None)), (3, dict(max_iters='461'))):
        _write_summary(repo, f'out/mini/preln_L2_seed{k}', 1.7)
        path = repo / f'out/mini/preln_L2_seed{k}' / 'summary.json'
        path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    rows = sweep.collect('mini', root=str(repo), seeds=4)
    assert {r['seed']: r['status'] for r in rows if r['name'].startswith('preln_L2')} == {
        0: 'other_length', 1: 'finished', 2: 'other_length', 3: 'other_length'}
    assert "records max_iters='461', not the planned 461" in capsys.readouterr().err
    rows = sweep.collect('mini', root=str(repo), seeds=2)
    by = {(r['name'], r['seed']): r for r in rows}
    assert by[('preln_L2', 0)]['status'] == 'other_length' and by[('preln_L2_seed1', 1)]['status'] == 'finished'
    cell = next(s for s in results.summarize(rows) if (s['scheme'], s['L']) == ('preln', 2))
    assert cell['values'] == [1.8]                               # the 5-step loss is in no mean
    out = capsys.readouterr()
    assert 'out/mini/preln_L2 finished at max_iters=5, not the planned 461: left out' in out.err
    assert '3 at another length' in out.out                        # seeds 0, 2 and 3 of preln_L2
    rows = sweep.collect('main', root=str(repo), seeds=3)
    status = {r['seed']: r['status'] for r in rows if r['name'].split('_seed')[0] == main.name}
    assert status == {0: 'other_length', 1: 'finished', 2: 'other_length'}
    assert f'trained 10 tokens per parameter, not the planned {tpp:g}' in capsys.readouterr().err
    out = results.seeded(main, 1).out_dir
    s = json.loads((repo / out / 'summary.json').read_text())
    (repo / out / 'summary.json').write_text(json.dumps(dict(s, n_params=float(n), tokens=float(s['tokens']))))
    assert results.read_result(results.seeded(main, 1), str(repo))['status'] == 'finished'   # 406534436.0 is a count
    (repo / out / 'summary.json').write_text(json.dumps(dict(s, n_params=None)))
    assert results.read_result(results.seeded(main, 1), str(repo))['other_length'] == (
        f"records n_params=None and tokens={s['tokens']}: its token budget cannot be checked")
    (repo / out / 'summary.json').write_text(json.dumps(dict(s, n_params=str(n))))
    row = results.read_result(results.seeded(main, 1), str(repo))       # text where a count belongs: no crash
    assert row['status'] == 'other_length' and row['params_M'] == main.total / 1e6
    # nor drawn: a family whose only run is of another length has nothing to plot
    main_rows = sweep.collect('main', root=str(repo), seeds=3)
    assert sweep.plot('main', [r for r in main_rows if r['seed'] in (0, 2)], root=str(repo)) == []
    cross = next(r for r in families.runs('cross_scale'))
    _write_summary(repo, cross.out_dir, 9.9, max_iters=3)
    s = json.loads((repo / cross.out_dir / 'summary.json').read_text())
    (repo / cross.out_dir / 'summary.json').write_text(json.dumps(dict(s, tokens=1000)))
    assert sweep.plot('cross_scale', sweep.collect('cross_scale', root=str(repo)), root=str(repo)) == []
    capsys.readouterr()
    # nor probed
    assert sweep.probe_deepest('mini', ['preln'], [2], root=str(repo)) == []
    assert 'probe: no finished run of mini to probe' in capsys.readouterr().out
    # the sweep still skips the shortened run, with a line saying how to train the planned one
    monkeypatch.setattr(sweep, 'run_command', Recorder(repo))
    sweep.sweep('mini', schemes=['preln'], shapes=[2])
    line = next(x for x in capsys.readouterr().out.splitlines() if 'preln_L2 ' in x)
    assert 'finished, skipped -- but it finished at max_iters=5' in line and 'delete out/mini/preln_L2' in line


def _git(root, *args):
    subprocess.run(['git', '-c', 'user.name=t', '-c', 'user.email=t@t', *args], cwd=root, check=True,
                   capture_output=True)


def test_wall_time_records_the_commit_of_each_launch(repo, monkeypatch, tmp_path_factory):
    _git(repo, 'init', '-q')
    (repo / 'README.md').write_text("a guide\n")
    _git(repo, 'add', 'train.py', 'config', 'README.md')
    _git(repo, 'commit', '-q', '-m', 'a')
    head = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=repo, capture_output=True, text=True).stdout.strip()[:12]
    assert sweep.code_version(str(repo)) == head
    run = next(iter(families.runs('mini', ['preln'], [2])))
    monkeypatch.setattr(sweep, 'run_command', Recorder(repo))
    sweep.sweep('mini', schemes=['preln'], shapes=[2])          # launched through the sweep
    wall = json.loads((repo / run.out_dir / 'wall_time.json').read_text())
    assert wall['commits'] == [head] and wall['launches'] == 1
    # an edited guide (or results the mini study rewrote) is not other code
    (repo / 'README.md').write_text("a better guide\n")
    assert sweep.code_version(str(repo)) == head
    # resumed after an edit of the code: both versions are on record, once each; another edit is a third
    (repo / 'train.py').write_text("raise SystemExit('edited')\n")
    edited = sweep.code_version(str(repo))
    assert re.fullmatch(head + r'-dirty\.[0-9a-f]{8}', edited)
    for _ in range(2):
        sweep.record_wall_time(run, str(repo), 1.0, sweep.code_version(str(repo)))
    (repo / 'train.py').write_text("raise SystemExit('edited again')\n")
    sweep.record_wall_time(run, str(repo), 1.0, sweep.code_version(str(repo)))
    wall = json.loads((repo / run.out_dir / 'wall_time.json').read_text())
    assert wall['commits'][:2] == [head, edited] and len(set(wall['commits'])) == 3 and wall['launches'] == 4
    # the same edit is the same version whatever the user's diff settings
    _git(repo, 'config', 'color.diff', 'always')
    _git(repo, 'config', 'diff.noprefix', 'true')
    assert sweep.code_version(str(repo)) == wall['commits'][2]
    # not the top of a checkout: a folder inside one (a copy of the tree in another repository), or none
    (repo / 'copy').mkdir()
    assert sweep.code_version(str(repo / 'copy')) is None
    assert sweep.code_version(str(tmp_path_factory.mktemp('not_a_checkout'))) is None


def test_a_checkout_git_cannot_read_is_one_line(tmp_path, capsys):
    (tmp_path / '.git').write_text("gitdir: /nonexistent/worktree\n")   # a worktree whose repository moved
    assert sweep.code_version(str(tmp_path)) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"warning: git cannot read the commit of {tmp_path} (")


def test_a_launch_killed_without_a_word_keeps_its_wall_time(tmp_path):
    """Bug caught: a sweep killed with SIGKILL (or a machine's restart) mid-run loses that
    launch's wall time, and a resumed run reports only its last launch. A real sweep process
    times a 30 s command with a 0.2 s heartbeat and is killed at about 1.5 s; the next launch
    folds the killed one's time into the totals and says how many ended so."""
    import os
    import signal
    import time
    run = next(iter(families.runs('mini', ['preln'], [2])))
    (tmp_path / run.out_dir).mkdir(parents=True)
    path = tmp_path / run.out_dir / 'wall_time.json'
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from study import families, sweep; "
            "sweep.HEARTBEAT_S = 0.2; run = next(iter(families.runs('mini', ['preln'], [2]))); "
            "sweep.timed(run, sys.argv[2], ['sleep', '30'], 'aaaa')")
    child = subprocess.Popen([sys.executable, '-c', code, str(REPO), str(tmp_path)], start_new_session=True)
    t0 = time.time()
    while not (path.exists() and json.loads(path.read_text())['open']['wall_s'] >= 1.0):
        assert time.time() - t0 < 60 and child.poll() is None, "the heartbeat never reached 1 s"
        time.sleep(0.05)
    os.killpg(child.pid, signal.SIGKILL)  # the sweep and its train.py (here: sleep), no handler runs
    child.wait()
    killed = json.loads(path.read_text())
    assert killed['launches'] == 0 and 1.0 <= killed['open']['wall_s'] < 1.6 and killed['commits'] == ['aaaa']
    assert sweep.timed(run, str(tmp_path), [sys.executable, '-c', 'import time; time.sleep(0.3)'], 'bbbb') == 0
    wall = json.loads(path.read_text())
    assert 'open' not in wall and wall['launches'] == 2 and wall['killed_launches'] == 1
    assert killed['open']['wall_s'] + 0.3 <= wall['wall_s'] < killed['open']['wall_s'] + 5
    assert wall['commits'] == ['aaaa', 'bbbb']
    # a launch that ends on its own leaves no open entry and counts no kill
    sweep.timed(run, str(tmp_path), [sys.executable, '-c', 'pass'], 'bbbb')
    again = json.loads(path.read_text())
    assert again['launches'] == 3 and again['killed_launches'] == 1 and 'open' not in again
