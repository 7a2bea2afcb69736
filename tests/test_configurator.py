"""
Tests of configurator.py: config files, --key=value overrides, type checks, errors, --help.
Run: python -m pytest tests/test_configurator.py -q
"""

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from configurator import ConfigError, comments_from_source, configure  # noqa: E402

KEYS = ['n_layer', 'learning_rate', 'compile', 'device', 'init_from', 'out_dir']


def fresh():
    """A namespace like train.py's globals: declared keys plus unrelated names."""
    return dict(n_layer=12, learning_rate=6e-4, compile=True, device='cuda', init_from=None,
                out_dir='out', sys=sys, unrelated=[1, 2])


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_config_file_then_override(tmp_path, capsys):
    g = fresh()
    cfg = write(tmp_path, 'c.py', "import math\n_depth = 4\nn_layer = _depth * 8\nlearning_rate = 1e-3\n"
                                 "out_dir = 'out_' + str(n_layer)\ndef helper(): pass\n")
    changed = configure(g, KEYS, [cfg, '--n_layer=6', '--device=cpu'])
    # the override wins even though it is applied after the file; the file saw the old values
    assert g['n_layer'] == 6 and g['out_dir'] == 'out_32' and g['learning_rate'] == 1e-3
    assert g['device'] == 'cpu'  # a bare word falls back to the raw string
    assert changed == ['n_layer', 'learning_rate', 'out_dir', 'device']
    assert g['compile'] is True and g['init_from'] is None
    out = capsys.readouterr().out.splitlines()
    assert out == ["Overriding: n_layer = 6", "Overriding: learning_rate = 0.001",
                   "Overriding: out_dir = 'out_32'", "Overriding: device = 'cpu'"]


def test_config_files_in_order(tmp_path):
    g = fresh()
    a = write(tmp_path, 'a.py', "n_layer = 4\ndevice = 'cpu'\n")
    b = write(tmp_path, 'b.py', "n_layer = n_layer * 2\n")  # builds on a.py's value
    configure(g, KEYS, [a, b])
    assert g['n_layer'] == 8 and g['device'] == 'cpu'


def test_override_parsing_and_types():
    g = fresh()
    configure(g, KEYS, ['--learning_rate=1', '--compile=false', '--out_dir=2024'])
    assert g['learning_rate'] == 1.0 and type(g['learning_rate']) is float  # int accepted for float
    assert g['compile'] is False
    assert g['out_dir'] == '2024'  # a str key keeps the literal text
    configure(g, KEYS, ['--compile=True', '--n_layer=1_000'])
    assert g['compile'] is True and g['n_layer'] == 1000


def test_none_default_accepts_anything():
    g = fresh()
    configure(g, KEYS, ['--init_from=3'])
    assert g['init_from'] == 3
    g = fresh()
    configure(g, KEYS, ['--init_from=resume'])
    assert g['init_from'] == 'resume'


def test_none_default_with_a_declared_type(tmp_path):
    g = fresh()
    configure(g, KEYS, ['--init_from=2', '--init_from=None'], none_types={'init_from': int})
    assert g['init_from'] is None                                    # None stays allowed
    for arg in ('--init_from=3.5', '--init_from=True', '--init_from=resume'):
        with pytest.raises(ConfigError, match=r'init_from expects int \(default None\)'):
            configure(fresh(), KEYS, [arg], none_types={'init_from': int})
    cfg = tmp_path / 'c.py'
    cfg.write_text('init_from = 2_000_000 / 4096\n')                 # a float from a config file
    with pytest.raises(ConfigError, match='expects int'):
        configure(fresh(), KEYS, [str(cfg)], none_types={'init_from': int})
    g = fresh()
    configure(g, KEYS, ['--init_from=7'], none_types={'init_from': float})  # an int passes as a float
    assert g['init_from'] == 7.0 and isinstance(g['init_from'], float)
    g = fresh()
    configure(g, KEYS, ['--init_from=2024'], none_types={'init_from': str})  # a str key keeps the text
    assert g['init_from'] == '2024'


