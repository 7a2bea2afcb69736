"""tools/convert.py: the study's OLMo-core checkpoints and HuggingFace Llama, both ways; tokenizer.json files.

The study's layout is written here from our own model through the inverse mapping, with
ai2-olmo-core's checkpoint writer when it is importable, else torch.distributed.checkpoint's
writer (same layout: a 'model' dict flattened to 'model.<key>' entries plus 'optim')."""

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import checkpoint  # noqa: E402
from tools import convert  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

# our scheme -> (study block config, hc backend)
SCHEMES = {
    'preln': ({'name': 'default'}, 'hc'),
    'lns': ({'name': 'default_scaled'}, 'hc'),
    'sandwich': ({'name': 'peri_norm'}, 'hc'),
    'deepnorm': ({'name': 'deepnorm', 'layer_norm': {'name': 'default', 'eps': 1e-5, 'bias': False}}, 'hc'),
    'keel': ({'name': 'keel'}, 'hc'),
    'attnres': ({'name': 'attnres', 'attnres_block_size': 1}, 'hc'),
    'blockattnres': ({'name': 'attn_res', 'attnres_block_size': 2}, 'hc'),  # the old alias
    'hc': ({'name': 'hc', 'hyper_connections': {'kind': 'hc', 'num_residual_streams': 4}}, 'hc'),
    'mhc': ({'name': 'mhc', 'hyper_connections': {'kind': 'liger_mhc', 'num_residual_streams': 4}}, 'liger_mhc'),
    'moda': ({'name': 'moda', 'moda': {'extra_ffn_kv_proj': True}}, 'hc'),
}
L, D, H, KV, V = 3, 32, 4, 2, 64
EPS_MHC = 1e-5


def have_olmo_core():
    try:
        import olmo_core.distributed.checkpoint  # noqa: F401
        return True
    except Exception:
        return False


def write_dcp(path, model_state):
    """The study's model_and_optim/ layout: top-level 'model' and 'optim'."""
    state = {'model': {k: v.contiguous() for k, v in model_state.items()}, 'optim': {}}
    if have_olmo_core():
        import olmo_core.distributed.checkpoint as occ
        occ.save_state_dict(str(path), state)
    else:
        import torch.distributed.checkpoint as dcp
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)


def study_config(scheme, block_size=16):
    block = copy.deepcopy(SCHEMES[scheme][0])
    block = {'layer_norm': {'name': 'rms', 'eps': 1e-5, 'bias': False}, **block,
             'sequence_mixer': {'name': 'default', 'n_heads': H, 'n_kv_heads': KV, 'bias': False,
                                'rope': {'name': 'default', 'theta': 500000}},
             'feed_forward': {'hidden_size': 96, 'bias': False}}
    return {'model': {'d_model': D, 'vocab_size': V, 'n_layers': L, 'block': block,
                      'lm_head': {'layer_norm': {'name': 'rms', 'eps': 1e-5}}},
            'dataset': {'sequence_length': block_size, 'tokenizer': {'identifier': 'allenai/gpt-neox-olmo-dolma-v1_5'}},
            'train_module': {}}


def our_model(scheme, seed=0):
    cfg, kind, backend = convert.config_from_study(study_config(scheme), {
        'embeddings.weight': torch.zeros(V, D), 'blocks.0.feed_forward.w1.weight': torch.zeros(96, D),
        'blocks.0.feed_forward.feed_forward.w1.weight': torch.zeros(96, D)})
    torch.manual_seed(seed)
    model = GPT(cfg)
    with torch.no_grad():  # off the init, so every routing parameter and gain matters
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval(), kind, backend


def write_study_run(tmp_path, scheme, state=None, config=None, step=123):
    """A run dir as downloaded: tokenizer/ and step<N>/{config.json, model_and_optim/}."""
    model, kind, backend = our_model(scheme)
    study = convert.to_study(model.state_dict(), model.config, kind, backend, with_aliases=True) if state is None else state
    run = tmp_path / f'{scheme}-run'
    ck = run / f'step{step}'
    ck.mkdir(parents=True)
    (ck / 'config.json').write_text(json.dumps(config or study_config(scheme)))
    write_dcp(ck / 'model_and_optim', study)
    return run, model, study


