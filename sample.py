"""
Sample text from a model trained with train.py, of any residual scheme, with the
tokenizer it was trained with (the one its data's meta.json names, recorded in the
checkpoint). nanoGPT's sample.py, with the same keys:

$ python sample.py --out_dir=out/cpu_attnres
$ python sample.py --init_from=out/cpu_attnres/ckpt.pt --start="The history of" --num_samples=3 --max_new_tokens=100
$ python sample.py --out_dir=out/cpu_attnres --start=FILE:prompt.txt --temperature=0  # greedy

Generation has no KV cache: every new token runs the model on the last block_size tokens
of the context (the context is cropped to the length the model was trained on), which is
simple, and works for every scheme, including those that attend over depth. An empty prompt
(--start= or an empty FILE:) starts a new document: generation begins after the
end-of-text token, as after a document boundary in training, and the sample shows it.
"""

import os
import sys
from contextlib import nullcontext

import torch

from configurator import ConfigError, comments_from_source, configure

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
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, n_vocab=None, generator=None):
    """Extend idx (B, T) int64 by max_new_tokens tokens; returns (B, T + max_new_tokens).

    Each step runs the model on the last block_size tokens (older context is cropped: the
    model never saw longer sequences), takes the logits of the last position, drops ids
    >= n_vocab (the padding rows of the embedding, which no data id uses), and picks the
    argmax (temperature == 0) or samples from softmax(logits / temperature) restricted to
    the top_k most likely ids (top_k None or 0: all)."""
    assert idx.dim() == 2 and idx.size(1) >= 1, "idx must be (B, T) with T >= 1"
    block_size = model.config.block_size
    for _ in range(max_new_tokens):
        context = idx[:, -block_size:]  # (B, <= block_size)
        logits = model.head(model.hidden(context)[:, -1:, :])[:, -1, :].float()  # (B, V)
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
        idx = torch.cat([idx, nxt], dim=1)
    return idx


def main(argv):
    """Parse argv (config files and --key=value, as train.py), load the checkpoint and print
    num_samples samples, each followed by a line of dashes. Returns the list of sample texts
    (prompt included). Raises SystemExit with a one-line message for a bad input."""
    keys = ['init_from', 'out_dir', 'allow_unsealed', 'start', 'num_samples', 'max_new_tokens', 'temperature', 'top_k', 'seed',
            'device', 'dtype', 'tokenizer', 'fast']
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
    samples = []
    with autocast:
        for _ in range(g['num_samples']):
            y = generate(model, x, g['max_new_tokens'], g['temperature'], g['top_k'], tok.n_vocab, gen)
            samples.append(tok.decode(y[0].tolist()))
            print(samples[-1])
            print('---------------')
    return samples


if __name__ == '__main__':
    main(sys.argv[1:])
