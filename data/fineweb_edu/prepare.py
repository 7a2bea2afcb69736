"""
Prepare FineWeb-Edu (paper Sec. 2.3; docs/training.md) as flat uint16 token files for train.py:
train.bin, val.bin and meta.json in data/fineweb_edu (gpt2) or data/fineweb_edu_byte (byte).

With internet, stream the first --num_docs documents of FineWeb-Edu sample-10BT from the hub:
$ python data/fineweb_edu/prepare.py
Offline, the small web-text sample shipped in data/sample/ (744 documents, about 650K GPT-2
tokens; train.py prepares it by itself when data/fineweb_edu is empty):
$ python data/fineweb_edu/prepare.py --sample
or local files (.parquet, .jsonl, .jsonl.gz, .txt; directories and globs allowed):
$ python data/fineweb_edu/prepare.py --input shards/*.jsonl.gz more.parquet
$ python data/fineweb_edu/prepare.py --input input.txt --tokenizer byte --out_dir data/shakespeare_byte

A .txt file is plain UTF-8 text, cut at blank lines into documents of about
--txt_doc_chars characters (a file shorter than that is one document), so that a single
book such as Tiny Shakespeare still gives a train and a val split.

Every document is encoded as ordinary text (no special tokens) followed by one EOT
token. The validation split is disjoint at the document level: a document goes to
val iff the first 8 bytes of sha1(text), read as a fraction of 2^64, are below
--val_fraction, so the split does not depend on file order or chunking.
"""

import argparse
import glob
import gzip
import hashlib
import json
import os
import signal
import sys
import tempfile
from pathlib import Path

import numpy as np
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))  # the repo root, for data/tokenizer.py
from configurator import finite_float  # noqa: E402
from data.tokenizer import TOKENIZERS, check_uint16, get_tokenizer, is_tokenizer_file  # noqa: E402

HUB_DATASET, HUB_CONFIG = 'HuggingFaceFW/fineweb-edu', 'sample-10BT'
FORMATS = ('.parquet', '.jsonl', '.jsonl.gz', '.txt')
# the embedded sample (data/sample/SOURCES.md): FineWeb-Edu and FineWeb documents, ODC-By 1.0
SAMPLE = REPO_ROOT / 'data' / 'sample' / 'fineweb_edu_sample.jsonl.gz'
SAMPLE_VAL_FRACTION = 0.03  # 25 of its 744 documents, ~26K GPT-2 tokens: 20 batches of 8 x 129 to evaluate on
CHUNK_DOCS, CHUNK_CHARS = 2048, 8_000_000  # tokenize in chunks: memory stays bounded


def expand_inputs(inputs):
    """Expand files, directories and globs into a sorted, de-duplicated list of shard paths."""
    paths = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(str(p) for p in Path(item).rglob('*') if p.is_file() and p.name.endswith(FORMATS))
            if not found:
                raise FileNotFoundError(f"no {'/'.join(FORMATS)} files in directory {item}")
        elif os.path.isfile(item):
            found = [item]
        elif glob.has_magic(item):
            found = sorted(glob.glob(item))
            if not found:
                raise FileNotFoundError(f"no files match {item}")
        else:
            raise FileNotFoundError(f"input not found: {item}")
        for p in found:
            if not p.endswith(FORMATS):
                raise ValueError(f"unknown input format: {p} (supported: {', '.join(FORMATS)})")
        paths += found
    return list(dict.fromkeys(paths))


def _text_of(record, field, where):
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object per line, got {type(record).__name__}")
    if field not in record:
        raise ValueError(f"{where}: no field {field!r} (fields: {', '.join(map(str, record))}); "
                         f"pass --text_field NAME")
    return record[field]


def split_text(text, doc_chars):
    """Cut plain text at blank lines into documents of at least doc_chars characters (the
    last one may be shorter); a text without blank lines stays one document."""
    docs, current, size = [], [], 0
    for para in text.split('\n\n'):
        current.append(para)
        size += len(para) + 2
        if size >= doc_chars:
            docs.append('\n\n'.join(current))
            current, size = [], 0
    if current:
        docs.append('\n\n'.join(current))
    return [d for d in docs if d.strip()]


