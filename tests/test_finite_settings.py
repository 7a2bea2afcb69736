"""Settings that are not numbers: nan and inf (and ints too large for a float) given to any
float setting, on the command line or in a config file, of train.py, bench.py (configurator.py)
and cost.py (argparse, configurator.finite_float), are refused in one line naming the key.
Run: python -m pytest tests/test_finite_settings.py -q"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from configurator import ConfigError, configure, finite_float  # noqa: E402

KEYS = ['learning_rate', 'n_layer', 'init_from']


def fresh():
    return dict(learning_rate=6e-4, n_layer=12, init_from=None)


@pytest.mark.parametrize('arg', ['--learning_rate=1e999', '--learning_rate=-1e999', '--learning_rate=nan',
                                 '--learning_rate=-inf', '--learning_rate=1' + '0' * 400])
def test_command_line_non_finite_float_is_refused(arg):
    g = fresh()
    with pytest.raises(ConfigError) as e:
        configure(g, KEYS, [arg])
    msg = str(e.value)
    assert '\n' not in msg and 'learning_rate' in msg and 'not a finite number' in msg, msg
    assert g == fresh()  # nothing applied


@pytest.mark.parametrize('text', ["learning_rate = float('nan')\n", "import math\nlearning_rate = -math.inf\n",
                                  "init_from = float('inf')\n"])  # a None default with no declared type too
def test_config_file_non_finite_float_is_refused(tmp_path, text):
    path = tmp_path / 'c.py'
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"c\.py: (learning_rate|init_from) = -?(nan|inf) is not a finite number"):
        configure(fresh(), KEYS, [str(path)])


def test_finite_floats_still_pass(tmp_path):
    g = fresh()
    (tmp_path / 'c.py').write_text("learning_rate = 1e308\n")
    configure(g, KEYS, [str(tmp_path / 'c.py')])
    assert g['learning_rate'] == 1e308
    configure(g, KEYS, ['--learning_rate=1'])
    assert g['learning_rate'] == 1.0 and type(g['learning_rate']) is float


def one_line(r, *words):
    assert r.returncode != 0 and 'Traceback' not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error:'), r.stderr
    assert all(w in lines[0] for w in words), lines[0]


def test_train_refuses_non_finite_settings(tmp_path):
    """Before the optimizer sees them (it would raise a traceback)."""
    env = dict(os.environ, OMP_NUM_THREADS='1')
    run = lambda *a: subprocess.run([sys.executable, 'train.py', '--device=cpu', *a], cwd=REPO,
                                    capture_output=True, text=True, env=env, timeout=300)
    one_line(run('--beta1=1e999'), 'beta1 = inf is not a finite number')
    (tmp_path / 'nan.py').write_text("learning_rate = float('nan')\n")
    one_line(run(str(tmp_path / 'nan.py')), 'nan.py', 'learning_rate = nan is not a finite number')


def test_bench_refuses_non_finite_settings(capsys):
    import bench
    with pytest.raises(SystemExit) as e:
        bench.main(['--learning_rate=inf'])
    assert str(e.value.code).startswith('error:') and 'learning_rate = inf is not a finite number' in str(e.value.code)


@pytest.mark.parametrize('value', ['nan', 'inf', '-inf', 'NaN', '1e999'])
def test_cost_refuses_a_non_finite_budget(value, capsys):
    import cost
    with pytest.raises(SystemExit) as e:
        cost.main(['--memory=config/does_not_matter.py', f'--budget_gib={value}'])
    assert e.value.code == 2  # argparse's usage error: no plan is computed
    err = capsys.readouterr().err
    assert 'Traceback' not in err
    assert err.strip().splitlines()[-1].endswith(f"error: argument --budget_gib: {value!r} is not a finite number")


def test_finite_float():
    assert finite_float('2.5') == 2.5 and finite_float('-1e-3') == -1e-3
    for text, words in (('nan', 'not a finite number'), ('inf', 'not a finite number'), ('two', 'not a number')):
        with pytest.raises(argparse.ArgumentTypeError, match=words):
            finite_float(text)


@pytest.mark.parametrize('argv', [['tools/gpu_check.py', '--budget=nan'],
                                  ['data/fineweb_edu/prepare.py', '--val_fraction=inf']])
def test_the_other_tools_refuse_a_non_finite_float(argv):
    r = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and 'Traceback' not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].endswith(f"{argv[1].split('=')[1]!r} is not a finite number"), r.stderr
