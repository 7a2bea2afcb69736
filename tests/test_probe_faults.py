"""probe.py where it used to be silently wrong: the tokenizer a run is labelled with (the
checkpoint's own record wins over a meta.json, whose disagreement is one line), path weights of
a scheme that does not say what its adds weigh (refused, never drawn as ones), and the late-pair
ratios R_causal / R_perm with scores that are not finite in the late pairs S_late.
Each expectation comes from an independent computation: branch outputs summed with the
claimed weights, a hand loop over S_late, a JSON round trip.
Run: python -m pytest tests/test_probe_faults.py -q"""

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import probe  # noqa: E402
import residuals  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

V = 257


def tiny(residual='preln', n_layer=2, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=V, block_size=32, n_layer=n_layer, n_head=2, n_embd=16, residual=residual)).eval()


def save_ckpt(path, model, **extra):
    """A checkpoint in train.py's format (the keys probe.py reads) plus `extra` keys."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({'model': model.state_dict(), 'model_args': dict(model.config.__dict__), 'iter_num': 3,
                'config': {'dataset': 'nowhere'}, **extra}, path)
    return path


def write_data(d, tokenizer=None, n=3000):
    """d/val.bin of byte-level ids, with a meta.json naming `tokenizer` (none if None)."""
    d.mkdir(parents=True, exist_ok=True)
    np.random.default_rng(0).integers(0, 256, n).astype(np.uint16).tofile(d / 'val.bin')
    if tokenizer:
        (d / 'meta.json').write_text(json.dumps({'tokenizer': tokenizer}))
    return d / 'val.bin'


ANGULAR = ['--metrics=angular', '--n_windows=2', '--seq_len=8', '--device=cpu']

# -----------------------------------------------------------------------------
# the tokenizer a run is labelled with


def notes(text):
    return [line for line in text.splitlines() if line.startswith('note:')]


def test_the_checkpoint_s_recorded_tokenizer_labels_the_results(tmp_path, capsys):
    """A byte-level run (its checkpoint records 'byte') probed on data whose meta.json says
    'gpt2': labelled 'byte', in probe.json too, and one note line names both."""
    val = write_data(tmp_path / 'data', tokenizer='gpt2')
    ckpt = save_ckpt(tmp_path / 'run' / 'ckpt.pt', tiny(), tokenizer='byte')
    res = probe.main([f'--ckpt={ckpt}', f'--val_bin={val}'] + ANGULAR)
    assert res['tokenizer'] == 'byte'
    assert json.loads((ckpt.parent / 'probe' / 'probe.json').read_text())['tokenizer'] == 'byte'
    out = capsys.readouterr().out
    [note] = notes(out)
    assert str(tmp_path / 'data' / 'meta.json') in note and "'gpt2'" in note and "records 'byte'" in note
    assert 'tokenizer byte' in out  # the first line names it too


def test_the_recorded_tokenizer_wins_over_the_meta_json_of_its_own_data_dir(tmp_path, capsys):
    """Its training data re-prepared since (meta.json now 'gpt2'), held-out data elsewhere
    without a meta.json: 'byte', one note line naming the training data's meta.json."""
    own = tmp_path / 'own'
    write_data(own, tokenizer='gpt2')
    val = write_data(tmp_path / 'elsewhere')
    ckpt = save_ckpt(tmp_path / 'run' / 'ckpt.pt', tiny(), tokenizer='byte', config={'data_dir': str(own)})
    assert probe.main([f'--ckpt={ckpt}', f'--val_bin={val}'] + ANGULAR)['tokenizer'] == 'byte'
    [note] = notes(capsys.readouterr().out)
    assert str(own / 'meta.json') in note and "records 'byte'" in note


def test_agreeing_or_unrecorded_tokenizers_say_nothing(tmp_path, capsys):
    """No disagreement, no note; a checkpoint recording none takes its data's meta.json."""
    val = write_data(tmp_path / 'data', tokenizer='byte')
    ckpt = save_ckpt(tmp_path / 'run' / 'ckpt.pt', tiny(), tokenizer='byte')
    assert probe.main([f'--ckpt={ckpt}', f'--val_bin={val}'] + ANGULAR)['tokenizer'] == 'byte'
    bare = save_ckpt(tmp_path / 'bare' / 'ckpt.pt', tiny())
    assert probe.main([f'--ckpt={bare}', f'--val_bin={val}'] + ANGULAR)['tokenizer'] == 'byte'
    assert notes(capsys.readouterr().out) == []
    assert probe.tokenizer_name_for({'tokenizer': 'byte', 'config': {}, 'model_args': {'vocab_size': 50280}},
                                    val) == 'byte'

