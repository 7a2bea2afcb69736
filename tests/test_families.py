"""
Tests of study/families.py: the parameter formula against the paper's Table 3 and the real
model, the derived shapes (fixed backbone, cross-scale, mini), and the generated
config files (in sync with the tables, loadable by train.py's configurator).

    python -m pytest tests/test_families.py -q
"""

import ast
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from study import families  # noqa: E402
from study.families import backbone_params, param_count_preln, runs  # noqa: E402

# train.py's config keys (the documented contract); the test also checks them against
# train.py itself when it is there
TRAIN_KEYS = {
    'out_dir', 'eval_interval', 'log_interval', 'eval_iters', 'init_from', 'dataset',
    'gradient_accumulation_steps', 'batch_size', 'block_size', 'n_layer', 'n_head', 'n_kv_head',
    'n_embd', 'ffn_hidden', 'residual', 'learning_rate', 'max_iters', 'tokens_per_param',
    'weight_decay', 'warmup_frac', 'min_lr_frac', 'device', 'dtype', 'compile', 'seed', 'fsdp', 'fast',
    'attnres_blocks',
}

# the paper's Table 3: L, d, d/L, backbone (M), total (M), as printed there
MAIN_TABLE = [
    (16, 1216, 76.00, 284, 407),
    (20, 1120, 56.00, 301, 414),
    (24, 1024, 42.67, 302, 405),
    (28, 960, 34.29, 310, 406),
    (32, 896, 28.00, 309, 399),
    (42, 800, 19.05, 324, 404),
    (70, 640, 9.14, 345, 409),
]


def test_ffn_hidden_rounds_8d_over_3_up_to_16():
    assert families.ffn_hidden(1216) == 3248  # 8*1216/3 = 3242.67 -> 203 * 16
    assert families.ffn_hidden(768) == 2048  # exact: 8*768/3 = 2048
    assert families.ffn_hidden(96) == 256
    for d in range(32, 2048, 32):
        h = families.ffn_hidden(d)
        assert h % 16 == 0 and 8 * d / 3 <= h < 8 * d / 3 + 16


@pytest.mark.parametrize("L, d, ratio, backbone_m, total_m", MAIN_TABLE)
def test_main_table_reproduces_design(L, d, ratio, backbone_m, total_m):
    assert round(backbone_params(L, d) / 1e6) == backbone_m
    assert round(param_count_preln(L, d) / 1e6) == total_m
    assert round(d / L, 2) == ratio


def test_main_family_shapes_and_exact_total():
    assert round(param_count_preln(24, 1024) / 1e6, 2) == 405.41  # paper Sec. 2.2, Table 3
    shapes = {(r.L, r.d) for r in runs('main')}
    assert shapes == {(L, d) for L, d, *_ in MAIN_TABLE}
    by_depth = {}
    for r in runs('main'):
        by_depth.setdefault(r.L, set()).add(r.scheme)
    for L in (16, 20, 24, 28, 32):
        assert by_depth[L] == set(families.SCHEMES)  # all ten schemes at L = 16..32
    for L in (42, 70):
        assert {'preln', 'attnres', 'hc'} <= by_depth[L]
    assert len(families.SCHEMES) == 10


def test_gqa_attention_term():
    d = 2048
    # MHA: 4d² attention; GQA 16/8: q, o = 2d², k, v = 2·d·8·(d/16) = d²
    assert backbone_params(1, d, d_ff=3 * d) == 4 * d * d + 9 * d * d + 2 * d
    assert backbone_params(1, d, d_ff=3 * d, n_kv_head=8) == 3 * d * d + 9 * d * d + 2 * d
    assert backbone_params(3, 96, n_kv_head=None) == backbone_params(3, 96, n_kv_head=16)
    with pytest.raises(ValueError, match="n_kv_head"):
        backbone_params(2, 96, n_head=16, n_kv_head=5)


