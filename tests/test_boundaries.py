"""Single values the suite did not pin, each at the boundary a realistic bug would move: MoDA's
depth slots read per block and its W_kv init, MFU over several devices, the study's 1% token
budget and its short trials left unprobed, train.py's divergence warning at 1.5x and a stop_iter
at or past max_iters, a bool given for a float setting, the byte tokenizer's end of text.
Each test names the bug it catches. Run: python -m pytest tests/test_boundaries.py -q"""

import json
import sys
from pathlib import Path

import pytest
import torch

import model as model_py
import residuals
from configurator import ConfigError, configure
from model import GPT, GPTConfig

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / 'tests'))


# -----------------------------------------------------------------------------
# residuals.py: MoDA

def test_moda_block_p_reads_exactly_its_2p_earlier_depth_slots():
    """Block p reads the 2p slots blocks 0..p-1 wrote (their attention k/v and W_kv outputs):
    2, 4, 6 at L = 4, block 0 plain attention. Bug caught: one slot fewer (2p - 1), which drops
    the previous block's W_kv slot without any error."""
    torch.manual_seed(0)
    m = GPT(GPTConfig(residual='moda', n_layer=4, n_embd=32, n_head=4, n_kv_head=2, block_size=16, vocab_size=64))
    res, read = m.residual, []
    plain = residuals.MoDA.attention
    res.attention = lambda q, k, v, dk, dv: read.append((dk.size(3), dk[:, :, :, -1].clone())) or \
        plain(res, q, k, v, dk, dv)
    with torch.no_grad():
        m(torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1)))
    assert [s for s, _ in read] == [2, 4, 6]
    for s, last in read:  # the last slot read is the previous block's W_kv output, not zero
        assert last.abs().sum() > 0, s


def test_moda_depth_kv_is_initialised_truncated_at_three_sigma():
    """W_kv like every backbone Linear: trunc_normal(0, init_std) cut at +-3 sigma. Bug caught:
    an untruncated normal (of 2 x 256 x 256 draws, ~350 would pass 3 sigma)."""
    torch.manual_seed(0)
    cfg = GPTConfig(residual='moda', n_layer=2, n_embd=256, n_head=4, block_size=16, vocab_size=64)
    w = GPT(cfg).residual.layers[0].depth_kv.weight
    std = cfg.init_std
    assert w.numel() == 2 * 256 * 256
    assert w.abs().max().item() <= 3 * std
    assert w.std().item() == pytest.approx(std * 0.986, rel=0.02)  # a normal cut at 3 sigma: std x 0.9866


# -----------------------------------------------------------------------------
# model.py: MFU

def test_mfu_divides_by_the_peak_of_every_device(monkeypatch):
    """8 devices at 8x the tokens/s of one have the MFU of one. Bug caught: one device's peak
    for many (an MFU 8x too high)."""
    monkeypatch.setattr(model_py, 'peak_flops', lambda device: 1e12)
    m = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=64))
    one = model_py.estimate_mfu(m, 1000.0, 16, 'cuda', 1)
    assert one == pytest.approx(m.flops_per_token(16) * 1000.0 / 1e12)
    assert model_py.estimate_mfu(m, 8000.0, 16, 'cuda', 8) == pytest.approx(one)
    assert model_py.estimate_mfu(m, 1000.0, 16, 'cuda', 4) == pytest.approx(one / 4)


# -----------------------------------------------------------------------------
# study/: the token budget's 1% and short trials

@pytest.mark.parametrize('tokens, planned', [(20_199, True), (19_801, True), (20_201, False), (19_799, False),
                                             (22_000, False)])
def test_the_token_budget_is_planned_within_1_percent(tokens, planned):
    """20 tokens per parameter of 1,000 parameters: 20,000 tokens within 1% (20,199) is the planned run, one
    token past is another length. Bug caught: a 10% tolerance taking a shortened trial."""
    from study.results import length_mismatch
    why = length_mismatch({'tokens_per_param': 20.0}, {'n_params': 1000, 'tokens': tokens})
    assert (why is None) == planned, why


def test_a_short_trial_is_neither_probed_nor_collected(tmp_path):
    """The mini family's L = 8 Pre-LN run finished at another max_iters than its config (a short
    trial in the real out_dir): probe_targets leaves it out, and the planned run is taken. Bug
    caught: the trial's checkpoint probed in place of the planned run's."""
    from study import families, mini
    from test_sweep import _write_summary
    families.write_configs(root=tmp_path)
    run = next(r for r in families.runs('mini', ['preln'], [mini.DEEPEST]))
    _write_summary(tmp_path, run.out_dir, 1.5, max_iters=7)  # a trial of 7 steps
    assert mini.probe_targets(str(tmp_path), seeds=1) == []
    _write_summary(tmp_path, run.out_dir, 1.5)  # the planned length
    assert [r.name for _, r, _ in mini.probe_targets(str(tmp_path), seeds=1)] == [run.name]


