"""
Depth-utilization diagnostics and evaluations of DepthBench (Sec. 4 of the paper, arXiv
2609.32534, Eqs. 2–10, Figs. 4–11), for every residual scheme; the conventions are in docs/probes.md.

    python probe.py --ckpt=out/mini/preln_L4/ckpt.pt                       # every metric
    python probe.py --ckpt=out/main/hc_L32/ckpt.pt --metrics=angular,causal,permutation
    python probe.py --ckpt=out/mini/hc_L4/ckpt.pt --n_windows=8 --seq_len=128 --arc_limit=200
    python probe.py --compare out/main/preln_L32/ckpt.pt out/main/attnres_L32/ckpt.pt out/main/hc_L32/ckpt.pt \\
                    --out_dir=out/compare_L32

writes probe.json and one PNG per figure into --out_dir (default: probe/ next to the
checkpoint). A later run on the same checkpoint keeps the metrics it does not recompute (a
probe.json of another checkpoint is moved aside to probe_iter<N>.json). With --compare,
everything goes under --out_dir: each checkpoint's results in <out_dir>/<label>/ (a
probe.json may be given instead of a checkpoint, to reuse earlier results) and the overlays.

Metrics (--metrics=all or a comma list):
    angular        angular distance between depth states, Eq. 2, Fig. 5 style heatmap
    causal         skip-one-block causal score C(s, l), Eq. 3, and R_causal, Eqs. 5-6
    permutation    swap-two-blocks loss change P(l1, l2), Eq. 4, and R_perm, Eqs. 7-8
    path_weights   explicit source -> reader residual weights, Fig. 7
    block_weights  Block AttnRes weight on the running partial sum, Fig. 9
    logit_lens     KL(p_final || p_l), early-exit CE, top-5 overlap per depth state, Fig. 8 right
    prune          ARC-Easy acc / acc_norm with each block skipped, Fig. 8 left
    propagation    HC/mHC stream-mixing product: erank, mean |cos|, spectrum, Fig. 10, Eqs. 9-10
    domain_nll     completion NLL on coding / STEM / math, Fig. 4
    jacobian       ||J_l - I||_F / sqrt(D) of each block's map, random-probe estimate (probes/analysis.py)
    usefulness     each block replaced by its least-squares linear stand-in: loss ratio, share > 10%
    token_collapse stable rank, entropy effective rank, L1/L2 of the singular values of each depth state
    prune_lm       held-out LM loss with each block skipped, ± s.e. over windows
Metrics that do not apply to a scheme (propagation for Pre-LN) are skipped with a notice.

Interventions reuse prefixes: a skipped, swapped or dropped block leaves every block before
it unchanged, so the clean run's state after the shared prefix is kept and continued for
each variant (`PrefixRunner`, `run_from` in probes/runs.py; TransformerLens' start_at_layer).
probes/bench.py times it against naive re-runs.
"""

import argparse
import contextlib
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import fast as fastpath
from checkpoint import data_dir_for, load_model, read_meta, tokenizer_name_for  # noqa: F401 (probe.load_model)
from probes import analysis, evals
from probes.runs import PrefixRunner, batches, ce_sum, clean_states, device_of, flat, run_from, swap_order  # noqa: F401

# -----------------------------------------------------------------------------
# default token budgets per metric: (n_windows, seq_len), clipped to the model's block_size

DEFAULT_WINDOWS = {
    'angular': (128, 512),       # the study's release defaults (docs/probes.md)
    'causal': (16, 256),         # Eq. 3
    'permutation': (12, 256),    # Eq. 4
    'logit_lens': (32, 512),     # Fig. 8 right
    'path_weights': (16, 512),   # not in the study's code: our choice
    'block_weights': (16, 512),  # not in the study's code: our choice
    'propagation': (64, 512),    # not in the study's code: 64 windows = 64 bootstrap units
}
BATCH_SIZE = 4                   # micro-batch of windows (the study's)
CAUSAL_THRESHOLD = 0.45          # R_causal counts C > this (Eq. 6)
PERM_THRESHOLD = 0.15            # R_perm counts P > this (Eq. 8)
LATE_START_FRAC = 0.25           # late pairs: s >= ceil(L * this), 0-based (Eq. 5)
METRICS = ['angular', 'causal', 'permutation', 'path_weights', 'block_weights',
           'logit_lens', 'prune', 'propagation', 'domain_nll'] + list(analysis.ANALYSES)
DEFAULT_WINDOWS.update({name: a[1] for name, a in analysis.ANALYSES.items()})  # the study's defaults

# -----------------------------------------------------------------------------
# checkpoint, tokenizer and token windows

def _same_tokenizer(a, b):
    # names of built-in tokenizers compare as names; tokenizer.json files by absolute path, and
    # two different files are not refused (a copy of one tokenizer may live anywhere)
    files = [str(n).endswith('.json') for n in (a, b)]
    if all(files):
        return True
    return not any(files) and a == b


def check_tokenizer(ckpt, vocab_size, val_bin, requested=None):
    """The checkpoint's tokenizer against the data's: the one the checkpoint records (train.py
    writes its data's at training time) wins over any meta.json, whose disagreement is one note
    line; without a record, held-out data whose meta.json names another tokenizer than the meta.json
    of the checkpoint's training data is refused (ValueError), as is a `requested` (--tokenizer)
    other than the model's, and data of another vocab_size than a model that took its vocab_size
    from its data. Token ids alone cannot tell: byte ids (< 257) fit a GPT-2 model's embedding."""
    data_meta = read_meta(Path(val_bin).parent / 'meta.json') if val_bin else {}
    own = data_dir_for(ckpt)
    own_meta = read_meta(own / 'meta.json') if own and (not val_bin or Path(val_bin).parent != own) else {}
    config = ckpt.get('config') or {}
    recorded = ckpt.get('tokenizer') or config.get('tokenizer')
    where = Path(val_bin).parent / 'meta.json' if val_bin else None
    metas = ((where, data_meta), (own / 'meta.json' if own else None, own_meta))
    other = [f"{path} names {meta['tokenizer']!r}" for path, meta in metas
             if recorded and meta.get('tokenizer') and not _same_tokenizer(recorded, meta['tokenizer'])]
    trained = recorded or own_meta.get('tokenizer')
    data = data_meta.get('tokenizer')
    if not recorded and trained and data and not _same_tokenizer(trained, data):
        raise ValueError(f"{val_bin} holds {data!r} tokens ({where}), the model was trained on {trained!r} tokens "
                         f"({own / 'meta.json'}): pass the --val_bin of the data the model was trained on")
    if data_meta.get('vocab_size') and config.get('vocab_size') is None and data_meta['vocab_size'] != vocab_size:
        raise ValueError(f"{val_bin} is data of a {data_meta['vocab_size']:,}-id vocabulary ({where}), the model has "
                         f"vocab_size {vocab_size:,}: pass the --val_bin of the data the model was trained on")
    known = trained or data
    if requested and known and not _same_tokenizer(requested, known):
        raise ValueError(f"--tokenizer={requested} but the model's data is {known!r} "
                         f"({'its checkpoint' if recorded else own / 'meta.json' if trained else where}): "
                         f"drop --tokenizer, or pass the model's")
    if other:
        print(f"note: {' and '.join(other)}, the checkpoint records {recorded!r} (its training data's "
              f"tokenizer): the checkpoint's is used and labels the results")