@pytest.mark.parametrize("L, d, n_head, n_kv, d_ff, V", [
    (2, 64, 4, None, None, 257),
    (3, 96, 4, 2, 288, 257),
    (2, 128, 16, 8, None, 1000),
])
def test_formula_matches_the_model(L, d, n_head, n_kv, d_ff, V):
    model = pytest.importorskip('model')
    cfg = model.GPTConfig(vocab_size=V, block_size=32, n_layer=L, n_embd=d, n_head=n_head,
                          n_kv_head=n_kv, ffn_hidden=d_ff, residual='preln')
    assert model.GPT(cfg).num_params() == param_count_preln(L, d, V=V, d_ff=d_ff, n_kv_head=n_kv, n_head=n_head)


def test_fixed_backbone_widths():
    got = [(r.L, r.d) for r in runs('fixed_backbone', schemes=['preln'])]
    assert got == [(16, 1248), (24, 1024), (32, 896), (42, 768), (70, 608), (84, 544)]
    for r in runs('fixed_backbone'):
        assert abs(r.backbone / 300e6 - 1) < 0.05  # ≈300M backbone at every depth
        assert r.d % 32 == 0


def test_shared_runs_point_at_main():
    main = {r.name: r for r in runs('main')}
    fb = {r.name: r for r in runs('fixed_backbone')}
    # L=24, d=1024 is the same run in both families: one out_dir, trained once
    assert fb['preln_L24'].out_dir == main['preln_L24'].out_dir == 'out/main/preln_L24'
    assert fb['preln_L24'].info['shared_with'] == 'config/preln_L24.py'
    assert fb['preln_L16'].out_dir == 'out/fixed_backbone/preln_L16'  # d=1248 is not a main shape
    cs = {r.name: r for r in runs('cross_scale')}
    assert cs['attnres_400M_L32'].out_dir == main['attnres_L32'].out_dir
    assert cs['attnres_200M_L24'].out_dir == 'out/cross_scale/attnres_200M_L24'