@pytest.mark.parametrize('scheme', list(SCHEMES))
def test_study_checkpoint_round_trip(tmp_path, scheme):
    run, model, study = write_study_run(tmp_path, scheme)
    out = tmp_path / 'out' / 'ckpt.pt'
    convert.main(['--from=olmo_core', str(run), f'--out={out}'])
    ckpt = torch.load(out, map_location='cpu', weights_only=True)
    assert ckpt['model_args']['residual'] == scheme and ckpt['iter_num'] == 123
    from probe import load_model  # what every diagnostic loads
    loaded, _ = load_model(out)
    idx = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(idx)[0], model(idx)[0])


def test_study_layouts_differ_from_ours():
    """The inverse mapping really moves tensors: the AttnRes read of block b's output is the study's
    block b+1 attn_res_proj (the last one the model-level res_proj); Liger's H_res is (out, in)."""
    model, kind, backend = our_model('attnres')
    study = convert.to_study(model.state_dict(), model.config, kind, backend)
    q = model.residual.layers
    assert torch.equal(study['blocks.1.attn_res_proj.weight'], q[0].out_mix.query.view(1, -1))
    assert torch.equal(study['res_proj.weight'], q[L - 1].out_mix.query.view(1, -1))
    assert 'blocks.0.attn_res_proj.weight' not in study
    model, kind, backend = our_model('mhc')
    study = convert.to_study(model.state_dict(), model.config, kind, backend)
    m, bias = 4, model.residual.layers[0].attn_route.bias
    b = study['blocks.0.attention_hyper_connection.b']
    for s in range(m):
        for t in range(m):  # ours: res[s, t] (stream s into new stream t); Liger: [t, s]
            assert b[2 * m + t * m + s] == bias[2 * m + s * m + t]
    assert torch.equal(b[:2 * m], bias[:2 * m])


def liger_streams(study, model, idx):
    """The study's Liger mHC forward (liger_kernel mhc: mix = RMS(vec H) phi; pre = sigmoid(alpha_pre
    mix + b), post = 2 sigmoid(...), H_res = Sinkhorn(alpha_res mix + b) stored (out, in): new stream o =
    sum_i H_res[o, i] H[i] + post[o] f), written from the study's key names; the branches are ours."""
    m, T = model.config.hc_streams, idx.size(1)
    rope = (model.rope_cos[:T], model.rope_sin[:T])
    H = model.wte(idx).unsqueeze(-2).repeat(1, 1, m, 1)
    for b in range(model.config.n_layer):
        layer, norms = model.blocks[b], model.residual.layers[b]
        for side, f in (('attention', lambda x: layer.attn(norms.attn_norm(x), rope)),
                        ('feed_forward', lambda x: layer.mlp(norms.mlp_norm(x)))):
            w = lambda n: study[f'blocks.{b}.{side}_hyper_connection.{n}']  # noqa: E731
            flat = H.reshape(*H.shape[:-2], -1)
            mix = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + EPS_MHC) @ w("phi")
            pre = torch.sigmoid(mix[..., :m] * w('alpha_pre') + w('b')[:m])
            post = 2 * torch.sigmoid(mix[..., m:2 * m] * w('alpha_post') + w('b')[m:2 * m])
            z = (mix[..., 2 * m:] * w('alpha_res') + w('b')[2 * m:]).unflatten(-1, (m, m))  # [o, i]
            for _ in range(20):  # rows (over i), then columns (over o)
                z = z - torch.logsumexp(z, -1, keepdim=True)
                z = z - torch.logsumexp(z, -2, keepdim=True)
            y = f(torch.einsum('...s,...sd->...d', pre, H))
            H = torch.einsum('...oi,...id->...od', z.exp(), H) + post.unsqueeze(-1) * y.unsqueeze(-2)
    return H


def test_liger_mhc_layout_against_the_study_forward():
    """Independent of the inverse mapping: the study's Liger forward on the converted names gives our
    streams (the (out, in) H_res block is where a transposed import would differ)."""
    model, kind, backend = our_model('mhc')
    with torch.no_grad():  # far from the near-identity init, where H_res is symmetric
        for n, p in model.residual.named_parameters():
            if '_route.' in n:
                p.copy_(torch.randn_like(p) * 0.3)
    study = convert.to_study(model.state_dict(), model.config, kind, backend)
    idx = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = liger_streams(study, model, idx)
        ours = model.hidden(idx)
    want = want if ours.dim() == 4 else want.sum(-2)  # hidden: the streams, or (older model.py) their sum
    assert (ours - want).abs().max() < 1e-4


