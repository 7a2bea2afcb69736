"""
Sample text from a model trained with train.py, of any residual scheme, with the
tokenizer it was trained with (the one its data's meta.json names, recorded in the
checkpoint). nanoGPT's sample.py, with the same keys:

$ python sample.py --out_dir=out/cpu_attnres
$ python sample.py --init_from=out/cpu_attnres/ckpt.pt --start="The history of" --num_samples=3 --max_new_tokens=100
$ python sample.py --out_dir=out/cpu_attnres --start=FILE:prompt.txt --temperature=0  # greedy

Generation keeps a KV cache (model.KVCache; --kv_cache=False recomputes the whole context
for every token, with the same tokens): the prompt runs once, then each new token runs the
blocks on itself alone, reading the earlier tokens' attention keys and values, which is all
that crosses between tokens in every scheme, MoDA's depth attention included (its depth
slots belong to one token). The context is at most block_size tokens, the length the
model was trained on: past it, each token runs on the last block_size tokens afresh, as
without the cache (their keys depend on the tokens before them, which the window drops).
The last line, on stderr, gives the tokens per second. An empty prompt (--start= or an
empty FILE:) starts a new document: generation begins after the end-of-text token, as
after a document boundary in training, and the sample shows it.
"""

import os
import sys
import time
from contextlib import nullcontext
from itertools import islice

import torch

from configurator import ConfigError, comments_from_source, configure
from model import KVCache

# -----------------------------------------------------------------------------
# default config values
init_from = 'resume'  # 'resume' (out_dir/ckpt.pt) or the path of a checkpoint file
out_dir = 'out'  # the run to sample from when init_from='resume'
allow_unsealed = False  # read a checkpoint without a seal (another tool's), unverified
start = '\n'  # the prompt; or 'FILE:path' to read it from a UTF-8 file; '' starts a new document
num_samples = 3  # number of samples
max_new_tokens = 200  # tokens generated per sample
temperature = 0.8  # < 1 sharper, > 1 more random; 0 = greedy (argmax)
top_k = 200  # sample among the top_k most likely tokens; 0 = all
seed = 1337
device = 'cuda' if torch.cuda.is_available() else 'cpu'  # 'cpu', 'cuda', 'cuda:1', ...
dtype = None  # None = bfloat16 autocast on CUDA (if supported), float32 elsewhere
tokenizer = None  # None = the one the checkpoint's run was trained with; or 'gpt2', 'byte', ...
fast = 'auto'  # fast paths (fast/): 'auto' = on for CUDA, off on the CPU; True; False
kv_cache = True  # keep the attention's keys and values; False recomputes the context for every token
# -----------------------------------------------------------------------------
NONE_TYPES = {'dtype': str, 'tokenizer': str, 'fast': (str, bool)}


def checkpoint_path(init_from, out_dir):
    """The checkpoint file that init_from names: out_dir/ckpt.pt for 'resume', else init_from itself
    (a file, or a run directory holding ckpt.pt)."""
    if init_from == 'resume':
        return os.path.join(out_dir, 'ckpt.pt')
    if os.path.isdir(init_from):
        return os.path.join(init_from, 'ckpt.pt')
    return init_from


def read_start(start):
    """The prompt text: `start` itself, or the contents of the UTF-8 file after 'FILE:'.
    Raises ValueError (one line, naming the file) for a missing or non-UTF-8 file."""
    if not start.startswith('FILE:'):
        return start
    path = start[len('FILE:'):]
    try:
        with open(path, encoding='utf-8') as f:
            return f.read()
    except FileNotFoundError:
        raise ValueError(f"start=FILE:{path}: file not found") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"start=FILE:{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, n_vocab=None, generator=None, kv_cache=True):
    """Extend idx (B, T) int64 by max_new_tokens tokens; returns (B, T + max_new_tokens).
    The tokens are `stream`'s: kv_cache=False gives the same ones, recomputing the context."""
    out = [idx] + list(islice(stream(model, idx, temperature, top_k, n_vocab, generator, kv_cache), max_new_tokens))
    return torch.cat(out, dim=1)