# -----------------------------------------------------------------------------
# train.py: divergence at 1.5x, stop_iter at max_iters

def test_the_divergence_warning_is_at_1_5x_the_best():
    """A validation loss of 1.5x the best is not yet a divergence; just past it is. Bug caught: 2x."""
    import ast
    tree = ast.parse((REPO / 'train.py').read_text())
    [ratio] = [n.value.value for n in tree.body if isinstance(n, ast.Assign)
               and [t.id for t in n.targets if isinstance(t, ast.Name)] == ['SPIKE_RATIO']]
    assert ratio == 1.5


def test_a_run_whose_val_loss_passes_1_5x_its_best_is_warned(tmp_path):
    """End to end: evaluations 4 on see the loss + 2 nats on a best of ~5.4 (1.37x: no warning) and
    then + 3 nats (1.55x: warned). Bug caught: a ratio of 2 (no warning at all here)."""
    from test_run_directory import EVAL_LOSS_FROM
    from test_train import data_dir as make_data, lines, TINY, train_injected  # noqa: F401
    data = tmp_path / 'data'
    data.mkdir()
    make_data.__wrapped__(type('F', (), {'mktemp': lambda self, name: data})())
    out = tmp_path / 'run'
    r = train_injected(EVAL_LOSS_FROM.format(n=3, add=2.0), *TINY, f'--data_dir={data}', f'--out_dir={out}',
                       '--max_iters=4', '--eval_interval=2', '--learning_rate=1e-4')
    assert r.returncode == 0, r.stderr[-2000:]
    vals = [json.loads(x) for x in (out / 'metrics.jsonl').read_text().splitlines()]
    vals = [m['val_loss'] for m in vals if 'val_loss' in m]
    assert vals[2] < 1.5 * min(vals[:2]) and not lines(r.stdout, 'warning: val loss'), vals
    r = train_injected(EVAL_LOSS_FROM.format(n=3, add=3.0), *TINY, f'--data_dir={data}', f'--out_dir={tmp_path / "b"}',
                       '--max_iters=4', '--eval_interval=2', '--learning_rate=1e-4')
    warned = lines(r.stdout, 'warning: val loss')
    assert len(warned) == 1 and 'x its best' in warned[0], r.stdout


@pytest.mark.parametrize('stop', [4, 9])
def test_stop_iter_at_or_past_max_iters_still_finishes_the_run(stop, tmp_path):
    """stop_iter = max_iters (or beyond) stops nothing early: the final evaluation runs and
    summary.json is written. Bug caught: a stop at max_iters that skips the final evaluation."""
    from test_train import data_dir as make_data, train, TINY  # noqa: F401
    data = tmp_path / 'data'
    data.mkdir()
    make_data.__wrapped__(type('F', (), {'mktemp': lambda self, name: data})())
    out = tmp_path / 'run'
    r = train(*TINY, f'--data_dir={data}', f'--out_dir={out}', '--max_iters=4', '--eval_interval=2',
              f'--stop_iter={stop}')
    assert 'iter 4: val loss' in r.stdout and 'stopped at iteration' not in r.stdout
    assert json.loads((out / 'summary.json').read_text())['iter'] == 4


# -----------------------------------------------------------------------------
# configurator.py: a bool is no float

@pytest.mark.parametrize('arg', ['--learning_rate=True', '--weight_decay=False'])
def test_a_bool_for_a_float_setting_is_refused(arg):
    """bool is a subclass of int, and an int is taken for a float (--learning_rate=1 is 1.0): a
    bool must not slip through that door as 1.0 or 0.0."""
    g = {'learning_rate': None, 'weight_decay': 0.1}
    with pytest.raises(ConfigError, match='expects float'):
        configure(g, list(g), [arg], none_types={'learning_rate': float})
    configure(g, list(g), ['--weight_decay=1'], none_types={'learning_rate': float})
    assert g['weight_decay'] == 1.0 and type(g['weight_decay']) is float


# -----------------------------------------------------------------------------
# data/tokenizer.py: the byte tokenizer's edges

def test_the_byte_tokenizer_round_trips_every_byte_and_ends_text_with_id_256():
    """Ids 0..255 are the bytes, 256 the end of text (the vocabulary is 257): every byte value
    round-trips, and no byte is given the end-of-text id. Bug caught: an off-by-one at 255/256."""
    from data.tokenizer import get_tokenizer
    tok = get_tokenizer('byte')
    assert tok.n_vocab == 257 and tok.eot == 256
    text = bytes(range(256)).decode('latin-1')
    ids = tok.encode(text)
    assert max(ids) <= 255 and 256 not in ids
    assert tok.decode(tok.encode('naïve ✓')) == 'naïve ✓'