def test_plain_mhc_backend_and_keel_block0(tmp_path):
    """The plain PyTorch mHC backend stores pre/post/residual projections separately; KEEL's
    block 0 has no post_attention_norm."""
    model, _, _ = our_model('mhc')
    study = convert.to_study(model.state_dict(), model.config, 'mhc', 'mhc')
    r = model.residual.layers[1].mlp_route
    assert torch.equal(study['blocks.1.feed_forward_hyper_connection.residual_bias'], r.bias[8:].view(4, 4))
    assert torch.equal(study['blocks.1.feed_forward_hyper_connection.pre_dynamic_proj'], r.phi[:, :4])
    back = convert.from_study(study, model.config, 'mhc', 'mhc')
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())
    model, kind, _ = our_model('keel')
    study = convert.to_study(model.state_dict(), model.config, kind)
    assert 'blocks.0.post_attention_norm.weight' not in study and 'blocks.1.post_attention_norm.weight' in study


@pytest.mark.parametrize('case', ['missing', 'extra', 'shape', 'kind', 'mhc_static', 'window', 'override'])
def test_bad_study_checkpoints(tmp_path, case):
    model, kind, backend = our_model('hc')
    study = convert.to_study(model.state_dict(), model.config, kind, backend)
    config = study_config('hc')
    if case == 'missing':
        del study['blocks.1.feed_forward_hyper_connection.static_beta']
    elif case == 'extra':
        study['blocks.1.attention.q_norm.weight'] = torch.ones(D)
    elif case == 'shape':
        study['blocks.2.attention.w_k.weight'] = torch.zeros(D, D)
    elif case == 'kind':
        config['model']['block']['name'] = 'normalized'
    elif case == 'mhc_static':
        config['model']['block'].update(name='mhc', hyper_connections={'kind': 'mhc_static'})
    elif case == 'window':
        config['model']['block']['sequence_mixer']['window_size'] = [8, 0]
    else:
        config['model']['block_overrides'] = {'2': {'name': 'peri_norm'}}
    run, _, _ = write_study_run(tmp_path, 'hc', state=study, config=config)
    out = tmp_path / 'out' / 'ckpt.pt'
    with pytest.raises(SystemExit) as e:
        convert.main(['--from=olmo_core', str(run), f'--out={out}'])
    msg = str(e.value)
    assert '\n' not in msg
    assert {'missing': 'missing key blocks.1.feed_forward_hyper_connection.static_beta',
            'extra': 'unknown key blocks.1.attention.q_norm.weight',
            'shape': 'shape mismatch at blocks.2.attention.w_k.weight',
            'kind': "'normalized' is not one of",
            'mhc_static': "'mhc_static' is not supported",
            'window': "config.json sets window_size = [8, 0]: not in our backbone",
            'override': "makes block 2 a 'peri_norm' block in a 'hc' model"}[case] in msg
    assert not out.exists() and not out.parent.exists() or not any(out.parent.iterdir())  # nothing half-written


def test_reads_olmo_core_layout_without_olmo_core(tmp_path, monkeypatch):
    """torch's reader with OLMo-core's storage records mapped onto torch's: the fallback works
    on a checkpoint written by ai2-olmo-core even when it is not importable."""
    if not have_olmo_core():
        pytest.skip("needs ai2-olmo-core to write its own layout")
    run, model, study = write_study_run(tmp_path, 'preln')
    monkeypatch.setitem(sys.modules, 'olmo_core.distributed.checkpoint', None)  # import fails
    state, reader = convert.read_distcp(run / 'step123' / 'model_and_optim')
    assert reader == 'torch.distributed.checkpoint'
    assert set(state) == set(study) and all(torch.equal(state[k], study[k]) for k in study)


def test_tokenizer_found_beside_run(tmp_path):
    run, _, _ = write_study_run(tmp_path, 'preln')
    tok = make_tokenizer(run / 'tokenizer' / 'tokenizer.json')
    out = tmp_path / 'ckpt.pt'
    convert.main(['--from=olmo_core', str(run), f'--out={out}'])
    ckpt = torch.load(out, map_location='cpu', weights_only=True)
    assert ckpt['config']['tokenizer'] == str(tok.resolve())
    from probe import tokenizer_name_for
    assert tokenizer_name_for(ckpt) == str(tok.resolve())


