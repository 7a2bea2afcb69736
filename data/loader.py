"""
The training data of train.py: uint16 token files written by data/<dataset>/prepare.py,
read as memmaps and cut into chunks of block_size + 1 tokens (concat-and-chunk, as the study).

    loader = TokenLoader('data/fineweb_edu/train.bin', B=8, T=1024, rank=0, world=1, seed=1337)
    x, y = loader.next_batch()   # (B, T) int64 each, y = x shifted by one
"""

import importlib.util
import math
import os

import numpy as np
import torch

from checkpoint import fail

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def open_tokens(path):
    """A flat uint16 token file as a read-only memmap; one line for a missing, empty or
    odd-sized (cut off, or not uint16) file."""
    if not os.path.exists(path):
        fail(f"{path} not found: prepare the data first, e.g. python data/fineweb_edu/prepare.py "
             f"--input YOUR_FILES --out_dir={os.path.dirname(path)} (or --sample for the embedded sample)")
    size = os.path.getsize(path)
    if size == 0:
        fail(f"{path} is empty: prepare the data again (data/<dataset>/prepare.py)")
    if size % 2:
        fail(f"{path} has an odd number of bytes ({size:,}): not a whole uint16 token file (cut off?); "
             f"prepare the data again")
    return np.memmap(path, dtype=np.uint16, mode='r')


class TokenLoader:
    """Concat-and-chunk over a flat uint16 token file: the stream is cut into
    len // (T+1) chunks of T+1 tokens (x = chunk[:-1], y = chunk[1:]); each epoch visits
    them in a permutation seeded by (seed, epoch). The job consumes the permutation in
    order: a micro-step of the whole job takes the next world*B chunks, rank r the r-th
    group of B, so 2 processes x 1 micro-step see exactly the batches of 1 process x 2
    micro-steps. The state (epoch, chunks the whole job consumed in it) is saved in
    checkpoints; it does not depend on the process count, so a resume on any number of
    processes continues the same stream."""

    def __init__(self, path, B, T, rank=0, world=1, seed=0, shuffle=True, device='cpu'):
        self.data = open_tokens(path)
        self.B, self.T, self.rank, self.world, self.seed, self.shuffle = B, T, rank, world, seed, shuffle
        self.device = device
        self.n_chunks = len(self.data) // (T + 1)
        if self.n_chunks < B * world:
            fail(f"{path} has {len(self.data):,} tokens, fewer than one batch of {B * world} x {T + 1}: "
                 f"prepare more data or lower batch_size/block_size")
        self.epoch, self.pos, self._perm = 0, 0, None  # pos: chunks of this epoch consumed by the job

    def perm(self):
        if self._perm is None or self._perm[0] != self.epoch:
            p = np.random.default_rng((self.seed, self.epoch)).permutation(self.n_chunks) if self.shuffle \
                else np.arange(self.n_chunks)
            self._perm = (self.epoch, p)
        return self._perm[1]

    def next_batch(self):
        per_step = self.B * self.world
        if self.pos + per_step > self.n_chunks:  # epoch exhausted: reshuffle
            self.epoch, self.pos = self.epoch + 1, 0
        start = self.pos + self.rank * self.B
        ids = self.perm()[start:start + self.B]
        self.pos += per_step
        chunks = np.stack([self.data[i * (self.T + 1):(i + 1) * (self.T + 1)] for i in ids]).astype(np.int64)
        xy = torch.from_numpy(chunks)  # (B, T+1)
        x, y = xy[:, :-1], xy[:, 1:]
        if torch.device(self.device).type == 'cuda':  # pin, then copy asynchronously
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device), y.to(self.device)

    def state_dict(self):
        return {'epoch': self.epoch, 'pos': self.pos}

    def load_state_dict(self, s):
        # 'step' (micro-steps of one process): checkpoints written before the position was global
        self.epoch, self.pos = s['epoch'], s['pos'] if 'pos' in s else s['step'] * self.B * self.world


def eval_batches(val_path, batch_size, block_size, eval_iters):
    """(B, n, chunks): an evaluation scores n batches of B chunks of block_size+1 tokens from the
    start of val.bin, which holds `chunks`: B = batch_size and n = eval_iters, or, when val.bin
    holds fewer chunks than that (the embedded sample's split: 12 of 2,049 tokens), as many
    whole batches of min(batch_size, chunks) as it holds."""
    chunks = len(open_tokens(val_path)) // (block_size + 1)
    B = min(batch_size, chunks)
    return B, min(eval_iters, chunks // B), chunks


@torch.no_grad()
def evaluate(model, val_path, B, n, block_size, device, autocast, rank=0, world_size=1, progress=False):
    """Mean next-token cross-entropy (nats) of `model` over batches 0..n-1 of B chunks of val.bin
    (`eval_batches`), under `autocast`; batch k is scored by rank k mod world_size and the sums
    all-reduced (every rank runs as many forwards: FSDP gathers in each). progress: a tqdm bar
    if it takes more than 2 s and stderr is a terminal (a log file gets the result lines only)."""
    from tqdm import tqdm
    model.eval()
    loader = TokenLoader(val_path, B, block_size, shuffle=False, device=device)  # one stream: step k = batch k
    total = torch.zeros(2, device=device)
    for i in tqdm(range(math.ceil(n / world_size)), desc='evaluating', unit='batch', leave=False, delay=2,
                  disable=None if progress else True):
        k = i * world_size + rank
        loader.pos = (k if k < n else 0) * B  # past the end: a forward that counts for nothing
        x, y = loader.next_batch()
        with autocast:
            _, loss = model(x, y)
        weight = float(k < n)
        total += torch.stack([loss.float() * y.numel() * weight, torch.tensor(y.numel() * weight, device=device)])
    if world_size > 1:
        torch.distributed.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def default_data_dir(dataset, prepare=True, say=print):
    """train.py's data_dir when it names none: data/<dataset> of the repository. The default data of
    a fresh clone, data/fineweb_edu[_<tokenizer>], is prepared from the embedded sample when absent
    (`prepare`: on rank 0); a data_dir the user names must exist."""
    from data.tokenizer import TOKENIZERS
    data_dir = os.path.join(REPO_ROOT, 'data', dataset)
    tok = 'gpt2' if dataset == 'fineweb_edu' else dataset.removeprefix('fineweb_edu_')
    if prepare and tok in TOKENIZERS and not all(os.path.exists(os.path.join(data_dir, f))
                                                 for f in ('train.bin', 'val.bin')):
        prepare_embedded_sample(data_dir, tok, say=say)
    return data_dir


def prepare_embedded_sample(data_dir, tokenizer_name, say=print):
    """Write train.bin/val.bin/meta.json to data_dir from the web-text sample shipped in
    data/sample/ (data/fineweb_edu/prepare.py --sample), so that a fresh clone trains offline."""
    spec = importlib.util.spec_from_file_location('prepare', os.path.join(REPO_ROOT, 'data', 'fineweb_edu', 'prepare.py'))
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    say(f"{data_dir} has no train.bin/val.bin: preparing it from the embedded sample "
           f"{os.path.relpath(prepare.SAMPLE)} ({tokenizer_name} tokenizer, a few seconds)")
    try:
        prepare.main(['--sample', f'--tokenizer={tokenizer_name}', f'--out_dir={data_dir}'])
    except (ValueError, FileNotFoundError) as e:
        fail(f"cannot prepare the embedded sample: {e}")