def sample_windows(val_bin, n_windows, seq_len, seed=42):
    """Random contiguous windows of the held-out split (docs/probes.md, windows): starts drawn uniformly
    with numpy default_rng(seed), not aligned to documents, may contain EOT tokens, no BOS.
    val_bin: flat uint16 token file. Returns int64 tensor (n_windows, seq_len).
    Raises FileNotFoundError if absent, ValueError if it holds fewer than seq_len tokens."""
    path = Path(val_bin)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; prepare the data with `python data/<dataset>/prepare.py` "
                                f"or pass --val_bin=PATH")
    if n_windows < 1 or seq_len < 2:
        raise ValueError(f"need n_windows >= 1 and seq_len >= 2 (next-token targets), got {n_windows}, {seq_len}")
    data = np.memmap(path, dtype=np.uint16, mode='r')
    if len(data) < seq_len:
        raise ValueError(f"{path} holds {len(data):,} tokens, fewer than seq_len={seq_len}; use a smaller --seq_len")
    starts = np.random.default_rng(seed).integers(0, len(data) - seq_len + 1, size=n_windows)
    return torch.from_numpy(np.stack([data[s:s + seq_len].astype(np.int64) for s in starts]))


# -----------------------------------------------------------------------------
# pure math

def angular_distance_tokens(a, b):
    """Per-token angular distance (Eq. 2): arccos(clamp(cos(a, b), -1, 1)) / pi in [0, 1].
    a, b: (..., D) -> (...). 0 parallel, 0.5 orthogonal, 1 opposite (fp32 floor ~1e-4)."""
    cos = F.cosine_similarity(a.float(), b.float(), dim=-1, eps=1e-12)
    return torch.arccos(cos.clamp(-1.0, 1.0)) / math.pi


def effective_rank(M):
    """erank = exp(-sum_j p_j log p_j), p_j = sigma_j / sum_k sigma_k over the singular values of M
    (Eq. 9, Roy & Vetterli 2007). M: (..., m, n) -> (...) float64; I_m -> m, rank one -> 1."""
    s = torch.linalg.svdvals(M.double())
    p = s / s.sum(-1, keepdim=True).clamp_min(1e-300)
    return torch.exp(-torch.special.xlogy(p, p).sum(-1))


def mean_abs_cosine(M):
    """Mean |cos| over the m(m-1)/2 pairs of columns of M (Eq. 10; docs/probes.md: the columns
    of the propagation product, one R^m direction per output stream). M: (..., m, m) -> (...)."""
    m = M.size(-1)
    if m < 2:
        raise ValueError(f"mean_abs_cosine needs at least 2 columns, got {m}")
    cols = F.normalize(M.double(), dim=-2, eps=1e-300)
    G = (cols.transpose(-1, -2) @ cols).abs()  # (..., m, m) |cos| between columns
    iu = torch.triu_indices(m, m, offset=1)
    return G[..., iu[0], iu[1]].mean(-1)


def normalized_spectrum(M):
    """Singular values sigma_j / sigma_max, descending: (..., m, n) -> (..., min(m, n))."""
    s = torch.linalg.svdvals(M.double())
    return s / s[..., :1].clamp_min(1e-300)


def bootstrap_ci(values, n_boot=1000, seed=0, level=0.95):
    """Mean and percentile bootstrap interval over the units (rows) of values (n, ...):
    resample n rows with replacement n_boot times. Returns (mean, lo, hi) numpy arrays."""
    values = np.asarray(values, dtype=np.float64)
    n = len(values)
    if n < 1:
        raise ValueError("bootstrap_ci needs at least one unit")
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, n, size=(n_boot, n))].mean(axis=1)  # (n_boot, ...)
    q = 100 * (1 - level) / 2
    return values.mean(axis=0), np.percentile(means, q, axis=0), np.percentile(means, 100 - q, axis=0)


def late_pairs(n_layer, start_frac=LATE_START_FRAC):
    """S_late = {(s, l): s >= ceil(L * start_frac), l > s, l <= L - 1}, 0-based blocks (Eq. 5).
    L = 32 -> s = 8..30, 276 pairs."""
    s0 = math.ceil(n_layer * start_frac)
    return [(s, l) for s in range(s0, n_layer) for l in range(s + 1, n_layer)]

# -----------------------------------------------------------------------------
# representation geometry and interventions (paper Sec. 4, Eqs. 2-4)

@torch.no_grad()
def angular_distance(model, windows, batch_size=BATCH_SIZE, progress=False):
    """Angular distance between depth states (paper Eq. 2; depth states: docs/probes.md).

    For every pair of depth states z_i, z_j (i < j, i = 0 the embedding; z = residual.probe,
    HC/mHC in R^{m d}), d(i, j) = arccos(clamp(cos(z_i, z_j))) / pi per token, summed over every
    token of every window and divided by the token count (no per-window averaging).
    windows: (N, T) int64. Returns {'matrix': (L+1, L+1) array, NaN except i < j,
    'subsequent': (L, L+1) array, row n-1 = d(l, l+n) for each start l (NaN past the end),
    'n_tokens': int}."""
    model.eval()
    L = model.config.n_layer
    total, n_tok = torch.zeros(L + 1, L + 1, dtype=torch.float64), 0
    for idx in batches(windows, batch_size, device_of(model), 'angular', progress):
        rec = []
        model.hidden(idx, record=rec)
        Z = F.normalize(torch.stack([flat(p) for p, _ in rec], dim=2).flatten(0, 1), dim=-1, eps=1e-12)  # (N, L+1, D)
        with torch.autocast(Z.device.type, enabled=False):  # a bf16 Gram would blur cos near 1
            cos = (Z @ Z.transpose(1, 2)).clamp(-1.0, 1.0)  # (N, L+1, L+1), fp32 as the study
        total += (torch.arccos(cos) / math.pi).sum(0).double().cpu()
        n_tok += Z.size(0)
    M = (total / n_tok).numpy()
    M[np.tril_indices(L + 1)] = np.nan  # keep i < j only
    sub = np.full((L, L + 1), np.nan)
    for n in range(1, L + 1):
        for l in range(L + 1 - n):
            sub[n - 1, l] = M[l, l + n]
    return {'matrix': M, 'subsequent': sub, 'n_tokens': n_tok}


@torch.no_grad()
def causal_scores(model, windows, batch_size=BATCH_SIZE, reuse=True, progress=False):
    """Causal score of skipping block s on each later block l (paper Eq. 3; skip rule: docs/probes.md).

    u_l = z_{l+1} - z_l from the clean run, u-bar_l from the run with block s skipped (the
    scheme's skip rule: identity for the residual family and HC, source removal plus the
    identity-on-newest read for AttnRes); C(s, l) = mean over all tokens of
    ||u-bar_l - u_l|| / max(||u_l||, 1e-8), a mean of per-token ratios, for s = 0..L-2, s < l <= L-1.
    reuse: continue the clean state after blocks 0..s-1 (PrefixRunner) instead of re-running
    them; both give the same numbers. Returns {'C': (L, L) array, NaN where l <= s and in the
    last row, 'n_tokens': int}."""
    model.eval()
    L = model.config.n_layer
    num, n_tok = torch.zeros(L, L, dtype=torch.float64), 0
    pbar = tqdm(total=math.ceil(len(windows) / batch_size) * max(L - 1, 0), desc='causal', disable=None if progress else True)
    for idx in batches(windows, batch_size, device_of(model)):
        states = clean_states(model, idx)
        z = [flat(model.residual.probe(s)) for s in states]  # L+1 of (B, T, D)
        u = [z[l + 1] - z[l] for l in range(L)]
        u_norm = [x.norm(dim=-1).clamp_min(1e-8) for x in u]  # (B, T)
        for s in range(L - 1):
            rec = []
            if reuse:  # states[s] is the state after blocks 0..s-1; rec[k] = z-bar_{s+1+k}
                run_from(model, states[s], range(s, L), idx.size(1), skip={s}, record=rec)
                zbar = {s + 1 + k: flat(p) for k, (p, _) in enumerate(rec)}
            else:
                model.hidden(idx, skip={s}, record=rec)
                zbar = {k: flat(p) for k, (p, _) in enumerate(rec)}
            for l in range(s + 1, L):
                ratio = (zbar[l + 1] - zbar[l] - u[l]).norm(dim=-1) / u_norm[l]  # (B, T)
                num[s, l] += ratio.double().sum().item()
            pbar.update()
        n_tok += idx.numel()
    pbar.close()
    C = (num / n_tok).numpy()
    C[np.tril_indices(L)] = np.nan  # l <= s, and the last row (s = L-1) has no l > s
    return {'C': C, 'n_tokens': n_tok}


