"""sample.py: deterministic with a seed, crops the context to block_size, greedy decoding of a
model trained (here, in a few seconds) on a repeated sentence reproduces the sentence, the
vocabulary's padding ids are never drawn (even when the most likely, also from a real
checkpoint), and bad inputs are one line. Run: python -m pytest tests/test_sample.py -q"""

import math
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

import checkpoint
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import sample  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

PATTERN = 'the quick brown fox jumps over the lazy dog. '


def tiny_config(residual='preln', block_size=16):
    return GPTConfig(vocab_size=257, block_size=block_size, n_layer=2, n_head=2, n_embd=32, residual=residual)


def save(model, path, tokenizer='byte'):
    """A checkpoint in train.py's format (the keys sample.py reads)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    checkpoint.save_checkpoint(str(path), {'model': model.state_dict(), 'model_args': asdict(model.config),
                                           'config': {'dataset': 'nowhere'}, 'iter_num': 0, 'tokenizer': tokenizer})
    return path


@pytest.mark.parametrize('residual', ['preln', 'attnres', 'mhc', 'moda'])
def test_same_seed_same_samples(residual, tmp_path, capsys):
    torch.manual_seed(0)
    ckpt = save(GPT(tiny_config(residual)), tmp_path / 'run' / 'ckpt.pt')
    args = [f'--out_dir={tmp_path / "run"}', '--device=cpu', '--start=the ', '--num_samples=2',
            '--max_new_tokens=20', '--temperature=1.0', '--top_k=0']
    a = sample.main(args + ['--seed=1'])
    b = sample.main([f'--init_from={ckpt}'] + args + ['--seed=1'])  # the file itself: the same model
    c = sample.main(args + ['--seed=2'])
    assert a == b and a != c
    assert len(a) == 2 and a[0] != a[1]  # two draws, not one repeated
    assert all(s.startswith('the ') for s in a)
    out = capsys.readouterr().out
    assert out.count('---------------') == 6 and a[0] in out


def test_context_is_cropped_to_block_size():
    torch.manual_seed(0)
    model = GPT(tiny_config(block_size=8)).eval()
    seen = []
    hidden = model.hidden
    model.hidden = lambda idx, *a, **k: (seen.append(idx.size(1)), hidden(idx, *a, **k))[1]
    idx = torch.randint(0, 256, (1, 20))
    out = sample.generate(model, idx, 12, temperature=0)
    assert out.shape == (1, 32) and torch.equal(out[:, :20], idx)
    assert max(seen) == 8  # never more than block_size tokens
    # an independent greedy loop over explicit windows of the last 8 tokens
    ref = idx.clone()
    for _ in range(12):
        logits, _ = GPT.forward(model, ref[:, -8:])
        ref = torch.cat([ref, logits[:, -1, :256].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(sample.generate(model, idx, 12, temperature=0, n_vocab=256), ref)


def test_top_k_one_is_greedy_and_padding_ids_are_never_drawn():
    torch.manual_seed(0)
    model = GPT(tiny_config()).eval()
    idx = torch.randint(0, 256, (3, 5))
    greedy = sample.generate(model, idx, 10, temperature=0, n_vocab=200)
    gen = torch.Generator().manual_seed(0)
    assert torch.equal(sample.generate(model, idx, 10, temperature=1.5, top_k=1, n_vocab=200, generator=gen), greedy)
    drawn = sample.generate(model, idx, 50, temperature=5.0, top_k=0, n_vocab=200, generator=gen)[:, 5:]
    assert drawn.max() < 200


def test_greedy_decoding_of_a_trained_model_reproduces_the_pattern(tmp_path):
    """A 2-block Full AttnRes model trained for 150 steps on the repeated sentence: greedy
    decoding from its first words writes the sentence on, past block_size."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=257, block_size=32, n_layer=2, n_head=2, n_embd=64, residual='attnres')
    model = GPT(cfg)
    data = torch.tensor(list((PATTERN * 40).encode()), dtype=torch.long)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(150):
        starts = torch.randint(0, len(data) - 33, (16,))
        xy = torch.stack([data[s:s + 33] for s in starts])
        _, loss = model(xy[:, :-1], xy[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1  # the pattern is learnt (ln 257 = 5.5 at the start)
    ckpt = save(model, tmp_path / 'ckpt.pt')
    [text] = sample.main([f'--init_from={ckpt}', '--device=cpu', '--start=the quick', '--num_samples=1',
                          '--max_new_tokens=80', '--temperature=0'])
    assert text == ('the quick' + (PATTERN * 3)[len('the quick'):])[:len('the quick') + 80]


class FixedLogits(torch.nn.Module):
    """A 'model' whose next-token logits are always `logits` (V,), whatever the context."""

    def __init__(self, logits, block_size=8):
        super().__init__()
        self.logits = logits
        self.config = type('cfg', (), {'block_size': block_size, 'n_layer': 1})()

    def hidden(self, idx, cache=None):
        if cache is not None:
            cache.pos += idx.size(1)
        return torch.zeros(idx.size(0), idx.size(1), 1)

    def head(self, h):
        return self.logits.expand(h.size(0), h.size(1), -1).clone()


def test_padding_ids_are_never_chosen_even_when_most_likely():
    """Ids 10..15 are padding (n_vocab = 10) and get the largest logits. Greedy picks the best
    real id; top_k = 3 draws only among the 3 best real ids, with the softmax's frequencies;
    top_k = 0 draws only real ids."""
    logits = torch.tensor([0.0, 2.0, -1.0, 1.5, 0.3, 1.8, -2.0, 0.0, 0.5, -0.5] + [9.0] * 6)
    model, n = FixedLogits(logits), 10
    x = torch.zeros(1, 1, dtype=torch.long)
    assert sample.generate(model, x, 5, temperature=0, n_vocab=n)[0, 1:].tolist() == [1] * 5
    gen = torch.Generator().manual_seed(0)
    drawn = sample.generate(model, x.expand(400, 1), 1, temperature=1.0, top_k=3, n_vocab=n, generator=gen)[:, 1]
    top3 = [1, 5, 3]  # the three largest real logits: 2.0, 1.8, 1.5
    assert set(drawn.tolist()) == set(top3)
    p = torch.softmax(logits[top3], 0)
    freq = torch.tensor([(drawn == i).float().mean().item() for i in top3])
    assert (freq - p).abs().max() < 4 * math.sqrt(0.25 / 400)
    drawn = sample.generate(model, x.expand(400, 1), 1, temperature=2.0, top_k=0, n_vocab=n, generator=gen)[:, 1]
    assert drawn.max() < n and len(set(drawn.tolist())) >= 8


def test_sample_py_masks_the_padding_rows_of_a_real_checkpoint(tmp_path):
    """A byte-level model (257 real ids) with 300 embedding rows whose padding rows dominate
    every logit: greedy decoding through sample.main writes only real ids (here id 0, the
    largest real logit, each step); without the mask it would pick a padding row and fail."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=300, block_size=16, n_layer=1, n_head=2, n_embd=16))
    with torch.no_grad():  # real rows 0; padding rows +u, -u, +u, ...: one of them is > 0 for any state
        model.lm_head.weight.zero_()
        u = torch.randn(16)
        model.lm_head.weight[257:] = torch.tensor([(-1.0) ** i for i in range(43)])[:, None] * u
    ckpt = tmp_path / 'ckpt.pt'
    checkpoint.save_checkpoint(str(ckpt), {'model': model.state_dict(), 'model_args': dict(model.config.__dict__),
                                           'iter_num': 0, 'config': {'dataset': 'nowhere'}, 'tokenizer': 'byte'})
    [text] = sample.main([f'--init_from={ckpt}', '--device=cpu', '--start=ab', '--num_samples=1',
                          '--max_new_tokens=6', '--temperature=0'])
    assert text == 'ab' + '\x00' * 6


def one_line_error(args, *words):
    with pytest.raises(SystemExit) as e:
        sample.main(['--device=cpu', *args])
    msg = str(e.value.code)
    assert msg.startswith('error:') and '\n' not in msg and all(w in msg for w in words), msg


def test_bad_inputs_are_one_line(tmp_path):
    r = subprocess.run([sys.executable, 'sample.py', '--device=cpu', f'--out_dir={tmp_path / "none"}'], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and 'none/ckpt.pt' in lines[0] and 'not found' in lines[0], r.stderr
    (tmp_path / 'junk.pt').write_bytes(b'not a checkpoint')
    one_line_error([f'--init_from={tmp_path / "junk.pt"}'], 'junk.pt', 'has no seal', '--allow_unsealed=True')
    one_line_error([f'--init_from={tmp_path / "junk.pt"}', '--allow_unsealed=True'], 'junk.pt', 'cannot be read')
    ckpt = save(GPT(tiny_config()), tmp_path / 'ok' / 'ckpt.pt')
    one_line_error([f'--init_from={ckpt}', f'--start=FILE:{tmp_path / "prompt.txt"}'], 'prompt.txt', 'not found')
    (tmp_path / 'latin1.txt').write_bytes(b'caf\xe9')
    one_line_error([f'--init_from={ckpt}', f'--start=FILE:{tmp_path / "latin1.txt"}'], 'latin1.txt', 'UTF-8')
    one_line_error([f'--init_from={ckpt}', '--tokenizer=gpt2'], 'gpt2', "vocab_size")
    one_line_error([f'--init_from={ckpt}', '--tokenizer=nope'], 'nope')
    one_line_error([f'--init_from={ckpt}', '--temperature=-1'], 'temperature=-1')
    one_line_error([f'--init_from={ckpt}', '--num_sample=2'], 'num_samples')  # misspelt: did you mean


def test_start_file_prompt(tmp_path):
    torch.manual_seed(0)
    ckpt = save(GPT(tiny_config()), tmp_path / 'ckpt.pt')
    (tmp_path / 'p.txt').write_text('naïve café\n', encoding='utf-8')
    [text] = sample.main([f'--init_from={ckpt}', '--device=cpu', f'--start=FILE:{tmp_path / "p.txt"}',
                          '--num_samples=1', '--max_new_tokens=0'])
    assert text == 'naïve café\n'


def test_a_tokenizer_json_recorded_in_the_checkpoint_is_used(tmp_path):
    tokenizers = pytest.importorskip('tokenizers')
    from tokenizers import models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.BPE(unk_token='[UNK]'))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator([PATTERN * 20], trainers.BpeTrainer(vocab_size=300, special_tokens=['<|endoftext|>'],
                                                                 initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path / 'tokenizer.json'
    tok.save(str(path))
    n = tok.get_vocab_size()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=n, block_size=16, n_layer=1, n_head=2, n_embd=32, residual='preln')
    ckpt = save(GPT(cfg), tmp_path / 'ckpt.pt', tokenizer=str(path))
    [text] = sample.main([f'--init_from={ckpt}', '--device=cpu', '--start=the lazy dog', '--num_samples=1',
                          '--max_new_tokens=5', '--temperature=0'])
    ids = tok.encode('the lazy dog', add_special_tokens=False).ids
    assert text.startswith('the lazy dog') and len(tok.encode(text, add_special_tokens=False).ids) >= len(ids)
    with pytest.raises(SystemExit, match='tokenizer'):  # GPT-2's 50,257 ids do not fit this model
        sample.main([f'--init_from={ckpt}', '--device=cpu', '--tokenizer=gpt2'])


def test_an_empty_prompt_starts_a_new_document(tmp_path):
    """--start= (or an empty FILE:) generates after the end-of-text token, as at a document
    boundary in training: the sample is '<|endoftext|>' and the greedy continuation of it."""
    from data.tokenizer import get_tokenizer
    torch.manual_seed(0)
    model = GPT(tiny_config()).eval()
    ckpt = save(model, tmp_path / 'ckpt.pt')
    tok = get_tokenizer('byte')
    ids = [tok.eot]  # an independent greedy loop from the end-of-text token
    with torch.no_grad():
        for _ in range(6):
            logits, _ = GPT.forward(model, torch.tensor([ids[-16:]]))
            ids.append(int(logits[0, -1].argmax()))
    want = tok.decode(ids)
    assert want.startswith('<|endoftext|>')
    r = subprocess.run([sys.executable, 'sample.py', f'--init_from={ckpt}', '--device=cpu', '--start=',
                        '--num_samples=1', '--max_new_tokens=6', '--temperature=0'], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and 'Traceback' not in r.stderr, r.stderr
    assert want in r.stdout
    (tmp_path / 'empty.txt').write_text('')
    [text] = sample.main([f'--init_from={ckpt}', '--device=cpu', f'--start=FILE:{tmp_path / "empty.txt"}',
                          '--num_samples=1', '--max_new_tokens=6', '--temperature=0'])
    assert text == want