def test_cross_scale_rule():
    rows = runs('cross_scale', schemes=['preln'])
    assert len(rows) == 12
    for r in rows:
        target, ratio = r.info['target_total'], r.info['target_ratio']
        assert abs(r.total / target - 1) <= 0.05
        assert abs(r.ratio / ratio - 1) < 0.05
        assert r.d % 32 == 0 and (r.d // 16) % 2 == 0
    # at 400M the rule lands on the main family's shapes
    at400 = {r.info['target_ratio']: (r.L, r.d) for r in rows if r.info['target_total'] == 400e6}
    assert at400 == {28: (32, 896), 43: (24, 1024), 76: (16, 1216)}
    # deeper for a smaller ratio at every size, and larger totals are deeper at a fixed ratio
    for total in families.CROSS_SCALE_TOTALS:
        depths = [r.L for r in rows if r.info['target_total'] == total]
        assert depths == sorted(depths, reverse=True)
    with pytest.raises(ValueError, match="tol"):
        families.cross_scale_shape(1e3, 43)


def test_cross_scale_rule_is_optimal_for_one_target():
    # brute force over every (L, d) within 5% of 300M: none has d/L closer to 43
    L, d = families.cross_scale_shape(300e6, 43)
    best = abs(math.log(d / L / 43))
    for L2 in range(1, 100):
        for d2 in range(32, 4096, 32):
            if abs(param_count_preln(L2, d2) / 300e6 - 1) <= 0.05:
                assert abs(math.log(d2 / L2 / 43)) >= best - 1e-12


def test_onepointsix():
    rows = runs('onepointsix')
    assert {(r.L, r.d) for r in rows} == {(28, 2048), (40, 1728), (54, 1504)}
    for r in rows:
        c = r.config
        assert c['n_kv_head'] == 8 and c['n_head'] == 16 and c['ffn_hidden'] == 3 * r.d
        assert c['learning_rate'] == 5e-4
        assert abs(r.total / 1.6e9 - 1) < 0.02
        assert c['batch_size'] * c['gradient_accumulation_steps'] == 512


def test_recipe_and_learning_rates():
    for r in runs('main'):
        c = r.config
        assert c['batch_size'] * c['gradient_accumulation_steps'] * c['block_size'] == 512 * 2048
        assert c['tokens_per_param'] == 20.0 and c['dataset'] == 'fineweb_edu'
    lr = {r.scheme: r.config['learning_rate'] for r in runs('main', shapes=[16])}
    assert lr['deepnorm'] == 1e-3 and lr['lns'] == 1e-2 and lr['preln'] == lr['attnres'] == 2e-3


# the paper's Table 4, written out by hand: the peak LR of each of the study's ten schemes
TABLE4_PEAK_LR = dict(preln=2e-3, sandwich=2e-3, lns=1e-2, deepnorm=1e-3, keel=2e-3, hc=2e-3, mhc=2e-3,
                      attnres=2e-3, blockattnres=2e-3, moda=2e-3)


def test_peak_lr_is_the_scheme_class_attribute(monkeypatch):
    """Each scheme's peak LR is written once, as its class's peak_lr: the study's values
    are Table 4's, and a changed class attribute is what the generated runs use."""
    residuals = pytest.importorskip('residuals')
    assert {s: residuals.RESIDUALS[s].peak_lr for s in families.SCHEMES} == TABLE4_PEAK_LR
    assert families.SCHEME_LR == {s: cls.peak_lr for s, cls in residuals.RESIDUALS.items()}
    monkeypatch.setattr(residuals.RESIDUALS['hc'], 'peak_lr', 7e-4)
    lr = {r.scheme: r.config['learning_rate'] for r in runs('main', shapes=[16])}
    assert lr['hc'] == 7e-4 and lr['attnres'] == 2e-3
    with pytest.raises(ValueError, match="unknown scheme"):
        families.peak_lr('nope')


def test_a_scheme_registered_elsewhere_does_not_disturb_the_families(monkeypatch):
    """A scheme added to residuals.RESIDUALS but to no family: families and their configs
    are unchanged, and its peak LR is read from its class."""
    residuals = pytest.importorskip('residuals')

    class Toy(residuals.PreLN):
        peak_lr = 3e-3

    before = [(r.name, r.config) for r in runs('main')]
    monkeypatch.setitem(residuals.RESIDUALS, 'toy', Toy)
    assert families.peak_lr('toy') == 3e-3
    assert [(r.name, r.config) for r in runs('main')] == before


def test_mini_family():
    rows = runs('mini')
    assert len({r.L for r in rows}) >= 3 and {'preln', 'attnres', 'hc'} <= {r.scheme for r in rows}
    backbones = [r.backbone for r in rows]
    assert max(backbones) / min(backbones) < 1.25  # ≈ constant backbone
    for r in rows:
        c = r.config
        assert r.d % 16 == 0 and r.d // c['n_head'] >= 16 and (r.d // c['n_head']) % 2 == 0
        assert (c['dataset'], c['block_size'], c['device'], c['compile'], c['dtype']) == \
            ('fineweb_edu_byte', 256, 'cpu', False, 'float32')
        tokens = c['max_iters'] * c['batch_size'] * c['gradient_accumulation_steps'] * c['block_size']
        assert tokens / r.backbone == pytest.approx(families.MINI_TOKENS_PER_PARAM, rel=0.01)
        assert r.total == param_count_preln(r.L, r.d, V=257, n_head=c['n_head'])


def test_unknown_names_are_errors():
    with pytest.raises(ValueError, match="choose one of"):
        runs('nope')
    with pytest.raises(ValueError, match="no scheme"):
        runs('fixed_backbone', schemes=['sandwich'])
    with pytest.raises(ValueError, match="no depth"):
        runs('main', shapes=[17])


# -----------------------------------------------------------------------------
# generated config files

def _config_files():
    return sorted(p for p in (REPO / 'config').rglob('*.py') if not p.name.startswith('cpu_'))


def test_generated_configs_are_in_sync(tmp_path):
    written = families.write_configs(root=tmp_path)
    expected = {r.config_path for r in families.all_runs()}
    assert set(written) == expected
    assert (tmp_path / 'config' / 'attnres_L32.py').exists()
    assert (tmp_path / 'config' / 'mini' / 'hc_L8.py').exists()
    for rel in expected:
        repo_file = REPO / rel
        assert repo_file.exists(), f"{rel} missing: run `python study/families.py`"
        assert repo_file.read_text() == (tmp_path / rel).read_text(), f"{rel} out of sync: run `python study/families.py`"
    on_disk = {p.relative_to(REPO).as_posix() for p in _config_files()}
    stale = {rel for rel in on_disk if families.GENERATED_MARK in (REPO / rel).read_text()} - expected
    assert not stale, f"generated config files no family defines: {sorted(stale)}"
    assert families.write_configs(root=tmp_path, check=True) == []


def test_write_configs_check_and_stale(tmp_path):
    families.write_configs(root=tmp_path)
    p = tmp_path / 'config' / 'preln_L16.py'
    p.write_text(p.read_text().replace('n_embd = 1216', 'n_embd = 1200'))
    stale = tmp_path / 'config' / 'preln_L99.py'
    stale.write_text(f"{families.GENERATED_MARK}\nn_layer = 99\n")
    hand = tmp_path / 'config' / 'cpu_quick.py'
    hand.write_text(f"{families.GENERATED_MARK}\nn_layer = 2\n")  # cpu_* are never touched
    assert sorted(families.write_configs(root=tmp_path, check=True)) == ['config/preln_L16.py', 'config/preln_L99.py']
    families.write_configs(root=tmp_path)
    assert 'n_embd = 1216' in p.read_text() and not stale.exists() and hand.exists()


def _train_defaults():
    """train.py's module-level literal defaults (None where not a literal), or None without train.py."""
    path = REPO / 'train.py'
    if not path.exists():
        return None
    defaults = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                defaults[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                defaults[node.targets[0].id] = None  # e.g. device = 'cuda' if ... else 'cpu'
    return defaults


def test_every_config_file_executes_with_known_keys():
    files = _config_files()
    assert len(files) == len(families.all_runs())
    defaults = _train_defaults()
    for path in files:
        ns = {}
        exec(compile(path.read_text(), str(path), 'exec'), ns)
        keys = {k for k in ns if not k.startswith('_')}
        assert keys <= TRAIN_KEYS, f"{path}: unknown keys {keys - TRAIN_KEYS}"
        assert {'out_dir', 'residual', 'n_layer', 'n_embd'} <= keys
        if defaults is not None:
            assert keys <= set(defaults), f"{path}: keys not in train.py: {keys - set(defaults)}"
            for k in keys:  # the configurator's rule: same type as train.py's default
                if defaults[k] is not None:
                    ok = isinstance(ns[k], type(defaults[k])) or (type(defaults[k]) is float and type(ns[k]) is int) \
                        or (k == 'fast' and isinstance(ns[k], bool))  # fast: 'auto' | True | False
                    assert ok, f"{path}: {k} = {ns[k]!r}, train.py's default is {defaults[k]!r}"


def test_config_file_matches_its_run():
    for r in families.all_runs():
        ns = {}
        exec((REPO / r.config_path).read_text(), ns)
        assert {k: v for k, v in ns.items() if not k.startswith('_')} == r.config
    text = (REPO / 'config' / 'attnres_L32.py').read_text()
    assert "16 x 32 = 512 sequences x 2048 tokens = 1,048,576 tokens per step" in text
    assert "399,358,848" in text and "python study/families.py" in text


def test_help_prints_usage_and_writes_nothing():
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, 'study/families.py', '--help'], cwd=repo, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith('usage: python study/families.py [--check]')
    assert 'wrote' not in r.stdout and 'unknown' not in r.stdout + r.stderr