def iter_file(path, field, txt_doc_chars=10_000):
    """Yield the `field` value of every record of one .parquet / .jsonl / .jsonl.gz file, or
    the documents of a .txt file (split_text). Raises ValueError naming the file for a file
    that is not UTF-8, not valid JSON, or unreadable."""
    try:
        if path.endswith('.txt'):
            with open(path, encoding='utf-8') as f:
                yield from split_text(f.read(), txt_doc_chars)
        elif path.endswith('.parquet'):
            import pyarrow.parquet as pq
            pf = pq.ParquetFile(path)
            names = pf.schema_arrow.names
            if field not in names:
                raise ValueError(f"{path}: no field {field!r} (fields: {', '.join(names)}); pass --text_field NAME")
            for batch in pf.iter_batches(columns=[field], batch_size=1024):
                yield from batch.column(0).to_pylist()
        else:
            opener = gzip.open if path.endswith('.gz') else open
            with opener(path, 'rt', encoding='utf-8') as f:
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            record = json.loads(line)
                        except json.JSONDecodeError as e:
                            raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from None
                        yield _text_of(record, field, f"{path}:{lineno}")
    except UnicodeDecodeError as e:  # a ValueError too, but its message names no file
        raise ValueError(f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x}: {e.reason}); "
                         f"convert it to UTF-8 first, e.g. iconv -f latin1 -t utf-8") from None
    except (OSError, EOFError) as e:  # corrupt gzip, unreadable file, bad parquet footer
        raise ValueError(f"{path}: cannot read ({type(e).__name__}: {e})") from None


OFFLINE_HINT = "pass local files with --input PATH [PATH ...], or prepare the embedded sample with --sample"


def hub_reachable(timeout=5.0):
    """Whether a TCP connection to the hub's host opens (a proxy in the environment counts as yes:
    then the datasets library finds out). Without this check an offline machine spends half a
    minute in retries, each printing a warning."""
    import socket
    from urllib.parse import urlparse
    if any(os.environ.get(k) for k in ('HTTPS_PROXY', 'https_proxy', 'ALL_PROXY', 'all_proxy')):
        return True
    host = urlparse(os.environ.get('HF_ENDPOINT', 'https://huggingface.co')).hostname or 'huggingface.co'
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def open_hub(field, num_docs):
    """Connect to FineWeb-Edu on the HuggingFace hub (needs internet); return an iterator of texts.
    Raises ValueError (one line, naming --input and --sample) when the hub cannot be reached."""
    if os.environ.get('HF_HUB_OFFLINE', '0') not in ('', '0') or not hub_reachable():
        raise ValueError(f"no internet: cannot reach the hub to stream {HUB_DATASET}; {OFFLINE_HINT}")
    try:
        import datasets
        datasets.logging.set_verbosity_error()  # no retry warnings: the error below says it once
        rows = iter(datasets.load_dataset(HUB_DATASET, name=HUB_CONFIG, split='train', streaming=True))
        first = next(rows)
    except Exception as e:  # no network, no hub access, ...: say what to do instead
        reason = (str(e).splitlines() or [''])[0][:200]
        raise ValueError(f"cannot stream {HUB_DATASET} from the hub ({type(e).__name__}: {reason}); "
                         f"{OFFLINE_HINT}") from None
    _text_of(first, field, HUB_DATASET)  # fail now, not after the first chunk, on a wrong field

    def texts():
        yield first[field]
        for _, row in zip(range(num_docs - 1), rows):
            yield _text_of(row, field, HUB_DATASET)
    return texts()


def doc_hash(text):
    """sha1 of the UTF-8 text as a fraction in [0, 1): the document's split key."""
    return int.from_bytes(hashlib.sha1(text.encode('utf-8')).digest()[:8], 'big') / 2**64


class SplitWriter:
    """Appends documents (uint16 arrays, EOT included) to a temporary file in out_dir."""

    def __init__(self, out_dir, name, registry):
        fd, self.tmp = tempfile.mkstemp(dir=out_dir, prefix=f'.{name}.', suffix='.tmp')
        self.f = os.fdopen(fd, 'wb')
        self.tokens = self.docs = 0
        registry.append(self)  # so that the caller can clean up after an error

    def write(self, arrays):
        """Append a list of uint16 arrays, one per document (each ends with EOT)."""
        if arrays:
            arr = np.concatenate(arrays)
            arr.tofile(self.f)
            self.tokens += len(arr)
            self.docs += len(arrays)