@pytest.mark.parametrize('arg, words', [
    ('--n_layer=3.5', ['n_layer', 'int', '3.5']),
    ('--compile=1', ['compile', 'bool', '1']),
    ('--compile=yes', ['compile', 'bool', 'yes']),
    ('--learning_rate=fast', ['learning_rate', 'float', 'fast']),
    ('--n_layer=True', ['n_layer', 'int', 'True']),
])
def test_type_mismatch(arg, words):
    g = fresh()
    with pytest.raises(ConfigError) as e:
        configure(g, KEYS, [arg])
    for w in words:
        assert w in str(e.value)
    assert g == fresh()  # nothing applied


def test_unknown_key_suggests_close_match():
    with pytest.raises(ConfigError, match="learning_rat.*did you mean learning_rate"):
        configure(fresh(), KEYS, ['--learning_rat=1e-3'])


def test_space_separated_value_is_an_error():
    with pytest.raises(ConfigError, match="--key=value"):
        configure(fresh(), KEYS, ['--n_layer', '4'])


def test_config_file_undeclared_key(tmp_path):
    cfg = write(tmp_path, 'bad.py', "n_layers = 4\n")
    g = fresh()
    with pytest.raises(ConfigError) as e:
        configure(g, KEYS, [cfg])
    msg = str(e.value)
    assert 'bad.py' in msg and "'n_layers'" in msg and 'n_layer' in msg.split('did you mean')[1]
    assert g == fresh()


def test_config_file_wrong_type(tmp_path):
    cfg = write(tmp_path, 'c.py', "compile = 'maybe'\n")
    with pytest.raises(ConfigError, match="c.py: compile expects bool"):
        configure(fresh(), KEYS, [cfg])
    g = fresh()
    configure(g, KEYS, [write(tmp_path, 'd.py', "learning_rate = 2\ncompile = 'FALSE'\n")])
    assert g['learning_rate'] == 2.0 and type(g['learning_rate']) is float and g['compile'] is False


def test_missing_config_file(tmp_path):
    missing = str(tmp_path / 'nope.py')
    with pytest.raises(ConfigError, match="not found: .*nope.py"):
        configure(fresh(), KEYS, [missing])
    with pytest.raises(ConfigError, match="--n_layer=4"):
        configure(fresh(), KEYS, ['n_layer=4'])  # forgot the dashes


def test_failing_config_file(tmp_path):
    cfg = write(tmp_path, 'c.py', "n_layer = 1 / 0\n")
    with pytest.raises(ConfigError, match="c.py failed: ZeroDivisionError"):
        configure(fresh(), KEYS, [cfg])


@pytest.mark.parametrize('flag', ['-h', '--help'])
def test_help_lists_keys_and_exits_0(flag, capsys):
    g = fresh()
    with pytest.raises(SystemExit) as e:
        configure(g, KEYS, ['--n_layer=4', flag], help_text={'n_layer': 'number of blocks'})
    assert e.value.code == 0
    out = capsys.readouterr().out
    for k in KEYS:
        assert f"{k} = {fresh()[k]!r}" in out
    assert re.search(r"n_layer = 12 +# number of blocks\n", out)
    assert g == fresh()  # help applies nothing


def test_comments_from_source(tmp_path):
    src = write(tmp_path, 'train_like.py', (
        "# I/O\n"
        "out_dir = 'out'  # where checkpoints go\n"
        "n_layer = 12 # number of blocks\n"
        "bias = False\n"
        "sizes = [\n    1, 2,\n]  # a multi-line value\n"
        "def f():\n    inner = 3  # not module level\n"
        "lr: float = 1e-3  # peak learning rate\n"
        "x = '# not a comment'\n"))
    assert comments_from_source(src) == {'out_dir': 'where checkpoints go', 'n_layer': 'number of blocks',
                                         'sizes': 'a multi-line value', 'lr': 'peak learning rate'}
