"""What train.py refuses before its first step (plan/checks.py), each check staged in-process at
its boundary (the value just inside is taken, the one just past refused, in one line), and the
bad inputs that reached a traceback staged end to end through train.py and cost.py --memory:
AdamW's betas, --memory_gib=-1, an out_dir that is a file or on a read-only file system, a
config file that is not UTF-8, inf / nan in a config given to cost.py --memory, a failed first
save. Run: python -m pytest tests/test_checks.py -q"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from plan import checks
from test_train import TINY, data_dir, one_line_error, train, train_injected  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, OMP_NUM_THREADS='1')
# train.py's defaults for the keys checks.settings reads
DEFAULTS = dict(eval_interval=200, log_interval=10, eval_iters=50, gradient_accumulation_steps=8, batch_size=8,
                block_size=1024, max_iters=None, stop_iter=None, warmup_iters=None, learning_rate=None,
                tokens_per_param=20.0, weight_decay=0.1, grad_clip=1.0, warmup_frac=0.1, min_lr_frac=0.1,
                attnres_eps=1e-5, dist_timeout=600, memory_gib=None, beta1=0.9, beta2=0.95, init_from='scratch',
                fast='auto', decay_on='all', auto_batch=False, fsdp=False, wandb_log=False)


def refused(fn, *args):
    """The one line a check fails with (checkpoint.fail: SystemExit('error: ...'))."""
    with pytest.raises(SystemExit) as e:
        fn(*args)
    msg = str(e.value.code)
    assert msg.startswith('error: ') and '\n' not in msg, msg
    return msg


def test_the_defaults_pass():
    assert checks.settings(dict(DEFAULTS)) is None


@pytest.mark.parametrize('key, inside, past', [
    ('beta1', [0.0, 0.5, 0.999999], [1.0, 1.5, -0.1]),     # AdamW: a decay rate in [0, 1)
    ('beta2', [0.0, 0.95, 0.999999], [1.0, -0.1, 2.0]),
    ('warmup_frac', [0.0, 1.0], [1.0000001, -1e-9]),         # fractions in [0, 1]
    ('min_lr_frac', [0.0, 1.0], [1.0000001, -0.5]),
    ('memory_gib', [None, 1e-3, 80.0], [0.0, -1.0]),         # GiB, > 0 (None: the device's own)
    ('learning_rate', [None, 1e-12], [0.0, -1.0]),           # > 0
    ('max_iters', [None, 1], [0, -5]),                       # counts >= 1
    ('stop_iter', [None, 1], [0]),
    ('warmup_iters', [None, 0], [-1]),                       # >= 0
    ('grad_clip', [0.0, 1.0], [-1e-9]),
    ('dist_timeout', [1e-3], [0, -1]),
    ('attnres_eps', [1e-12], [0.0]),
])
def test_each_range_takes_its_boundary_and_refuses_just_past_it(key, inside, past):
    for v in inside:
        assert checks.settings(dict(DEFAULTS, **{key: v})) is None, (key, v)
    for v in past:
        msg = refused(checks.settings, dict(DEFAULTS, **{key: v}))
        assert f"{key}={v:g} must be" in msg, msg


def test_a_beta_out_of_range_says_what_the_beta_is():
    assert refused(checks.settings, dict(DEFAULTS, beta1=1.5)) == \
        "error: beta1=1.5 must be in [0, 1) (AdamW's decay rate of the gradient's mean)"
    assert refused(checks.settings, dict(DEFAULTS, beta2=-0.1)) == \
        "error: beta2=-0.1 must be in [0, 1) (AdamW's decay rate of its square)"
    assert refused(checks.settings, dict(DEFAULTS, memory_gib=-1)) == \
        "error: memory_gib=-1 must be > 0 (the memory the plan is held against, in GiB)"
    assert refused(checks.settings, dict(DEFAULTS, batch_size=0)) == "error: batch_size=0 must be >= 1"


@pytest.mark.parametrize('key, value, words', [('init_from', 'resum', "init_from='resum'"),
                                               ('decay_on', 'vectors', "decay_on='vectors'"),
                                               ('fast', 'maybe', "fast must be 'auto', True or False")])
def test_words_outside_their_choices_are_refused(key, value, words):
    assert words in refused(checks.settings, dict(DEFAULTS, **{key: value}))


def test_auto_batch_under_fsdp_and_wandb_without_the_package(monkeypatch):
    assert 'auto_batch=True plans an unsharded model' in refused(checks.settings,
                                                                 dict(DEFAULTS, auto_batch=True, fsdp=True))
    import importlib.util
    find = importlib.util.find_spec
    if find('wandb') is not None:  # installed: taken
        assert checks.settings(dict(DEFAULTS, wandb_log=True)) is None
    monkeypatch.setattr(importlib.util, 'find_spec', lambda name: None if name == 'wandb' else find(name))
    assert 'pip install wandb' in refused(checks.settings, dict(DEFAULTS, wandb_log=True))


def test_an_out_dir_that_is_a_file_or_lies_under_one_is_refused(tmp_path):
    f = tmp_path / 'afile'
    f.write_text('x')
    assert f"{f} is a file, not a folder" in refused(checks.out_dir, str(f))
    assert f"{f} is a file, not a folder" in refused(checks.out_dir, str(f / 'run' / 'deeper'))
    assert checks.out_dir(str(tmp_path / 'new' / 'run')) is None and not (tmp_path / 'new').exists()  # creates nothing


def test_an_out_dir_this_user_cannot_write_is_named_as_such(tmp_path, monkeypatch):
    """No write permission on a writable file system: 'not writable by this user', not 'read-only'
    (the read-only mount itself: test_train_refuses_an_out_dir_on_a_read_only_file_system)."""
    monkeypatch.setattr(os, 'access', lambda path, mode: False)
    msg = refused(checks.out_dir, str(tmp_path / 'run'))
    assert f"{tmp_path} is not writable by this user" in msg and 'read-only' not in msg


def test_token_id_equal_to_the_vocab_size_is_refused_one_below_is_not(tmp_path, monkeypatch):
    """Ids 0..vocab_size-1 embed; an id of vocab_size is one past the table (read in chunks: the
    largest id sits in the last, short chunk here)."""
    monkeypatch.setattr(checks, 'CHUNK', 1000)
    path = tmp_path / 'train.bin'
    ids = np.zeros(2 * 1000 + 10, dtype=np.uint16)
    ids[-1] = 257
    ids.tofile(path)
    assert 'holds token id 257, past the model\'s vocab_size=257' in refused(checks.token_ids, [str(path)], 257, {},
                                                                            'meta.json')
    assert checks.token_ids([str(path)], 258, {}, 'meta.json') is None
    assert checks.token_ids([str(path)], 258, {'vocab_size': 258}, 'meta.json') is None  # the data's own size
    assert 'smaller than the data' in refused(checks.token_ids, [str(path)], 258, {'vocab_size': 300}, 'meta.json')


def test_a_resume_past_max_iters_or_of_a_finished_run_is_refused(tmp_path):
    assert checks.finished(3, 4, str(tmp_path)) is None
    assert checks.finished(4, 4, str(tmp_path)) is None  # killed before summary.json: the resume completes it
    assert 'max_iters is behind it' in refused(checks.finished, 5, 4, str(tmp_path))
    (tmp_path / 'summary.json').write_text('{}')
    assert 'the run is finished' in refused(checks.finished, 4, 4, str(tmp_path))


def test_fast_paths_note_only_when_they_differ():
    assert checks.fast_paths(None, ['a']) is None and checks.fast_paths(['a'], ['a']) is None
    assert 'differ' in checks.fast_paths(['a'], []) and '(none)' in checks.fast_paths([], ['a'])


def test_accumulation_the_processes_do_not_divide_is_refused():
    assert checks.accumulation(8, 4) == 2
    assert 'not divisible by the 3 processes' in refused(checks.accumulation, 8, 3)


def test_gpu_sized_note_at_its_two_limits():
    """50M parameters and 65,536 tokens per iteration are still a CPU run; one past either is not."""
    assert checks.gpu_sized(64, 2, 257, None, 65536) is None
    assert 'sized for a GPU' in checks.gpu_sized(64, 2, 257, None, 65537)
    # d = 1024: SwiGLU 16 ceil(8d/3/16) = 2736; 32 (4 d^2 + 3 d 2736) + 2 x 50280 d = 506,150,912 parameters
    assert 'about 506M parameters' in checks.gpu_sized(1024, 32, 50280, None, 1024)
    assert 'about 338M parameters' in checks.gpu_sized(1024, 32, 50280, 1024, 1024)  # 32 x 7 d^2 + 2 x 50280 d


# -----------------------------------------------------------------------------
# end to end: each bad input is one line, before the model is built

@pytest.mark.parametrize('arg, words', [('--beta1=1.5', 'beta1=1.5 must be in [0, 1)'),
                                        ('--beta2=-0.1', 'beta2=-0.1 must be in [0, 1)'),
                                        ('--memory_gib=-1', 'memory_gib=-1 must be > 0')])
def test_train_refuses_bad_optimizer_and_memory_settings_before_building(arg, words, data_dir, tmp_path):
    r = train(*TINY, f'--data_dir={data_dir}', f'--out_dir={tmp_path / "run"}', arg, check=False)
    one_line_error(r, words)
    assert 'model:' not in r.stdout and not (tmp_path / 'run').exists()


def test_train_refuses_an_out_dir_that_is_a_file(data_dir, tmp_path):
    f = tmp_path / 'taken'
    f.write_text('not a folder')
    one_line_error(train(*TINY, f'--data_dir={data_dir}', f'--out_dir={f}', check=False), 'is a file, not a folder')
    assert f.read_text() == 'not a folder'


def can_mount_read_only(tmp_path):
    d = tmp_path / 'probe_ro'
    d.mkdir()
    return shutil.which('unshare') and subprocess.run(
        ['unshare', '-rm', 'sh', '-c', f'mount -t tmpfs -o ro tmpfs {d}'], capture_output=True).returncode == 0


def test_train_refuses_an_out_dir_on_a_read_only_file_system(data_dir, tmp_path):
    """A real read-only mount (a tmpfs mounted ro in a user and mount namespace of its own)."""
    if not can_mount_read_only(tmp_path):
        pytest.skip('no user namespaces here to mount a read-only file system')
    ro = tmp_path / 'ro'
    ro.mkdir()
    cmd = ' '.join([sys.executable, 'train.py', *TINY, f'--data_dir={data_dir}', f'--out_dir={ro}/run'])
    r = subprocess.run(['unshare', '-rm', 'sh', '-c', f'mount -t tmpfs -o ro tmpfs {ro} && exec {cmd}'], cwd=REPO,
                       capture_output=True, text=True, env=ENV, timeout=300)
    one_line_error(r, f'{ro} is on a read-only file system', 'an --out_dir you can write to')


def test_train_refuses_a_config_file_that_is_not_utf8(data_dir, tmp_path):
    cfg = tmp_path / 'latin1.py'
    cfg.write_bytes('# réglages\nn_layer = 2\n'.encode('latin-1'))
    r = train(str(cfg), *TINY, f'--data_dir={data_dir}', f'--out_dir={tmp_path / "run"}', '--max_iters=1', check=False)
    one_line_error(r, 'is not UTF-8 text (byte 3)', str(cfg))


@pytest.mark.parametrize('text, words', [("batch_size = float('inf')\n", "batch_size = inf must be a whole number"),
                                         ("block_size = float('nan')\n", "block_size = nan must be a whole number"),
                                         ("n_layer = 2.5\n", "n_layer = 2.5 must be a whole number"),
                                         ("attnres_eps = float('inf')\n", "attnres_eps = inf is not a finite number"),
                                         (b'n_layer = 2  # \xe9\n', 'is not UTF-8 text')])
def test_cost_memory_refuses_a_config_it_cannot_plan(text, words, tmp_path):
    cfg = tmp_path / 'c.py'
    cfg.write_bytes(text if isinstance(text, bytes) else text.encode())
    r = subprocess.run([sys.executable, 'cost.py', f'--memory={cfg}'], cwd=REPO, capture_output=True, text=True,
                       env=ENV, timeout=300)
    assert r.returncode == 1 and r.stderr.strip().count('\n') == 0 and words in r.stderr, r.stderr


# the n-th torch.save fails as a full disk does (nothing written)
DISK_FULL_AT = """
import errno, torch
_save, _calls = torch.save, [0]
def _full(obj, f, *a, **k):
    _calls[0] += 1
    if _calls[0] == {n}:
        raise OSError(errno.ENOSPC, 'No space left on device')
    return _save(obj, f, *a, **k)
torch.save = _full
"""


def test_a_failed_first_save_does_not_send_the_user_to_a_resume(data_dir, tmp_path):
    """The first write (ckpt_best.pt at iteration 0) fails: there is no checkpoint to resume from,
    so the line says to run the command again; the second (ckpt.pt at 2) fails with one to resume."""
    out = tmp_path / 'run'
    args = [*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=4', '--eval_interval=2']
    r = train_injected(DISK_FULL_AT.format(n=1), *args)
    one_line_error(r, 'the disk is full', 'run the same command again (no checkpoint to resume from yet)')
    assert 'resume;' not in r.stderr and 'and resume' not in r.stderr
    r = train_injected(DISK_FULL_AT.format(n=3), *TINY, f'--data_dir={data_dir}', f'--out_dir={tmp_path / "two"}',
                       '--max_iters=4', '--eval_interval=1')  # saves: best at 0, ckpt at 1, then ckpt at 2 fails
    one_line_error(r, 'the disk is full', 'and resume;', 'ckpt.pt (the last complete checkpoint) is kept')