@torch.no_grad()
def stream(model, idx, temperature=1.0, top_k=None, n_vocab=None, generator=None, kv_cache=True):
    """The tokens that follow idx (B, T) int64, one (B, 1) tensor at a time, without end.

    Each token is picked from the logits of the last position: ids >= n_vocab (the padding
    rows of the embedding, which no data id uses) are dropped, then the argmax (temperature
    == 0) or a draw from softmax(logits / temperature) restricted to the top_k most likely ids
    (top_k None or 0: all). The context is the last block_size tokens (older ones are
    cropped: the model never saw longer sequences). kv_cache=True (model.KVCache): the
    context runs once, then every new token alone on the cached keys and values, until the
    context is block_size long; from then on each token runs on the last block_size tokens
    afresh, as kv_cache=False does for every token."""
    assert idx.dim() == 2 and idx.size(1) >= 1, "idx must be (B, T) with T >= 1"
    block_size = model.config.block_size
    cache = None
    while True:
        if cache is not None and cache.pos < block_size:  # the next token fits: run it alone
            h = model.hidden(idx[:, -1:], cache=cache)
        else:  # the first token, no cache, or a full window: run the last block_size tokens
            cache = KVCache(model.config.n_layer) if kv_cache else None
            h = model.hidden(idx[:, -block_size:], cache=cache)  # (B, <= block_size, ...)
        logits = model.head(h[:, -1:])[:, -1, :].float()  # (B, V)
        if n_vocab is not None and n_vocab < logits.size(-1):
            logits[:, n_vocab:] = -float('inf')
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]  # (B, 1)
                logits[logits < kth] = -float('inf')
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)  # (B, 1)
        yield nxt
        idx = torch.cat([idx, nxt], dim=1)


def main(argv):
    """Parse argv (config files and --key=value, as train.py), load the checkpoint and print
    num_samples samples, each followed by a line of dashes. Returns the list of sample texts
    (prompt included). Raises SystemExit with a one-line message for a bad input."""
    keys = ['init_from', 'out_dir', 'allow_unsealed', 'start', 'num_samples', 'max_new_tokens', 'temperature',
            'top_k', 'seed', 'device', 'dtype', 'tokenizer', 'fast', 'kv_cache']
    g = {k: globals()[k] for k in keys}
    try:
        configure(g, keys, argv, help_text=comments_from_source(__file__), none_types=NONE_TYPES)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    for key, low in (('num_samples', 1), ('max_new_tokens', 0), ('top_k', 0), ('temperature', 0)):
        if g[key] < low:
            raise SystemExit(f"error: {key}={g[key]} must be >= {low}")

    # the model and its tokenizer (checkpoint.py's loader: the checkpoint's sha256 verified)
    from checkpoint import load_model, tokenizer_name_for
    from data.tokenizer import get_tokenizer
    dev = g['device']
    if dev.startswith('cuda') and not torch.cuda.is_available():
        raise SystemExit(f"error: device={dev!r} but CUDA is not available here: use --device=cpu")
    path = checkpoint_path(g['init_from'], g['out_dir'])
    try:
        model, ckpt = load_model(path, device=dev, fast=g['fast'], unsealed=g['allow_unsealed'])
        tok_name = g['tokenizer'] or ckpt.get('tokenizer') or tokenizer_name_for(ckpt)
        tok = get_tokenizer(tok_name)
        if tok.n_vocab > model.config.vocab_size:
            raise ValueError(f"tokenizer {tok_name!r} has {tok.n_vocab:,} ids, more than the model's vocab_size "
                             f"{model.config.vocab_size:,}: pass the --tokenizer the model was trained with")
        text = read_start(g['start'])
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        raise SystemExit(f"error: {str(e).splitlines()[0]}") from None
    dtype = g['dtype'] or ('bfloat16' if dev.startswith('cuda') and torch.cuda.is_bf16_supported() else 'float32')
    if dtype not in ('float32', 'bfloat16', 'float16'):
        raise SystemExit(f"error: dtype={dtype!r}: use float32, bfloat16 or float16")
    device_type = 'cuda' if dev.startswith('cuda') else 'cpu'
    autocast = nullcontext() if dtype == 'float32' else \
        torch.autocast(device_type=device_type, dtype=getattr(torch, dtype))

    ids = tok.encode(text) or [tok.eot]  # an empty prompt starts a new document, as after an EOT
    if len(ids) > model.config.block_size:
        print(f"note: the prompt has {len(ids)} tokens; the model sees its last block_size="
              f"{model.config.block_size}", file=sys.stderr)
    torch.manual_seed(g['seed'])
    gen = torch.Generator(device=dev).manual_seed(g['seed'])
    x = torch.tensor([ids], dtype=torch.long, device=dev)  # (1, T)
    samples, seconds = [], 0.0
    with autocast:
        for _ in range(g['num_samples']):
            t0 = time.perf_counter()
            y = generate(model, x, g['max_new_tokens'], g['temperature'], g['top_k'], tok.n_vocab, gen, g['kv_cache'])
            ids = y[0].tolist()  # on the host: the device has finished
            seconds += time.perf_counter() - t0
            samples.append(tok.decode(ids))
            print(samples[-1])
            print('---------------')
    n = g['num_samples'] * g['max_new_tokens']
    print(f"{n:,} tokens in {seconds:.2f} s: {n / max(seconds, 1e-9):,.1f} tokens/s "
          f"({'KV cache' if g['kv_cache'] else 'no KV cache: the context recomputed for every token'}, "
          f"{device_type}, {dtype})", file=sys.stderr)
    return samples


if __name__ == '__main__':
    main(sys.argv[1:])