@torch.no_grad()
def permutation_scores(model, windows, batch_size=BATCH_SIZE, pairs=None, reuse=True, progress=False):
    """Permutation score of swapping blocks i < j (paper Eq. 4; swap rule: docs/probes.md):
    P(i, j) = |L_swap(i, j) - L| / L, L the token-weighted mean next-token cross-entropy (nats)
    over all T-1 predictions of every window, the same windows before and after the swap.
    A swap is the order with i and j exchanged; the parameters of a block (its norms, HC/mHC
    routing, LNS factor, AttnRes MLP-side and output-side mixers) travel with its index, which
    gives the study's swap rule (docs/probes.md) for every scheme (AttnResLayer docstring).
    pairs: list of (i, j), default all i < j. reuse: continue the clean state after blocks
    0..i-1 (PrefixRunner); same numbers as re-running them.
    Returns {'P': (L, L) array (NaN off the pairs), 'loss': L, 'loss_swap': (L, L) array,
    'n_tokens': number of predictions}."""
    model.eval()
    L = model.config.n_layer
    pairs = [(i, j) for i in range(L) for j in range(i + 1, L)] if pairs is None else [tuple(p) for p in pairs]
    for i, j in pairs:
        if not 0 <= i < j < L:
            raise ValueError(f"swap pair ({i}, {j}) must satisfy 0 <= i < j < n_layer={L}")
    base, swapped, n_pred = 0.0, {p: 0.0 for p in pairs}, 0
    runner = PrefixRunner(model)
    pbar = tqdm(total=math.ceil(len(windows) / batch_size) * len(pairs), desc='permutation', disable=None if progress else True)
    for idx in batches(windows, batch_size, device_of(model)):
        base += ce_sum(runner.logits(idx), idx)
        for i, j in pairs:
            order = swap_order(L, i, j)
            logits = runner.logits(idx, order) if reuse else model(idx, order=order)[0]
            swapped[(i, j)] += ce_sum(logits, idx)
            pbar.update()
        runner.clear()  # one batch of clean states in memory at a time
        n_pred += idx.size(0) * (idx.size(1) - 1)
    pbar.close()
    loss = base / n_pred
    P, loss_swap = np.full((L, L), np.nan), np.full((L, L), np.nan)
    for (i, j), v in swapped.items():
        loss_swap[i, j] = v / n_pred
        P[i, j] = abs(loss_swap[i, j] - loss) / loss
    return {'P': P, 'loss': loss, 'loss_swap': loss_swap, 'n_tokens': n_pred}


def late_pair_ratio(C=None, P=None, causal_threshold=CAUSAL_THRESHOLD, perm_threshold=PERM_THRESHOLD,
                    start_frac=LATE_START_FRAC):
    """Late-layer interdependence ratios (paper Eqs. 5-8):
    S_late = {(s, l): s >= ceil(L * start_frac), l > s} (0-based); R_causal = share of S_late
    with C(s, l) > causal_threshold, R_perm = share with P(s, l) > perm_threshold (strict).
    C, P: (L, L) arrays from causal_scores / permutation_scores (either may be None). A pair
    whose score is not finite (NaN: not computed, or a swap that broke the model; inf, which
    probe.json stores as null, as NaN) is left out of both counts: n_causal_pairs / n_perm_pairs
    say how many pairs a ratio is over (n_pairs when every late pair has a finite score).
    Returns {'start', 'n_pairs', 'R_causal', 'n_causal', 'n_causal_pairs', 'R_perm', 'n_perm',
    'n_perm_pairs', thresholds}; a ratio is None when its matrix is missing."""
    ref = C if C is not None else P
    if ref is None:
        raise ValueError("late_pair_ratio needs C or P")
    L = len(ref)
    pairs = late_pairs(L, start_frac)
    out = {'start': math.ceil(L * start_frac), 'n_pairs': len(pairs), 'causal_threshold': causal_threshold,
           'perm_threshold': perm_threshold, 'start_frac': start_frac}
    for name, M, thr in (('causal', C, causal_threshold), ('perm', P, perm_threshold)):
        vals = [] if M is None else [M[s][l] for s, l in pairs if np.isfinite(M[s][l])]
        above = sum(v > thr for v in vals)
        out[f'R_{name}'] = above / len(vals) if vals else None
        out[f'n_{name}'], out[f'n_{name}_pairs'] = int(above), len(vals)
    return out

# -----------------------------------------------------------------------------
# explicit residual weights (paper Figs. 7, 9, 10): dispatch on what the scheme's trace records

def trace_keys(model):
    """The tensor names a scheme records while traced ('weights', 'current' for AttnRes / Block
    AttnRes; 'read', 'mix', 'write' for HC / mHC; none for the residual family)."""
    idx = torch.zeros(1, 2, dtype=torch.long, device=device_of(model))
    with torch.no_grad(), model.residual.trace() as tape:
        model.hidden(idx)
    return set().union(*(e.keys() for e in tape)) - {'block', 'sublayer'} if tape else set()


def _sorted_tape(tape):
    return sorted(tape, key=lambda e: (e['block'], e['sublayer']))


def hc_path_weights(tape, n_layer, readout_weight=1.0):
    """Per-token path weights of HC / mHC, averaged over tokens (Fig. 7; docs/probes.md, path weights):

        w_{i->l} = beta_i^T A^{(i+1)} ... A^{(l-1)} a^{(l)}

    with beta = trace 'write' (H_post), A = 'mix' (H_res; new stream t = sum_s A[s, t] H[s]),
    a = 'read' (H_pre). Sources: 0 = embedding (in every stream, beta = 1), i + 1 = output of
    sublayer i; readers: sublayer l = 0..2L-1, and 2L = the readout, a = readout_weight in every
    stream (1 for a readout that sums the streams, 1/m for one that averages them).
    tape: the 2L trace entries of one forward pass, tensors (B, T, ...).
    Returns (W (2L+1, 2L+1) float64 array, NaN above the diagonal, n_tokens)."""
    K = 2 * n_layer
    tape = _sorted_tape(tape)
    if len(tape) != K or not all({'read', 'mix', 'write'} <= e.keys() for e in tape):
        raise ValueError(f"an HC trace needs read/mix/write for each of the {K} sublayers, got {len(tape)} entries")
    read = [e['read'].double().flatten(0, 1) for e in tape]    # (N, m)
    mix = [e['mix'].double().flatten(0, 1) for e in tape]      # (N, m, m)
    write = [e['write'].double().flatten(0, 1) for e in tape]  # (N, m)
    N, m = read[0].shape
    W = np.full((K + 1, K + 1), np.nan)
    for ell in range(K + 1):
        g = read[ell] if ell < K else torch.full((N, m), float(readout_weight), dtype=torch.float64,
                                                 device=read[0].device)
        for i in range(ell - 1, -1, -1):  # g = A^{(i+1)} ... A^{(l-1)} a^{(l)}, per token
            W[ell, i + 1] = (write[i] * g).sum(-1).mean().item()
            g = (mix[i] @ g.unsqueeze(-1)).squeeze(-1)
        W[ell, 0] = g.sum(-1).mean().item()  # the embedding starts as 1 in every stream
    return W, N