# -----------------------------------------------------------------------------
# HuggingFace Llama

transformers = pytest.importorskip('transformers')


def test_export_preln_to_transformers(tmp_path):
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=4, n_kv_head=2, vocab_size=V, block_size=32,
                    norm_eps=1e-5, rope_theta=10000.0)
    model = GPT(cfg).eval()
    ck = tmp_path / 'ckpt.pt'
    checkpoint.save_checkpoint(str(ck), {'model': model.state_dict(), 'model_args': cfg.__dict__, 'config': {}})
    convert.main(['--to=hf', str(ck), f'--out={tmp_path / "hf"}'])
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / 'hf', dtype=torch.float32).eval()
    idx = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (hf(idx).logits - model(idx)[0]).abs().max().item()
    assert diff <= 1e-5, diff
    # another scheme has no transformers class: one line, nothing written
    cfg.residual = 'hc'
    checkpoint.save_checkpoint(str(ck), {'model': GPT(cfg).state_dict(), 'model_args': cfg.__dict__})
    with pytest.raises(SystemExit, match='only Pre-LN is a LlamaForCausalLM; hc has no transformers class'):
        convert.main(['--to=hf', str(ck), f'--out={tmp_path / "hf2"}'])
    assert not (tmp_path / 'hf2').exists()