def parse_args(argv):
    """Parse the command line (a list of str, without the program name)."""
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--input', nargs='+', default=None, metavar='PATH',
                   help=f"local shards ({', '.join(FORMATS)}), directories or globs; default: stream {HUB_DATASET}")
    p.add_argument('--sample', action='store_true',
                   help=f"prepare the embedded web-text sample (data/sample/{SAMPLE.name}); "
                        f"--val_fraction defaults to {SAMPLE_VAL_FRACTION} for it")
    p.add_argument('--txt_doc_chars', type=int, default=10_000,
                   help="a .txt input is cut at blank lines into documents of about this many characters")
    p.add_argument('--text_field', default='text', help="record field holding the document text")
    p.add_argument('--tokenizer', default='gpt2', metavar='{' + ','.join(TOKENIZERS) + '} or tokenizer.json',
                   help="a built-in tokenizer or a HuggingFace tokenizer.json (e.g. the study's, beside its checkpoints)")
    p.add_argument('--out_dir', default=None, help="default: data/fineweb_edu (gpt2), data/fineweb_edu_byte (byte)")
    p.add_argument('--num_docs', type=int, default=None, help="cap on documents; default: all local docs, 200,000 from the hub")
    p.add_argument('--val_fraction', type=finite_float, default=None,
                   help=f"expected fraction of documents in val.bin; default 0.005 ({SAMPLE_VAL_FRACTION} with --sample)")
    p.add_argument('--num_proc', type=int, default=min(8, os.cpu_count() or 1), help="tokenizer threads")
    return p.parse_args(argv)


def main(argv=None):
    """
    Tokenize the corpus and write train.bin / val.bin (flat uint16 ids) and meta.json.
    Returns the meta dict. Raises FileNotFoundError / ValueError for bad inputs
    (missing file, unknown format, missing text field, empty corpus); on any error no
    output file is created or replaced.
    """
    args = parse_args(argv)
    if args.sample and args.input:
        raise ValueError("--sample and --input both name the input: give one of them")
    if args.sample:
        args.input = [str(SAMPLE)]
    if args.val_fraction is None:
        args.val_fraction = SAMPLE_VAL_FRACTION if args.sample else 0.005
    if args.txt_doc_chars < 1:
        raise ValueError(f"--txt_doc_chars must be at least 1, got {args.txt_doc_chars}")
    if not 0.0 < args.val_fraction < 1.0:
        raise ValueError(f"--val_fraction must be in (0, 1), got {args.val_fraction}")
    if args.num_docs is not None and args.num_docs < 2:
        raise ValueError(f"--num_docs must be at least 2 (one train and one val document), got {args.num_docs}")
    if args.num_proc < 1:
        raise ValueError(f"--num_proc must be at least 1, got {args.num_proc}")
    tok = get_tokenizer(args.tokenizer)
    check_uint16(tok)
    suffix = Path(args.tokenizer).parent.name or 'file' if is_tokenizer_file(args.tokenizer) else args.tokenizer
    default_name = 'fineweb_edu' if args.tokenizer == 'gpt2' else f'fineweb_edu_{suffix}'
    out_dir = Path(args.out_dir) if args.out_dir else REPO_ROOT / 'data' / default_name

    if args.input:
        sources = expand_inputs(args.input)
        texts = (t for p in sources for t in iter_file(p, args.text_field, args.txt_doc_chars))
        num_docs = args.num_docs
    else:
        num_docs = args.num_docs or 200_000
        sources = [f"{HUB_DATASET} ({HUB_CONFIG}, split train, first {num_docs:,} docs)"]
        texts = open_hub(args.text_field, num_docs)

    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    writers, ok = [], False
    try:
        train, val = SplitWriter(out_dir, 'train', writers), SplitWriter(out_dir, 'val', writers)
        meta = _tokenize_and_write(texts, tok, args, num_docs, train, val)
        meta.update(sources=[str(s) for s in sources], text_field=args.text_field,
                    val_fraction=args.val_fraction,
                    split_rule=("a document is in val iff the first 8 bytes of sha1(utf-8 text), as a fraction "
                                "of 2^64, are below val_fraction; if that leaves a split empty, the train doc "
                                "with the smallest (or val doc with the largest) hash moves over"))
        meta_w = SplitWriter(out_dir, 'meta', writers)
        meta_w.f.write((json.dumps(meta, indent=2) + '\n').encode())
        for w in writers:
            w.f.close()
            os.chmod(w.tmp, 0o644)  # mkstemp makes owner-only files; outputs are ordinary files
        # all three files are complete: only now replace any previous outputs
        for w, target in ((train, 'train.bin'), (val, 'val.bin'), (meta_w, 'meta.json')):
            os.replace(w.tmp, out_dir / target)
        ok = True
    finally:
        for w in writers:  # after an error: remove the half-written temporaries
            w.f.close()
            if os.path.exists(w.tmp):
                os.remove(w.tmp)
        if not ok and created and not any(out_dir.iterdir()):
            out_dir.rmdir()
    print(f"wrote {out_dir}: train {meta['train_tokens']:,} tokens ({meta['train_docs']:,} docs), "
          f"val {meta['val_tokens']:,} tokens ({meta['val_docs']:,} docs)")
    return meta