def attnres_path_weights(tape, n_layer, block_size=1):
    """Token-averaged AttnRes depth-softmax weights as a source -> reader matrix (Fig. 7).
    Reader l = 2b + j (the final aggregator is recorded as block L, sublayer 0 -> l = 2L); its
    sources are the embedding and the outputs of sublayers 0..l-1. For Block AttnRes (fewer
    sources than l + 1) each sublayer output gets the weight of the block sum that contains it
    (block of block_size sublayers; the last source is the running partial sum).
    Block 0's attention reads the embedding only (weight 1). Returns (W (2L+1, 2L+1), n_tokens)."""
    K = 2 * n_layer
    W = np.full((K + 1, K + 1), np.nan)
    W[0, 0] = 1.0
    n_tok = 0
    for e in tape:
        ell = 2 * e['block'] + e['sublayer']
        a = e['weights'].double().flatten(1).mean(1).cpu().numpy()  # (n_sources,)
        n_tok = e['weights'][0].numel()
        if len(a) == ell + 1:
            W[ell, :ell + 1] = a
        elif len(a) == 1 + math.ceil(ell / block_size):
            W[ell, 0] = a[0]
            W[ell, 1:ell + 1] = [a[1 + i // block_size] for i in range(ell)]
        else:
            raise ValueError(f"reader {ell} has {len(a)} sources; expected {ell + 1} (Full AttnRes) or "
                             f"{1 + math.ceil(ell / block_size)} (Block AttnRes with blocks of {block_size} sublayers)")
    return W, n_tok


def says_unit_paths(residual):
    """Whether a scheme says that every residual add has weight 1 (Residual.unit_paths), and says
    it for its own update rule: the class that sets unit_paths must be the one that defines
    `sublayer` / `block`, or a subclass of it. A subclass that changes the update of a unit-path
    scheme (h + a F(...) under Pre-LN's name) is not taken at its parent's word."""
    if 'unit_paths' in vars(residual):
        return bool(residual.unit_paths)
    mro = type(residual).__mro__
    said = next(i for i, c in enumerate(mro) if 'unit_paths' in vars(c))
    rule = next((i for i, c in enumerate(mro) if {'sublayer', 'block'} & vars(c).keys()), len(mro))
    return bool(residual.unit_paths) and said <= rule


def path_weights_kind(model, keys=None):
    """How path_weights gets a scheme's weights: 'hc' (trace 'mix'), 'attnres' (trace 'weights'),
    'unit' (says_unit_paths), or None: the scheme does not say, and no weights are drawn."""
    keys = trace_keys(model) if keys is None else keys
    if 'mix' in keys:
        return 'hc'
    if 'weights' in keys:
        return 'attnres'
    return 'unit' if says_unit_paths(model.residual) else None


def no_path_weights(model):
    """The one line for a scheme without path weights."""
    return (f"{model.config.residual!r} ({type(model.residual).__name__}) neither traces its residual coefficients "
            f"('weights' or 'read'/'mix'/'write') nor says that its adds have weight 1 (unit_paths = True "
            f"in its class): its path weights are unknown")


def _attnres_block_size(model):
    # sublayers per Block AttnRes block (2L / attnres_blocks); Full AttnRes gives len(a) == l + 1 first
    return max(1, 2 * model.config.n_layer // max(1, model.config.attnres_blocks))


@torch.no_grad()
def path_weights(model, windows, batch_size=BATCH_SIZE, progress=False):
    """Explicit residual-path weights (Fig. 7): W[l, i] = weight of source i
    (0 = embedding, i = output of sublayer i-1) in the input of reader l (sublayer l, 2L = the
    final readout), for i <= l; NaN elsewhere. Dispatch on the trace:
    - no coefficients, and the scheme says every residual add has weight 1 (says_unit_paths:
      Pre-LN, LNS, Sandwich, MoDA): W = lower-triangular ones;
    - 'weights' (Full / Block AttnRes): token-averaged depth-softmax weights (rows sum to 1);
    - 'mix' (HC / mHC): w_{i->l} = beta_i^T A^{(i+1)} ... A^{(l-1)} a^{(l)} computed per token
      with the dynamic coefficients, then averaged over tokens (not the product of averages).
    Returns {'W': (2L+1, 2L+1) array, 'kind': 'unit' | 'attnres' | 'hc', 'n_tokens'}. Raises
    ValueError for any other scheme (post-norm, gated, scaled adds: weights it does not say)."""
    model.eval()
    L, kind = model.config.n_layer, path_weights_kind(model)
    if kind is None:
        raise ValueError(f"path_weights: {no_path_weights(model)}")
    if kind == 'hc':
        fn = lambda tape: hc_path_weights(tape, L, getattr(model.residual, 'readout_weight', 1.0))  # noqa: E731
    elif kind == 'attnres':
        fn = lambda tape: attnres_path_weights(tape, L, _attnres_block_size(model))  # noqa: E731
    else:
        W = np.tril(np.ones((2 * L + 1, 2 * L + 1)))
        W[np.triu_indices(2 * L + 1, 1)] = np.nan
        return {'W': W, 'kind': 'unit', 'n_tokens': 0}
    total, n_tok = 0.0, 0
    for idx in batches(windows, batch_size, device_of(model), 'path weights', progress):
        with model.residual.trace() as tape:
            model.hidden(idx)
        W, n = fn(tape)
        total, n_tok = total + W * n, n_tok + n
    return {'W': total / n_tok, 'kind': kind, 'n_tokens': n_tok}


@torch.no_grad()
def block_weights(model, windows, batch_size=BATCH_SIZE, low_use_threshold=0.1, progress=False):
    """Block AttnRes weight on the current running partial sum vs the other sources, per
    sublayer (Fig. 9), token-averaged. Needs the trace's 'current' (index of the
    partial sum among the read's sources, -1 at a block boundary where it is empty).
    Returns {'current', 'embedding', 'frozen': lists over readers l = 0..2L (NaN where there is
    no record / no partial sum), 'boundaries': readers with no partial sum, 'weights': per reader
    the mean weight of every source, 'low_use_sublayers': leading readers (with a partial sum)
    putting < low_use_threshold on it: the low-use segment, our reading of the site's "dead segment"}.
    Raises ValueError for a scheme without 'current'."""
    model.eval()
    if 'current' not in trace_keys(model):
        raise ValueError(f"block_weights needs a Block AttnRes model (trace 'current'); "
                         f"this one is {model.config.residual!r}")
    K = 2 * model.config.n_layer
    sums, cur, n_tok = {}, {}, 0
    for idx in batches(windows, batch_size, device_of(model), 'block weights', progress):
        with model.residual.trace() as tape:
            model.hidden(idx)
        for e in tape:
            ell = 2 * e['block'] + e['sublayer']
            sums[ell] = sums.get(ell, 0.0) + e['weights'].double().flatten(1).sum(1).cpu().numpy()
            cur[ell] = int(torch.as_tensor(e['current']).flatten()[0])
        n_tok += idx.numel()
    current, embedding, frozen, weights = [], [], [], []
    for ell in range(K + 1):
        if ell not in sums:
            current.append(np.nan), embedding.append(np.nan), frozen.append(np.nan), weights.append([])
            continue
        a = sums[ell] / n_tok
        c = a[cur[ell]] if cur[ell] >= 0 else np.nan
        current.append(float(c)), embedding.append(float(a[0]))
        frozen.append(float(1.0 - a[0] - (0.0 if np.isnan(c) else c)))
        weights.append(a.tolist())
    boundaries = [ell for ell in sums if cur[ell] < 0]
    low_use = 0
    for ell in range(1, K + 1):
        if np.isnan(current[ell]):
            continue
        if current[ell] >= low_use_threshold:
            break
        low_use += 1
    return {'current': current, 'embedding': embedding, 'frozen': frozen, 'weights': weights,
            'boundaries': sorted(boundaries), 'low_use_sublayers': low_use, 'low_use_threshold': low_use_threshold}

# -----------------------------------------------------------------------------
# LogitLens and HC/mHC propagation (paper Figs. 8 right, 10)

@torch.no_grad()
def logit_lens(model, windows, batch_size=BATCH_SIZE, progress=False):
    """LogitLens (Fig. 8 right; lens states: docs/probes.md): p_l = softmax(model.head(r_l)) for the lens state
    r_l (residual.lens: the residual stream, HC/mHC's streams, the AttnRes mix the next
    read produces; model.head decodes it with the scheme's readout) after l = 0..L blocks;
    p_final = the model's actual output. Per next-token position 0..T-2, token-weighted
    over windows:
    'kl' = KL(p_final || p_l) = sum p_final (log p_final - log p_l) (nats; 0 at l = L),
    'ce' = early-exit cross-entropy (nats), 'top5' = |top5(p_l) & top5(p_final)| / 5.
    Returns {'kl', 'ce', 'top5': lists of L+1 floats, 'n_tokens'}."""
    model.eval()
    L = model.config.n_layer
    kl, ce, top5 = np.zeros(L + 1), np.zeros(L + 1), np.zeros(L + 1)
    n_pred = 0
    for idx in batches(windows, batch_size, device_of(model), 'logit lens', progress):
        rec = []
        h = model.hidden(idx, record=rec)
        logp_f = model.head(h)[:, :-1].float().log_softmax(-1)  # (B, T-1, V)
        p_f = logp_f.exp()
        top_f = logp_f.topk(5, dim=-1).indices                   # (B, T-1, 5)
        tgt = idx[:, 1:].unsqueeze(-1)                           # (B, T-1, 1)
        for l, (_, r) in enumerate(rec):
            logp = model.head(r)[:, :-1].float().log_softmax(-1)
            kl[l] += (p_f * (logp_f - logp)).sum().item()
            ce[l] -= logp.gather(-1, tgt).sum().item()
            top = logp.topk(5, dim=-1).indices
            top5[l] += (top.unsqueeze(-1) == top_f.unsqueeze(-2)).any(-1).sum().item() / 5
        n_pred += tgt.numel()
    return {'kl': (kl / n_pred).tolist(), 'ce': (ce / n_pred).tolist(), 'top5': (top5 / n_pred).tolist(),
            'n_tokens': n_pred}


def propagation_products(tape):
    """Per-token product P = A^{(1)} ... A^{(2L)} of the dynamic stream-mixing matrices of one
    HC / mHC forward pass (trace 'mix', orientation new stream t = sum_s A[s, t] H[s], so
    P[s, t] = share of initial stream s in final stream t). Returns float64 (B, T, m, m)."""
    P = None
    for e in _sorted_tape(tape):
        A = e['mix'].double()
        P = A if P is None else P @ A
    return P


@torch.no_grad()
def propagation_stats(model, windows, batch_size=BATCH_SIZE, n_boot=1000, seed=0, progress=False):
    """HC / mHC signal propagation (Fig. 10, paper Eqs. 9-10; docs/probes.md). Per token, the
    product P of the 2L per-sublayer mixing matrices (dynamic coefficients), then
    effective_rank(P), mean_abs_cosine(P) (columns) and normalized_spectrum(P).
    Bootstrap unit ("document"): one eval window; our choice, since windows are random spans of
    the held-out split. Per-window means, n_boot resamples, 95% percentile intervals.
    Returns {'erank', 'mean_abs_cos': {'mean', 'lo', 'hi'}, 'spectrum': {'mean', 'lo', 'hi'}
    (lists of m), 'm', 'n_docs', 'n_boot', 'unit': 'window'}. Raises ValueError for a scheme
    without stream mixing (trace 'mix')."""
    model.eval()
    if 'mix' not in trace_keys(model):
        raise ValueError(f"propagation needs an HC / mHC model (trace 'mix'); this one is {model.config.residual!r}")
    er, cos, spec = [], [], []
    for idx in batches(windows, batch_size, device_of(model), 'propagation', progress):
        with model.residual.trace() as tape:
            model.hidden(idx)
        P = propagation_products(tape)  # (B, T, m, m)
        er.append(effective_rank(P).mean(1).cpu())       # (B,) per-window means
        cos.append(mean_abs_cosine(P).mean(1).cpu())
        spec.append(normalized_spectrum(P).mean(1).cpu())  # (B, m)
    out = {'n_docs': len(windows), 'n_boot': n_boot, 'unit': 'window'}
    for name, vals in (('erank', er), ('mean_abs_cos', cos), ('spectrum', spec)):
        mean, lo, hi = bootstrap_ci(torch.cat(vals).numpy(), n_boot, seed)
        out[name] = {'mean': mean.tolist(), 'lo': lo.tolist(), 'hi': hi.tolist()}
    out['m'] = len(out['spectrum']['mean'])
    return out

# -----------------------------------------------------------------------------
# evaluations (paper Figs. 4, 8 left; docs/probes.md) through probes/evals.py

def _paired_se(a, b):
    # standard error of mean(a - b) over paired units (n - 1 in the variance); NaN for n < 2
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    return float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else float('nan')


@torch.no_grad()
def prune_scan(model, enc, items, batch_size=8, chunk_items=64, progress=False):
    """Single-block pruning on ARC-Easy (Fig. 8 left; docs/probes.md, evaluations): zero-shot accuracy of the
    full model and of the model with each block l skipped (the skip rule of causal_scores),
    scored by evals.arc_easy_accuracy (sum of continuation log-probs; acc_norm per character).
    Items are scored chunk_items at a time; within a chunk the clean states of every batch are
    kept (PrefixRunner), so skipping block l re-runs only blocks l..L-1 (memory: L+1 states of
    every sequence of the chunk; lower chunk_items if it does not fit).
    items: load_task('arc_easy'). Returns {'baseline': {'acc', 'acc_norm'}, 'blocks': [{'block',
    'acc', 'acc_norm', 'delta_acc', 'delta_acc_norm', 'se_delta_acc_norm' (standard error of the
    paired per-question difference)}], 'metric': 'acc_norm', 'n'}."""
    model.eval()
    if not items:
        raise ValueError("prune_scan needs at least one ARC-Easy item")
    L, device = model.config.n_layer, device_of(model)
    pairs = evals.prepare_pairs(enc, items)
    offsets = np.cumsum([0] + [len(it['choices']) for it in items])
    variants = [None] + list(range(L))  # None = the full model
    correct = {v: [0, 0] for v in variants}
    right = {v: [] for v in variants}  # per question: acc_norm correct (0/1), for the paired s.e.
    runner = PrefixRunner(model)
    chunks = range(0, len(items), chunk_items)
    pbar = tqdm(total=len(chunks) * len(variants), desc='prune (ARC-Easy)', disable=None if progress else True)
    for c in chunks:
        its = items[c:c + chunk_items]
        prs = pairs[offsets[c]:offsets[c + len(its)]]
        for v in variants:
            skip = () if v is None else (v,)
            r = evals.arc_easy_accuracy(lambda idx: runner.logits(idx, skip=skip), enc, its, pairs=prs,
                                        batch_size=batch_size, max_len=model.config.block_size, device=device)
            correct[v][0] += round(r['acc'] * r['n'])
            correct[v][1] += round(r['acc_norm'] * r['n'])
            right[v] += [float(pn == it['gold']) for pn, it in zip(r['pred_norm'], its)]
            pbar.update()
        runner.clear()
    pbar.close()
    n = len(items)
    base = {'acc': correct[None][0] / n, 'acc_norm': correct[None][1] / n}
    blocks = [{'block': l, 'acc': correct[l][0] / n, 'acc_norm': correct[l][1] / n,
               'delta_acc': (correct[l][0] - correct[None][0]) / n,
               'delta_acc_norm': (correct[l][1] - correct[None][1]) / n,
               'se_delta_acc_norm': _paired_se(right[l], right[None])} for l in range(L)]
    return {'baseline': base, 'blocks': blocks, 'metric': 'acc_norm', 'n': n}


@torch.no_grad()
def domain_nll(model, enc, eval_dir=evals.EVAL_DIR, batch_size=8, tasks=evals.NLL_TASKS, progress=False, limit=None):
    """Completion-only NLL per task and category (Fig. 4; docs/probes.md, evaluations) via evals.domain_nll:
    nats per answer token, token-weighted per task; category 'nll' = unweighted mean of its
    tasks, 'nll_pooled' = token-weighted. Context limit = the model's block_size (left
    truncation). Absent tasks are skipped with a notice and listed in 'skipped'.
    limit: score only the first `limit` examples of each task (quick runs).
    Raises FileNotFoundError if no task file exists in eval_dir."""
    model.eval()
    data = {t: items[:limit or None] for t, items in evals.load_tasks(tasks, eval_dir).items()}
    if not data:
        raise FileNotFoundError(f"no domain-NLL task in {eval_dir}; run `python data/evals/prepare.py`")
    for t in tasks:
        if t not in data:
            print(f"domain_nll: skipping {t} (no {Path(eval_dir) / (t + '.jsonl')})")
    return evals.domain_nll(lambda idx: model(idx)[0], enc, data, batch_size=batch_size,
                            max_len=model.config.block_size, device=device_of(model), progress=progress)

# -----------------------------------------------------------------------------
# command line

def _jsonable(x):
    # numpy arrays -> nested lists, NaN / inf -> null (strict JSON)
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, np.ndarray)):
        return [_jsonable(v) for v in (x.tolist() if isinstance(x, np.ndarray) else x)]
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    return x


def parse_metrics(text):
    """'all' or a comma list of METRICS -> list; ValueError naming the known ones otherwise."""
    names = METRICS if text == 'all' else [m.strip() for m in text.split(',') if m.strip()]
    bad = [m for m in names if m not in METRICS]
    if bad or not names:
        raise ValueError(f"unknown metric(s) {bad or text!r}; choose 'all' or a comma list of {', '.join(METRICS)}")
    return names


def default_label(ckpt_path):
    """A checkpoint's name in figures: its run directory (out/main/hc_L32/ckpt.pt -> hc_L32),
    plus the file name for any other file than ckpt.pt (run/ckpt_swap.pt -> run/ckpt_swap)."""
    p = Path(ckpt_path).resolve()
    return p.parent.name if p.stem == 'ckpt' else f"{p.parent.name}/{p.stem}"


def default_probe_dir(ckpt_path):
    """Where a checkpoint's probe.json and figures go: probe/ beside ckpt.pt, probe_<name>/
    beside any other checkpoint file (two checkpoints of one run never share a folder)."""
    p = Path(ckpt_path).resolve()
    return p.parent / ('probe' if p.stem == 'ckpt' else f"probe_{p.stem}")


def probe_checkpoint(ckpt_path, metrics, args, json_path=None):
    """Runs `metrics` on one checkpoint; returns the results dict that goes into probe.json.
    json_path: where to write the results so far after each metric (None: nowhere).
    Raises ValueError when the held-out tokens or the tokenizer do not fit the model's vocabulary."""
    from data.tokenizer import get_tokenizer
    model, ckpt = load_model(ckpt_path, args.device, args.fast, getattr(args, 'allow_unsealed', False))
    cfg, L = model.config, model.config.n_layer
    val_bin = args.val_bin or (str(data_dir_for(ckpt) / 'val.bin') if data_dir_for(ckpt) else None)
    check_tokenizer(ckpt, cfg.vocab_size, val_bin, args.tokenizer)
    tok_name = args.tokenizer or tokenizer_name_for(ckpt, val_bin)
    label = args.label or default_label(ckpt_path)
    print(f"{label}: {cfg.residual}, L={L}, d={cfg.n_embd}, {model.num_params():,} parameters, "
          f"iter {ckpt.get('iter_num', '?')}, tokenizer {tok_name}, device {args.device}")
    out = {'label': label, 'ckpt': str(ckpt_path), 'scheme': cfg.residual, 'n_layer': L, 'n_embd': cfg.n_embd,
           'iter_num': ckpt.get('iter_num'), 'tokenizer': tok_name, 'val_bin': val_bin, 'dtype': args.dtype,
           'settings': {}, 'skipped': {}}
    if json_path:
        merge_previous(out, json_path, metrics)
    keys = trace_keys(model)
    amp = (torch.autocast('cuda', dtype=torch.bfloat16) if args.dtype == 'bfloat16'
           else contextlib.nullcontext())  # the study runs bf16 on GPU; metrics are fp32 either way

    def windows(metric):
        n, T = DEFAULT_WINDOWS[metric]
        n, T = args.n_windows or n, min(args.seq_len or T, cfg.block_size)
        if val_bin is None:
            raise FileNotFoundError("the checkpoint's config names no dataset; pass --val_bin=PATH")
        out['settings'][metric] = {'n_windows': n, 'seq_len': T, 'seed': args.seed}
        w = sample_windows(val_bin, n, T, args.seed)
        if w.max() >= cfg.vocab_size:  # another tokenizer's data: an IndexError deep in the model otherwise
            raise ValueError(f"{val_bin} holds token id {w.max().item()}, past the model's vocab_size "
                             f"{cfg.vocab_size}: pass the --val_bin of the data the model was trained on")
        return w

    def tokenizer():
        tok = get_tokenizer(tok_name)
        if tok.n_vocab > cfg.vocab_size:
            raise ValueError(f"tokenizer {tok_name!r} has {tok.n_vocab:,} ids, more than the model's vocab_size "
                             f"{cfg.vocab_size}: pass the --tokenizer the model was trained with")
        if tok.vocab_size != cfg.vocab_size and (ckpt.get('config') or {}).get('vocab_size') is None:
            raise ValueError(f"tokenizer {tok_name!r} pads to {tok.vocab_size:,} ids, the model has vocab_size "
                             f"{cfg.vocab_size:,}: pass the --tokenizer the model was trained with")
        return tok

    def skip(metric, why):
        print(f"skipping {metric}: {why}")
        out['skipped'][metric] = why

    bs = args.batch_size
    for metric in metrics:
        with amp:
            if metric == 'angular':
                out[metric] = angular_distance(model, windows(metric), bs, progress=True)
            elif metric == 'causal':
                out[metric] = causal_scores(model, windows(metric), bs, progress=True)
            elif metric == 'permutation':
                pairs = late_pairs(L) if args.perm_late_only else None
                out[metric] = permutation_scores(model, windows(metric), bs, pairs=pairs, progress=True)
            elif metric == 'path_weights':
                if path_weights_kind(model, keys) is None:
                    skip(metric, no_path_weights(model))
                    continue
                out[metric] = path_weights(model, windows(metric), bs, progress=True)
            elif metric == 'block_weights':
                if 'current' not in keys:
                    skip(metric, f"only for Block AttnRes (no running-sum weights in {cfg.residual!r})")
                    continue
                out[metric] = block_weights(model, windows(metric), bs, progress=True)
            elif metric == 'logit_lens':
                out[metric] = logit_lens(model, windows(metric), bs, progress=True)
            elif metric == 'propagation':
                if 'mix' not in keys:
                    skip(metric, f"only for HC / mHC (no stream mixing in {cfg.residual!r})")
                    continue
                out[metric] = propagation_stats(model, windows(metric), bs, n_boot=args.n_boot, progress=True)
            elif metric == 'prune':
                if not (Path(args.eval_dir) / 'arc_easy.jsonl').is_file():
                    skip(metric, f"no {Path(args.eval_dir) / 'arc_easy.jsonl'}; "
                                 f"run `python data/evals/prepare.py --tasks arc_easy`")
                    continue
                items = evals.load_task('arc_easy', args.eval_dir)[:args.arc_limit or None]
                out[metric] = prune_scan(model, tokenizer(), items, batch_size=args.eval_batch_size,
                                         progress=True)
                out['settings'][metric] = {'n_items': len(items)}
            elif metric in analysis.ANALYSES:
                if metric in ('jacobian', 'usefulness') and not analysis._supported(model):
                    skip(metric, f"{cfg.residual!r} computes its depth state from several streams: "
                                 f"no map of z_l to z_l+1 to differentiate or replace")
                    continue
                out[metric] = analysis.ANALYSES[metric][0](model, windows(metric), bs, args)
            elif metric == 'domain_nll':
                if not evals.load_tasks(evals.NLL_TASKS, args.eval_dir):
                    skip(metric, f"no domain-NLL task in {args.eval_dir}; run `python data/evals/prepare.py`")
                    continue
                out[metric] = domain_nll(model, tokenizer(), args.eval_dir,
                                         batch_size=args.eval_batch_size, progress=True, limit=args.nll_limit)
        _report(metric, out.get(metric))
        if json_path:  # after every metric: a later crash keeps what is done
            write_json(out, json_path)
    if 'causal' in out or 'permutation' in out:
        out['late_pairs'] = late_pair_ratio(out.get('causal', {}).get('C'), out.get('permutation', {}).get('P'),
                                            args.causal_threshold, args.perm_threshold)
        _report('late_pairs', out['late_pairs'])
    return out


IDENTITY_KEYS = ('scheme', 'n_layer', 'n_embd', 'iter_num', 'tokenizer', 'val_bin', 'dtype')


def merge_previous(out, json_path, metrics):
    """Keeps what an earlier probe.json at json_path holds and this run does not recompute:
    results of the same checkpoint (same file, iteration, scheme, data, dtype) go into `out`
    (metrics in `metrics` are recomputed and replace theirs); a probe.json of anything else is
    moved aside to probe_iter<N>.json (or probe_old<k>.json) first, never overwritten."""
    path = Path(json_path)
    if not path.is_file():
        return
    try:
        old = load_results(path)
    except (ValueError, OSError, TypeError, KeyError):
        old = None
    same = isinstance(old, dict) and str(Path(old.get('ckpt', '')).resolve()) == str(Path(out['ckpt']).resolve()) \
        and all(old.get(k) == out[k] for k in IDENTITY_KEYS)
    if not same:
        it = old.get('iter_num') if isinstance(old, dict) else None
        names = ([f"probe_iter{it}.json"] if it is not None else []) + [f"probe_old{k}.json" for k in range(1, 1000)]
        target = next(path.with_name(n) for n in names if not path.with_name(n).exists())
        os.replace(path, target)
        print(f"{path} holds results of another checkpoint or setting: kept as {target}")
        return
    for m in METRICS:  # a recomputed metric keeps its old value until the new one is done
        if m in old:
            out[m] = old[m]
            if m in (old.get('settings') or {}):
                out['settings'][m] = old['settings'][m]
    kept = [m for m in METRICS if m in old and m not in metrics]
    for m, why in (old.get('skipped') or {}).items():
        if m not in metrics:
            out['skipped'][m] = why
    if kept:
        print(f"kept {', '.join(kept)} from the earlier {path}")


def _stat(fn, M):
    # nanmean / nanmax that gives NaN instead of a warning for an all-NaN matrix (L = 1)
    M = np.asarray(M, dtype=float)
    return fn(M) if np.isfinite(M).any() else float('nan')


def _report(metric, r):
    # one summary line per metric, so a run shows what it found without opening the JSON
    if r is None:
        return
    if metric in analysis.ANALYSES:
        print(analysis.ANALYSES[metric][2](r))
    elif metric == 'angular':
        print(f"angular: mean adjacent-state distance {_stat(np.nanmean, r['subsequent'][0]):.4f}, "
              f"embedding -> last {r['matrix'][0, -1]:.4f} ({r['n_tokens']:,} tokens)")
    elif metric == 'causal':
        print(f"causal: mean C {_stat(np.nanmean, r['C']):.4f}, max {_stat(np.nanmax, r['C']):.4f}")
    elif metric == 'permutation':
        print(f"permutation: loss {r['loss']:.4f} nats, mean P {_stat(np.nanmean, r['P']):.4f}")
    elif metric == 'late_pairs':
        def fmt(name):  # the ratio, and over how many pairs when some have no finite score
            v, n = r[f'R_{name}'], r.get(f'n_{name}_pairs', r['n_pairs'])
            if v is None:
                return 'n/a'
            return f"{100 * v:.1f}%" + (f" ({n} of {r['n_pairs']} finite)" if n < r['n_pairs'] else '')
        print(f"late pairs (s >= {r['start']}, {r['n_pairs']} pairs): "
              f"R_causal {fmt('causal')}, R_perm {fmt('perm')}")
    elif metric == 'path_weights':
        print(f"path_weights: {r['kind']}, readout weight on the embedding {r['W'][-1, 0]:.3f}, "
              f"mean over sublayer outputs {np.mean(r['W'][-1, 1:]):.3f}")
    elif metric == 'block_weights':
        print(f"block_weights: low-use segment {r['low_use_sublayers']} sublayers "
              f"(< {r['low_use_threshold']} on the running sum)")
    elif metric == 'logit_lens':
        print(f"logit_lens: KL per layer {np.round(r['kl'], 3).tolist()} nats")
    elif metric == 'propagation':
        print(f"propagation: erank {r['erank']['mean']:.3f} [{r['erank']['lo']:.3f}, {r['erank']['hi']:.3f}], "
              f"mean |cos| {r['mean_abs_cos']['mean']:.3f}")
    elif metric == 'prune':
        worst = min(r['blocks'], key=lambda b: b['delta_acc_norm'])
        print(f"prune: ARC-Easy acc {r['baseline']['acc']:.4f} acc_norm {r['baseline']['acc_norm']:.4f} (n={r['n']}); "
              f"largest drop: block {worst['block']} ({worst['delta_acc_norm']:+.4f})")
    elif metric == 'domain_nll':
        cats = r['categories'].items()
        cut = sum(t['n_truncated'] for t in r['tasks'].values())
        print("domain_nll: " + ", ".join(f"{c} {v['nll']:.3f} nats/token" for c, v in cats if v['nll'] is not None)
              + (f" ({cut:,} examples cut to the model's context, their start dropped)" if cut else ''))


def write_json(results, path):
    """Writes results as JSON to path, through a temporary file: never a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, 'w') as f:
            json.dump(_jsonable(results), f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_results(results, out_dir):
    """Writes probe.json, then the figures of one checkpoint, into out_dir; returns the paths."""
    write_json(results, Path(out_dir) / 'probe.json')
    from probes import plots  # after the JSON: without matplotlib the numbers are still kept
    return [Path(out_dir) / 'probe.json'] + plots.plot_all([results], out_dir)


def load_results(path):
    """probe.json -> results dict with matrices back as numpy arrays (null -> NaN)."""
    with open(path) as f:
        r = json.load(f)
    nan = lambda M: np.array([[np.nan if v is None else v for v in row] for row in M], dtype=float)
    bw = r.get('block_weights') or {}
    for old, new in (('dead_sublayers', 'low_use_sublayers'), ('dead_threshold', 'low_use_threshold')):
        if old in bw:  # a probe.json written before the low-use segment had one name
            bw[new] = bw.pop(old)
    for metric, key in (('angular', 'matrix'), ('angular', 'subsequent'), ('causal', 'C'), ('permutation', 'P'),
                        ('permutation', 'loss_swap'), ('path_weights', 'W')):
        if metric in r and key in r[metric]:
            r[metric][key] = nan(r[metric][key])
    return r


def main(argv=None):
    p = argparse.ArgumentParser(description="DepthBench depth diagnostics (probe.py docstring lists the metrics)")
    p.add_argument('--ckpt', help="checkpoint written by train.py (out_dir/ckpt.pt)")
    p.add_argument('--compare', nargs='+', metavar='CKPT_OR_JSON',
                   help="several checkpoints (or probe.json files) overlaid in one figure per metric")
    p.add_argument('--metrics', default='all', help=f"'all' or a comma list of: {', '.join(METRICS)}")
    p.add_argument('--out_dir', help="default: probe/ next to the checkpoint (compare: out/probe_compare)")
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu',
                   help="where the model runs (default: cuda if present, else cpu)")
    p.add_argument('--dtype', default=None, choices=['float32', 'bfloat16'], help="default: bfloat16 on cuda")
    p.add_argument('--fast', default='auto', choices=['auto', 'True', 'False'],
                   help="fast paths (fast/): auto = on for CUDA, off on the CPU")
    p.add_argument('--allow_unsealed', default=False, type=lambda v: v.lower() == 'true', metavar='True|False',
                   help="read a checkpoint without a seal (another tool's), unverified")
    p.add_argument('--n_windows', type=int, default=None, help="override every metric's window count")
    p.add_argument('--seq_len', type=int, default=None, help="override every metric's window length")
    p.add_argument('--batch_size', type=int, default=BATCH_SIZE, help="windows per micro-batch")
    p.add_argument('--seed', type=int, default=42, help="window sampling seed (the study's: 42)")
    p.add_argument('--val_bin', default=None, help="held-out tokens; default data/<dataset>/val.bin")
    p.add_argument('--tokenizer', default=None,
                   help="gpt2, byte or path/to/tokenizer.json; default: from the dataset's meta.json or the checkpoint")
    p.add_argument('--eval_dir', default=str(evals.EVAL_DIR), help="evaluation sets from data/evals/prepare.py")
    p.add_argument('--eval_batch_size', type=int, default=8, help="sequences per batch in prune / domain_nll")
    p.add_argument('--arc_limit', type=int, default=None, help="score only the first N ARC-Easy questions")
    p.add_argument('--nll_limit', type=int, default=None, help="score only the first N examples of each NLL task")
    p.add_argument('--perm_late_only', action='store_true', help="swap only late pairs (enough for R_perm)")
    p.add_argument('--n_boot', type=int, default=1000, help="bootstrap resamples of the propagation statistics")
    p.add_argument('--causal_threshold', type=float, default=CAUSAL_THRESHOLD,
                   help="R_causal counts blocks whose causal score C exceeds this (Eq. 6)")
    p.add_argument('--perm_threshold', type=float, default=PERM_THRESHOLD,
                   help="R_perm counts block pairs whose permutation score P exceeds this (Eq. 8)")
    p.add_argument('--jacobian_probes', type=int, default=analysis.JACOBIAN_PROBES,
                   help="random probe vectors per block for the Jacobian deviation (0 = exact, D probes)")
    p.add_argument('--usefulness_threshold', type=float, default=analysis.USEFULNESS_THRESHOLD,
                   help="a block is significant when its linear stand-in raises the loss by more than this")
    p.add_argument('--label', default=None, help="name in figures (default: the checkpoint's directory)")
    args = p.parse_args(argv)
    try:
        if bool(args.ckpt) == bool(args.compare):
            raise ValueError("pass either --ckpt=PATH or --compare PATH PATH ...")
        metrics = parse_metrics(args.metrics)
        args.dtype = args.dtype or ('bfloat16' if str(args.device).startswith('cuda') else 'float32')
        if args.device.startswith('cuda') and not torch.cuda.is_available():
            raise ValueError(f"--device={args.device} but CUDA is not available; use --device=cpu")
        if args.dtype == 'bfloat16' and not args.device.startswith('cuda'):
            raise ValueError(f"--dtype=bfloat16 autocast is for CUDA only; on {args.device} use --dtype=float32")
        if args.jacobian_probes < 0 or args.usefulness_threshold < 0:
            raise ValueError("--jacobian_probes and --usefulness_threshold must be >= 0")
        for name in ('n_windows', 'seq_len', 'batch_size', 'eval_batch_size', 'n_boot'):
            if getattr(args, name) is not None and getattr(args, name) < 1:
                raise ValueError(f"--{name} must be >= 1")
        if args.ckpt:
            out_dir = args.out_dir or default_probe_dir(args.ckpt)
            results = probe_checkpoint(args.ckpt, metrics, args, json_path=Path(out_dir) / 'probe.json')
            for path in write_results(results, out_dir):
                print(f"wrote {path}")
            return results
        if args.label:
            raise ValueError("--label names the model of --ckpt; under --compare each model is named by "
                             "its run directory (and file name)")
        labels = [json.loads(Path(p).read_text())['label'] if p.endswith('.json') and Path(p).is_file()
                  else default_label(p) for p in args.compare]
        if len(set(labels)) < len(labels):  # compare.json is keyed by label: one would hide the other
            raise ValueError(f"two models share a label in {labels} (a label is the run directory's name, plus "
                             f"the file name for a file other than ckpt.pt): compare runs with distinct names")
        from probes import plots
        out_dir = Path(args.out_dir or 'out/probe_compare')
        all_results = []
        for path, label in zip(args.compare, labels):
            if path.endswith('.json'):
                all_results.append(load_results(path))
            else:  # each model's results under out_dir/<label>/: nothing outside --out_dir is written
                own = out_dir / label.replace('/', '__')
                r = probe_checkpoint(path, metrics, args, json_path=own / 'probe.json')
                write_results(r, own)
                all_results.append(r)
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json({r['label']: {k: v for k, v in r.items() if k in ('late_pairs', 'prune', 'propagation',
                                                                     'usefulness', 'prune_lm')}
                    for r in all_results}, out_dir / 'compare.json')
        for path in plots.plot_all(all_results, out_dir):
            print(f"wrote {path}")
        return all_results
    except (ValueError, FileNotFoundError, fastpath.FastPathMismatch) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == '__main__':
    main()