# -----------------------------------------------------------------------------
# path weights: from what a scheme does, or refused


class HalfAdd(residuals.SingleStream):
    """h <- h + 0.5 F(RMSNorm(h)), built the way docs/new_scheme.md builds a scheme."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.layers = residuals.per_block(cfg, norm=residuals.rmsnorm)

    def sublayer(self, h, b, j, f):
        return h + 0.5 * f(self.layers[b].get('norm', j)(h))


class HalfPreLN(residuals.PreLN):
    """The same update under Pre-LN's name: it inherits unit_paths = True without saying it."""

    def sublayer(self, h, b, j, f):
        return super().sublayer(h, b, j, lambda x: 0.5 * f(x))


def branch_sums(model, idx):
    """The path weights checked against the forward pass: the input of every reader (each
    sublayer's pre-norm, the final norm) and the branch outputs v_1..v_2L (v_0 = embedding),
    recorded by hooks. Returns (readers (2L+1, N, d), sources (2L+1, N, d))."""
    readers, sources = [], [model.wte(idx).detach()]
    hooks = [m.register_forward_pre_hook(lambda m, a: readers.append(a[0].detach()))
             for layer in model.residual.layers for m in (layer.attn_norm, layer.mlp_norm)]
    hooks.append(model.norm_f.register_forward_pre_hook(lambda m, a: readers.append(a[0].detach())))
    for blk in model.blocks:
        for m in (blk.attn, blk.mlp):
            hooks.append(m.register_forward_hook(lambda m, a, out: sources.append(out.detach())))
    with torch.no_grad():
        model(idx)
    for h in hooks:
        h.remove()
    return torch.stack(readers).flatten(1, 2), torch.stack(sources).flatten(1, 2)


@pytest.mark.parametrize('residual', ['preln', 'lns'])
def test_unit_path_weights_rebuild_every_reader_s_input_from_the_branch_outputs(residual):
    """For a scheme that says its adds weigh 1, sum_i W[l, i] v_i is the input of reader l,
    every token, every reader (v from hooks on the branches, not from the trace)."""
    model = tiny(residual, n_layer=3)
    with torch.no_grad():
        for p in model.residual.parameters():
            p.mul_(1 + 0.3 * torch.randn(p.shape))
    idx = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(1))
    r = probe.path_weights(model, idx)
    assert r['kind'] == 'unit'
    readers, sources = branch_sums(model, idx)
    W = torch.tensor(np.nan_to_num(r['W']), dtype=sources.dtype)
    torch.testing.assert_close(torch.einsum('li,ind->lnd', W, sources), readers, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('scheme', [HalfAdd, HalfPreLN])
def test_path_weights_of_a_scheme_that_does_not_say_are_refused(scheme, tmp_path, monkeypatch, capsys):
    """h + 0.5 F(...): unit weights would not rebuild its readers' inputs (checked), so
    path_weights refuses in one line, and probe.py skips the metric with that line."""
    monkeypatch.setitem(residuals.RESIDUALS, 'halfadd', scheme)
    model = tiny('halfadd', n_layer=2)
    idx = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(1))
    readers, sources = branch_sums(model, idx)
    ones = torch.tril(torch.ones(len(readers), len(sources)))
    assert not torch.allclose(torch.einsum('li,ind->lnd', ones, sources), readers, atol=1e-3)  # not ones
    half = torch.tril(torch.full((len(readers), len(sources)), 0.5))
    half[:, 0] = 1.0  # the embedding is added once, with weight 1
    torch.testing.assert_close(torch.einsum('li,ind->lnd', half, sources), readers, rtol=1e-5, atol=1e-5)
    assert probe.path_weights_kind(model) is None
    with pytest.raises(ValueError) as e:
        probe.path_weights(model, idx)
    assert '\n' not in str(e.value) and 'halfadd' in str(e.value) and 'unit_paths' in str(e.value)
    val = write_data(tmp_path / 'data', tokenizer='byte')
    ckpt = save_ckpt(tmp_path / 'run' / 'ckpt.pt', model)
    res = probe.main([f'--ckpt={ckpt}', f'--val_bin={val}', '--metrics=path_weights', '--n_windows=2',
                      '--seq_len=8', '--device=cpu'])
    assert 'path_weights' not in res and 'unit_paths' in res['skipped']['path_weights']
    said = [line for line in capsys.readouterr().out.splitlines() if 'unit_paths' in line]
    assert len(said) == 1 and said[0].startswith('skipping path_weights:'), said