def _tokenize_and_write(texts, tok, args, num_docs, train, val):
    """Stream texts through the tokenizer in chunks; append each doc + EOT to its split."""
    # Hold back the train doc with the smallest hash and the val doc with the largest, so
    # that a split left empty by the hash rule can take one over without a rewrite.
    held = {'train': None, 'val': None}  # split -> (hash, uint16 array)
    n_docs = n_empty = 0

    def flush(chunk):
        buffers = {'train': [], 'val': []}
        for text, ids in zip(chunk, tok.encode_batch(chunk, num_threads=args.num_proc)):
            ids.append(tok.eot)
            arr = np.array(ids, dtype=np.int64)
            if arr.max() >= 2**16:  # astype(np.uint16) would wrap it silently
                raise ValueError(f"token id {arr.max()} of tokenizer {tok.name!r} does not fit in uint16")
            h = doc_hash(text)
            split = 'val' if h < args.val_fraction else 'train'
            better = held[split] is None or (h < held[split][0] if split == 'train' else h > held[split][0])
            if better:
                if held[split] is not None:
                    buffers[split].append(held[split][1])
                held[split] = (h, arr.astype(np.uint16))
            else:
                buffers[split].append(arr.astype(np.uint16))
        train.write(buffers['train'])
        val.write(buffers['val'])

    chunk, chunk_chars = [], 0
    for text in tqdm(texts, total=num_docs, unit='docs', desc=f'tokenizing ({tok.name})', delay=1.0, disable=None):
        if num_docs is not None and n_docs >= num_docs:
            break
        n_docs += 1
        if text is None or text == '':
            n_empty += 1  # empty or null text: nothing to train on
            continue
        if not isinstance(text, str):
            raise ValueError(f"field {args.text_field!r} holds {type(text).__name__}, not text; "
                             f"pass --text_field NAME of a string field")
        chunk.append(text)
        chunk_chars += len(text)
        if len(chunk) >= CHUNK_DOCS or chunk_chars >= CHUNK_CHARS:
            flush(chunk)
            chunk, chunk_chars = [], 0
    flush(chunk)

    n_train = train.docs + (held['train'] is not None)
    n_val = val.docs + (held['val'] is not None)
    if n_train + n_val < 2:
        raise ValueError(f"too few documents: {n_train + n_val} non-empty ({n_empty} empty) in {n_docs} records, "
                         f"need at least 2 (one train, one val); an empty corpus or a single document "
                         f"(for one long .txt file, lower --txt_doc_chars)")
    if n_val == 0:
        held['val'], held['train'] = held['train'], None
    elif n_train == 0:
        held['train'], held['val'] = held['val'], None
    train.write([held['train'][1]] if held['train'] else [])
    val.write([held['val'][1]] if held['val'] else [])
    assert train.docs >= 1 and val.docs >= 1
    return dict(tokenizer=tok.name, vocab_size=tok.vocab_size, n_vocab=tok.n_vocab, eot=tok.eot,
                dtype='uint16', train_tokens=train.tokens, val_tokens=val.tokens,
                train_docs=train.docs, val_docs=val.docs, empty_docs_skipped=n_empty)


def _terminated(signum, frame):
    # kill / a closed terminal: unwind like Ctrl-C, so that main's cleanup removes the temp files
    raise KeyboardInterrupt(signal.Signals(signum).name)


if __name__ == '__main__':
    for _sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(_sig, _terminated)
    try:
        main(sys.argv[1:])
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as e:
        print(f"interrupted{f' ({e})' if str(e) else ''}: no output written, temporary files removed", file=sys.stderr)
        sys.exit(130)

# --input ../shared/data/c4_sample_1000.jsonl.gz (1000 C4 docs), gpt2:
#   train 470,954 tokens (995 docs), val 8,270 tokens (5 docs)
# same file, --tokenizer byte:
#   train 2,133,276 tokens (995 docs), val 41,405 tokens (5 docs)
# --input ../shared/data/webtext/*.jsonl.gz ../shared/data/c4_sample_1000.jsonl.gz (6711 docs), gpt2:
#   train 7,093,213 tokens (6,680 docs), val 35,750 tokens (31 docs)
# train.bin is ~14 MB; about 4 s on 2 CPU cores.