def test_import_transformers_llama_gqa_tied(tmp_path):
    c = transformers.LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                                 num_attention_heads=6, num_key_value_heads=2, rms_norm_eps=1e-5,
                                 rope_theta=500000.0, tie_word_embeddings=True, max_position_embeddings=64)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(c).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.02 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / 'llama')
    out = tmp_path / 'out' / 'ckpt.pt'
    convert.main(['--from=hf', str(tmp_path / 'llama'), f'--out={out}'])
    from probe import load_model
    model, ckpt = load_model(out)
    a = ckpt['model_args']
    assert (a['n_kv_head'], a['norm_eps'], a['rope_theta'], a['ffn_hidden']) == (2, 1e-5, 500000.0, 80)
    idx = torch.randint(0, V, (2, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        diff = (hf(idx).logits - model(idx)[0]).abs().max().item()
    assert diff <= 1e-5, diff


def test_import_refuses_other_architectures(tmp_path):
    d = tmp_path / 'm'
    d.mkdir()
    (d / 'config.json').write_text(json.dumps({'model_type': 'gpt2'}))
    with pytest.raises(SystemExit, match="only LlamaForCausalLM"):
        convert.main(['--from=hf', str(d), f'--out={tmp_path / "c.pt"}'])


# -----------------------------------------------------------------------------
# tokenizer.json files

def make_tokenizer(path, vocab=300):
    """A small byte-level BPE trained here with `tokenizers`, with <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=['<|endoftext|>'],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["the depth of a transformer and its residual stream", "hello world, hello depth"] * 50
    tok.train_from_iterator(text, trainer)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return Path(path)


def test_tokenizer_json_round_trips_through_prepare(tmp_path):
    pytest.importorskip('tokenizers')
    import numpy as np
    from data.fineweb_edu import prepare
    from data.tokenizer import get_tokenizer
    path = make_tokenizer(tmp_path / 'tok' / 'tokenizer.json')
    docs = [f"the depth of document {i}, hello world" for i in range(40)]
    src = tmp_path / 'docs.jsonl'
    src.write_text(''.join(json.dumps({'text': t}) + '\n' for t in docs))
    meta = prepare.main(['--input', str(src), '--tokenizer', str(path), '--out_dir', str(tmp_path / 'data'),
                         '--val_fraction', '0.2'])
    tok = get_tokenizer(meta['tokenizer'])
    assert meta['tokenizer'] == str(path.resolve()) and tok.eot == tok.tok.token_to_id('<|endoftext|>')
    ids = np.concatenate([np.fromfile(tmp_path / 'data' / f, dtype=np.uint16) for f in ('train.bin', 'val.bin')])
    texts = tok.decode(ids.tolist()).split('<|endoftext|>')
    assert sorted(t for t in texts if t) == sorted(docs)


def test_tokenizer_vocab_beyond_uint16_refused(tmp_path):
    pytest.importorskip('tokenizers')
    from tokenizers import Tokenizer, models
    from data.fineweb_edu import prepare
    vocab = {f't{i}': i for i in range(70000)}
    vocab['<|endoftext|>'] = 70000
    path = tmp_path / 'big.json'
    Tokenizer(models.WordLevel(vocab, unk_token='t0')).save(str(path))
    src = tmp_path / 'docs.jsonl'
    src.write_text(json.dumps({'text': 'x'}) + '\n')
    with pytest.raises(ValueError, match=r"70,001 ids; the token files are uint16"):
        prepare.main(['--input', str(src), '--tokenizer', str(path), '--out_dir', str(tmp_path / 'd')])
    assert not (tmp_path / 'd' / 'train.bin').exists()


# -----------------------------------------------------------------------------
# against tests/test_study_fidelity.py's transcription of the study's forward

@pytest.mark.parametrize('scheme', SCHEMES)
def test_converted_names_run_the_study_transcription(scheme):
    """The names convert.py reads are the ones the transcription of the study's forward in
    test_study_fidelity.py runs on: its logits on our layout (MoDA's wrapped names unwrapped,
    which convert.py also accepts) equal our model's. mHC as the Liger backend stores it,
    H_res (out, in), which is the layout that transcription reads."""
    fid = pytest.importorskip('test_study_fidelity')
    model = fid.make(scheme)
    fid.randomise(model)
    kind = {'preln': 'default', 'lns': 'default_scaled', 'sandwich': 'peri_norm', 'blockattnres': 'attnres'}
    backend = 'liger_mhc' if scheme == 'mhc' else 'hc'
    study = convert.to_study(model.state_dict(), model.config, kind.get(scheme, scheme), backend)
    if scheme == 'moda':
        study = {k.replace('attention.attention.', 'attention.').replace('feed_forward.feed_forward.', 'feed_forward.'): v
                 for k, v in study.items()}
        assert set(convert.from_study(study, model.config, 'moda')) == set(model.state_dict())
    idx = fid.tokens()
    with torch.no_grad():
        real = fid.study_weights
        try:
            fid.study_weights = lambda m, **kw: study
            theirs = fid.study_logits(model, idx)
        finally:
            fid.study_weights = real
        assert (theirs - model(idx)[0]).abs().max() < 1e-5


def test_converted_study_run_probes_with_its_tokenizer(tmp_path):
    """The walkthrough of docs/convert.md in small: a study run with its tokenizer/ converts; held-out
    text prepared with that tokenizer.json probes through probe.py, which finds the tokenizer in the
    checkpoint."""
    pytest.importorskip('tokenizers')
    from tokenizers import Tokenizer, models, pre_tokenizers
    from data.fineweb_edu import prepare
    import probe
    run, model, _ = write_study_run(tmp_path, 'attnres')
    words = ['[UNK]'] + 'the depth of a residual stream and its blocks , 0 1 2 3 4 5 6 7 8 9'.split() + ['<|endoftext|>']
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token='[UNK]'))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (run / 'tokenizer').mkdir()
    tok.save(str(run / 'tokenizer' / 'tokenizer.json'))
    out = tmp_path / 'out' / 'study_attnres' / 'ckpt.pt'
    convert.main(['--from=olmo_core', str(run), f'--out={out}'])
    src = tmp_path / 'docs.jsonl'
    src.write_text(''.join(json.dumps({'text': f'the depth of a residual stream , {i % 10} and its blocks'}) + '\n'
                           for i in range(200)))
    prepare.main(['--input', str(src), '--tokenizer', str(run / 'tokenizer' / 'tokenizer.json'),
                  '--out_dir', str(tmp_path / 'data'), '--val_fraction', '0.3'])
    probe.main(['--ckpt', str(out), '--metrics=angular,causal', '--n_windows=2', '--seq_len=8', '--device=cpu',
                f'--val_bin={tmp_path / "data" / "val.bin"}', f'--out_dir={tmp_path / "probe"}'])
    result = json.loads((tmp_path / 'probe' / 'probe.json').read_text())
    assert result['tokenizer'] == str((run / 'tokenizer' / 'tokenizer.json').resolve())
    assert {'angular', 'causal'} <= set(result)


def test_cli_error_is_one_line(tmp_path):
    import subprocess
    r = subprocess.run([sys.executable, str(ROOT / 'tools' / 'convert.py'), '--from=olmo_core', str(tmp_path),
                        f'--out={tmp_path / "c.pt"}'], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1 and r.stderr.count('\n') == 1 and r.stderr.startswith('error: ')