def test_every_registered_scheme_says_or_traces_its_path_weights_or_is_refused():
    """The kinds of the registry: traced (AttnRes, HC), said (unit adds), or none (post-norm and
    scaled adds: DeepNorm's alpha h, ReZero's and LayerScale's gains, KEEL, ResiDual)."""
    kinds = {name: probe.path_weights_kind(tiny(name, n_layer=2)) for name in residuals.RESIDUALS}
    assert {n for n, k in kinds.items() if k == 'unit'} == {'preln', 'lns', 'sandwich', 'moda'}
    assert {n for n, k in kinds.items() if k is None} >= {'postln', 'deepnorm', 'rezero', 'layerscale', 'keel',
                                                          'resdual'}
    assert kinds['attnres'] == kinds['blockattnres'] == 'attnres' and kinds['hc'] == kinds['mhc'] == 'hc'

# -----------------------------------------------------------------------------
# late-pair ratios with scores that are not finite


def hand_ratio(M, L, threshold):
    """R over S_late = {(s, l): s >= ceil(L/4), l > s}, counting only finite scores: (R, above, counted)."""
    above = counted = 0
    for s in range(math.ceil(L / 4), L):
        for l in range(s + 1, L):
            if math.isfinite(M[s][l]):
                counted += 1
                above += M[s][l] > threshold
    return (above / counted if counted else None), above, counted


@pytest.mark.parametrize('L', [8, 9])
def test_late_pair_ratios_leave_out_non_finite_scores_where_late_pairs_look(L, tmp_path):
    """NaN and inf placed inside S_late (and outside it, where they must change nothing): the
    ratios equal a hand loop over the finite late scores, and the same again after a probe.json
    round trip (which stores inf as null)."""
    rng = np.random.default_rng(L)
    C, P = rng.uniform(0, 1, (L, L)), rng.uniform(0, 0.3, (L, L))
    C[np.tril_indices(L)] = P[np.tril_indices(L)] = np.nan
    s0 = math.ceil(L / 4)
    assert (s0, s0 + 1) in probe.late_pairs(L)
    C[s0, s0 + 1], C[s0 + 1, L - 1], C[L - 3, L - 2] = np.nan, np.inf, 0.9  # two late pairs not finite
    C[0, 1], C[0, L - 1] = np.inf, np.nan                                  # not late pairs
    P[s0, L - 1], P[L - 2, L - 1] = np.nan, np.inf
    r = probe.late_pair_ratio(C, P)
    for name, M, thr in (('causal', C, probe.CAUSAL_THRESHOLD), ('perm', P, probe.PERM_THRESHOLD)):
        R, above, counted = hand_ratio(M, L, thr)
        assert counted == r['n_pairs'] - 2 and r[f'n_{name}_pairs'] == counted
        assert r[f'n_{name}'] == above and r[f'R_{name}'] == pytest.approx(R), name
    probe.write_json({'causal': {'C': C}, 'permutation': {'P': P}}, tmp_path / 'probe.json')
    back = probe.load_results(tmp_path / 'probe.json')
    again = probe.late_pair_ratio(back['causal']['C'], back['permutation']['P'])
    assert {k: again[k] for k in r} == r


def test_late_pair_summary_says_how_many_pairs_a_ratio_is_over(capsys):
    L = 8
    C = np.full((L, L), 0.5)
    C[np.tril_indices(L)] = np.nan
    C[2, 3] = np.nan
    probe._report('late_pairs', probe.late_pair_ratio(C))
    out = capsys.readouterr().out
    assert 'R_causal 100.0% (14 of 15 finite)' in out and 'R_perm n/a' in out
