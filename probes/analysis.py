"""
The study's block-level analyses beyond the diagnostics of the paper's Sec. 4 (docs/probes.md),
for every residual scheme through the scheme interface (begin / block / skip / probe): how
close each block is to the identity (Jacobian deviation), whether a linear map could stand
in for it (usefulness), how many directions the tokens span at each depth (token collapse),
and what skipping a block costs in held-out LM loss (LM pruning). probe.py registers them as metrics:

    python probe.py --ckpt=out/mini/hc_L8/ckpt.pt --metrics=jacobian,usefulness,token_collapse,prune_lm

Definitions follow the study's analysis scripts (keyu-wang-2002/DepthBench, analysis/
compute_jacobian.py, compute_usefulness_score.py, compute_token_collapse.py,
compute_layer_pruning.py); docs/analyses.md states them with the estimator's error.

The "block's map" is the map of the depth state z_l = residual.probe(state) (docs/probes.md, depth states:
the residual stream; HC/mHC's m streams as one m*d vector; AttnRes's raw depth mix) to
z_{l+1}, with everything else the state holds (AttnRes's source bank, MoDA's depth cache)
kept as in the clean run. It needs z_l to be a slot of the state (set_probe); a scheme whose
depth state is computed from several streams (ResiDual) has no such map and is skipped.
"""

import math

import numpy as np
import torch

from probes.runs import PrefixRunner, batches, ce_sum, clean_states, flat, run_from

JACOBIAN_PROBES = 16          # random probe vectors per block (0 = exact, D probes)
USEFULNESS_THRESHOLD = 0.10   # a block is significant when its linear stand-in raises the loss by > 10%

# -----------------------------------------------------------------------------
# per-block health during training (train.py's log rows)


def block_stats(model, x, ctx):
    """Per-block depth health, practitioners' signals beside the paper's Sec. 4 diagnostics, after a
    backward: the gradient norm of each block's parameters (branches + the scheme's block
    parameters) and the RMS of each block's probe state on the first 2 sequences of micro-batch x
    (B, T), under `ctx` (autocast). Returns {'block_grad_norm': [L], 'block_act_rms': [L]}."""
    grads = []
    for b in range(model.config.n_layer):
        params = list(model.blocks[b].parameters())
        if hasattr(model.residual, 'layers'):
            params += list(model.residual.layers[b].parameters())
        g = [p.grad.float().norm() for p in params if p.grad is not None]
        grads.append(torch.stack(g).norm().item() if g else 0.0)
    record = []
    with torch.no_grad(), ctx:
        model.hidden(x[:2], record=record)
    rms = [z.float().pow(2).mean().sqrt().item() for z, _ in record[1:]]
    return {'block_grad_norm': grads, 'block_act_rms': rms}

# -----------------------------------------------------------------------------
# the depth state as a slot of the scheme state


def _fields(state):
    # the top-level fields of a scheme state: a tensor is its own only field
    return [state] if torch.is_tensor(state) else list(state)


def _is_slot(f, z):
    # z = probe(state) is the field itself or a reshaped view of it (HC: H.flatten(-2))
    return torch.is_tensor(f) and (f is z or (f.data_ptr() == z.data_ptr() and f.numel() == z.numel()
                                              and f.dtype == z.dtype))


def has_probe_slot(residual, state):
    """True when residual.probe(state) is a field of the state (or a view of one), so that
    the depth state can be set (set_probe). False for ResiDual, whose z is computed."""
    z = residual.probe(state)
    return any(_is_slot(f, z) for f in _fields(state))


def set_probe(residual, state, z):
    """The scheme state with its depth state replaced by z (B, T, D) (every top-level field
    that holds residual.probe(state), reshaped to that field's shape; the source banks of
    AttnRes and MoDA's cache are left as they are). probe(set_probe(state, z)) == z.
    Raises ValueError when the depth state is not a field of the state."""
    z0 = residual.probe(state)
    fields = _fields(state)
    hit = [i for i, f in enumerate(fields) if _is_slot(f, z0)]
    if not hit:
        raise ValueError(f"{type(residual).__name__}: the depth state is computed from the state, "
                         f"not held in it; the block's map of z_l to z_l+1 is not defined")
    if torch.is_tensor(state):
        return z.reshape(state.shape)
    fields = [z.reshape(f.shape) if i in hit else f for i, f in enumerate(fields)]
    return type(state)(*fields) if hasattr(state, '_fields') else type(state)(fields)


def _rope(model, T):
    return model.rope_cos[:T], model.rope_sin[:T]


def _supported(model):
    idx = torch.zeros(1, 2, dtype=torch.long, device=next(model.parameters()).device)
    with torch.no_grad():
        return has_probe_slot(model.residual, model.residual.begin(model.wte(idx)))

# -----------------------------------------------------------------------------
# singular-value statistics (token collapse)


def sval_metrics(H):
    """Stable rank, entropy effective rank and L1/L2 ratio of the singular values s of a
    (tokens x d) matrix H, not centred (compute_token_collapse.py):
        stable_rank = sum s^2 / max s^2,  erank = exp(-sum p log p) with p = s^2 / sum s^2,
        l1_l2 = sum s / sqrt(sum s^2)  (its square is the participation ratio of s).
    All three are 1 for a rank-one H; for k equal singular values stable rank = erank = k and
    L1/L2 = sqrt(k) (the study's script says min(T, D) for all three at full spread, but the
    L1/L2 ratio tops out at sqrt(min(T, D))).
    H: (..., n, D) -> dict of (...) float64 tensors; an all-zero H gives 1 (the study's)."""
    s = torch.linalg.svdvals(H.double())
    s2 = s.pow(2)
    tot = s2.sum(-1)
    zero = tot <= 1e-300
    p = s2 / tot.clamp_min(1e-300).unsqueeze(-1)
    one = torch.ones_like(tot)
    return {'stable_rank': torch.where(zero, one, tot / s2.max(-1).values.clamp_min(1e-300)),
            'erank': torch.where(zero, one, torch.exp(-torch.special.xlogy(p, p).sum(-1))),
            'l1_l2': torch.where(zero, one, s.sum(-1) / tot.clamp_min(1e-300).sqrt())}


def fit_linear(X, Y):
    """Least-squares affine map Y ~ X W + b (float64, minimum-norm when X is rank deficient,
    e.g. HC's z_0 = m copies of the embedding). X (N, D), Y (N, D') -> W (D, D'), b (D',)."""
    Xb = torch.cat([X.double(), torch.ones(len(X), 1, dtype=torch.float64, device=X.device)], 1).cpu()
    sol = torch.linalg.lstsq(Xb, Y.double().cpu(), driver='gelsd').solution  # (D + 1, D')
    return sol[:-1], sol[-1]

# -----------------------------------------------------------------------------
# the analyses


def jacobian_deviation(model, windows, batch_size=4, n_probes=JACOBIAN_PROBES, seed=0, progress=False):
    """Deviation of each block's map from the identity, ||J_l - I||_F / sqrt(D)
    (compute_jacobian.py), where J_l (D x D, D = dim of the depth state: d, or m*d for HC)
    is the Jacobian of z_{l+1} with respect to z_l averaged over the N token positions of the
    windows, cross-token terms included (a change of z_l at every position, the response
    summed over positions): J_l = (1/N) sum_p sum_q dz_{l+1,q} / dz_{l,p}.

    Estimator: A = J_l^T - I, E ||A v||^2 = ||A||_F^2 for Rademacher v (Hutchinson); each
    probe is one backward pass through block l (grad_outputs v at every position), so the
    cost does not grow with D^2. With n_probes = k the estimate of ||A||_F^2 is the mean of k
    samples, its standard error their std / sqrt(k), carried to the deviation by the delta
    method; n_probes = 0 uses the D basis vectors and is exact (se 0).
    windows: (N_w, T) int64. Returns {'deviation': [L], 'se': [L], 'n_probes', 'exact', 'dim',
    'n_tokens'}. Raises ValueError for a scheme without a depth-state slot (set_probe)."""
    model.eval()
    if not _supported(model):
        raise ValueError(f"jacobian: {model.config.residual!r} computes its depth state from several streams")
    L, res, dev = model.config.n_layer, model.residual, next(model.parameters()).device
    S, V, N = None, None, 0
    for idx in batches(windows, batch_size, dev, 'jacobian', progress):
        rope = _rope(model, idx.size(1))
        with torch.no_grad():
            states = clean_states(model, idx)
        if V is None:
            D = flat(res.probe(states[0])).size(-1)
            if n_probes:
                g = torch.Generator().manual_seed(seed)
                V = (torch.randint(0, 2, (n_probes, D), generator=g) * 2 - 1).double()
            else:
                V = torch.eye(D, dtype=torch.float64)
            S = torch.zeros(L, len(V), D, dtype=torch.float64)
        for b in range(L):
            with torch.enable_grad():
                z = flat(res.probe(states[b])).detach().float().requires_grad_(True)  # (B, T, D)
                out = flat(res.probe(res.block(set_probe(res, states[b], z), b, model.blocks[b], rope)))
                for k in range(len(V)):
                    v = V[k].to(out.dtype).to(dev).expand_as(out)
                    (g,) = torch.autograd.grad(out, z, v, retain_graph=k < len(V) - 1)
                    S[b, k] += g.double().sum((0, 1)).cpu()  # sum over positions: (J^T v) * N
        N += idx.numel()
    r = ((S / N - V) ** 2).sum(-1)  # (L, K): ||(J^T - I) v_k||^2
    D = V.size(1)
    if n_probes:
        F2 = r.mean(-1)
        se2 = r.std(-1, correction=1) / math.sqrt(n_probes) if n_probes > 1 else torch.full_like(F2, float('nan'))
    else:
        F2, se2 = r.sum(-1), torch.zeros(L, dtype=torch.float64)
    deviation = (F2 / D).sqrt()
    se = torch.where(F2 > 0, se2 / (2 * (F2 * D).sqrt().clamp_min(1e-300)), torch.zeros_like(F2))
    return {'deviation': deviation.tolist(), 'se': se.tolist(), 'n_probes': int(n_probes or D),
            'exact': not n_probes, 'dim': D, 'n_tokens': N}


@torch.no_grad()
def usefulness(model, windows, batch_size=4, threshold=USEFULNESS_THRESHOLD, progress=False):
    """Usefulness score (compute_usefulness_score.py): block l is replaced by the best
    least-squares affine map z_{l+1} ~ z_l W + b, fitted on the depth states of these held-out
    windows (every position; the study fits and scores on the same tokens), and the mean
    next-token cross-entropy of the model is measured again. A block is significant when
    loss_linear / loss > 1 + threshold (the study: 10%); the score is the share of significant
    blocks. Replacing = the scheme's skip rule for the block (no AttnRes sources added, MoDA
    slots left empty) with its depth state set to the linear prediction (set_probe).
    Returns {'loss', 'linear_loss', 'loss_ratio', 'loss_increase', 'significant': lists of L,
    'score', 'n_significant', 'threshold', 'fit_r2': [L] (share of the variance of z_{l+1}
    the map explains), 'n_tokens'}. Raises ValueError for a scheme without a depth-state slot."""
    model.eval()
    if not _supported(model):
        raise ValueError(f"usefulness: {model.config.residual!r} computes its depth state from several streams")
    L, res, dev = model.config.n_layer, model.residual, next(model.parameters()).device
    X, Y = [[] for _ in range(L)], [[] for _ in range(L)]
    for idx in batches(windows, batch_size, dev, 'usefulness (fit)', progress):
        z = [flat(res.probe(s)).flatten(0, 1).cpu() for s in clean_states(model, idx)]
        for b in range(L):
            X[b].append(z[b]), Y[b].append(z[b + 1])
    fits, r2 = [], []
    for b in range(L):
        Xb, Yb = torch.cat(X[b]), torch.cat(Y[b])
        W, c = fit_linear(Xb, Yb)
        pred = Xb.double() @ W + c
        yc = Yb.double() - Yb.double().mean(0)
        r2.append(1 - ((pred - Yb.double()) ** 2).sum().item() / max((yc ** 2).sum().item(), 1e-300))
        fits.append((W, c))
    X = Y = None
    base, lin, n_pred = 0.0, np.zeros(L), 0
    for idx in batches(windows, batch_size, dev, 'usefulness (loss)', progress):
        T = idx.size(1)
        states = clean_states(model, idx)
        base += ce_sum(model.head(res.end(states[-1])), idx)
        for b in range(L):
            W, c = fits[b]
            z = flat(res.probe(states[b]))
            zhat = (z.double() @ W.to(z.device) + c.to(z.device)).to(z.dtype)
            st = set_probe(res, res.skip(states[b], b), zhat)
            h = res.end(run_from(model, st, range(b + 1, L), T))
            lin[b] += ce_sum(model.head(h), idx)
        n_pred += idx.size(0) * (T - 1)
    loss, linear_loss = base / n_pred, lin / n_pred
    ratio = linear_loss / loss
    sig = [bool(x > 1 + threshold) for x in ratio]
    return {'loss': loss, 'linear_loss': linear_loss.tolist(), 'loss_ratio': ratio.tolist(),
            'loss_increase': (linear_loss - loss).tolist(), 'significant': sig, 'score': sum(sig) / L,
            'n_significant': sum(sig), 'threshold': threshold, 'fit_r2': r2, 'n_tokens': n_pred}


@torch.no_grad()
def token_collapse(model, windows, batch_size=4, progress=False):
    """Token collapse per depth state (compute_token_collapse.py): for every window and every
    l = 0..L, the singular values of the (T x D) matrix of the depth state z_l (not centred)
    give sval_metrics; each is averaged over the windows. Collapse (all tokens along one
    direction) sends all three to 1; 'max_rank' = min(T, D) is the ceiling of the stable rank
    and erank, sqrt(max_rank) that of L1/L2.
    Returns {'stable_rank', 'erank', 'l1_l2': lists of L+1, 'max_rank', 'n_windows'}."""
    model.eval()
    sums, n, max_rank = None, 0, None
    for idx in batches(windows, batch_size, next(model.parameters()).device, 'token collapse', progress):
        rec = []
        model.hidden(idx, record=rec)
        Z = torch.stack([flat(p) for p, _ in rec], 1)  # (B, L+1, T, D)
        m = sval_metrics(Z)
        m = {k: v.sum(0).cpu() for k, v in m.items()}  # (L+1,) summed over the windows
        sums = m if sums is None else {k: sums[k] + m[k] for k in m}
        n += idx.size(0)
        max_rank = min(Z.shape[-2:])
    out = {k: (v / n).tolist() for k, v in sums.items()}
    out.update(max_rank=int(max_rank), n_windows=n)
    return out


@torch.no_grad()
def prune_lm(model, windows, batch_size=4, progress=False):
    """Single-block pruning on the held-out LM loss (compute_layer_pruning.py without --task):
    the mean next-token cross-entropy (nats per token) of the model with block l skipped (the
    skip rule of causal_scores), for every l, on the same windows. 'se' is the standard
    error of the increase over windows (the paired per-window differences; windows as units).
    Returns {'loss', 'loss_skip', 'delta', 'se': lists of L, 'n_windows', 'n_tokens'}."""
    model.eval()
    L = model.config.n_layer
    runner = PrefixRunner(model)
    per_window = []  # (n_windows, L + 1): summed CE of each window, clean then each skip
    for idx in batches(windows, batch_size, next(model.parameters()).device, 'prune (LM loss)', progress):
        rows = []
        for skip in [()] + [(b,) for b in range(L)]:
            logits = runner.logits(idx, skip=skip)[:, :-1].float()
            ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), idx[:, 1:], reduction='none')  # (B, T-1)
            rows.append(ce.mean(1).double().cpu())
        runner.clear()
        per_window.append(torch.stack(rows, 1))
    M = torch.cat(per_window).numpy()  # every window has T - 1 predictions: means weigh equally
    loss, skip = M[:, 0].mean(), M[:, 1:].mean(0)
    diff = M[:, 1:] - M[:, :1]
    se = diff.std(0, ddof=1) / math.sqrt(len(M)) if len(M) > 1 else np.full(L, np.nan)
    return {'loss': float(loss), 'loss_skip': skip.tolist(), 'delta': (skip - loss).tolist(), 'se': se.tolist(),
            'n_windows': len(M), 'n_tokens': int(len(M) * (windows.size(1) - 1))}

# -----------------------------------------------------------------------------
# registration in probe.py: name -> (function of (model, windows, batch_size, args), default
# (n_windows, seq_len), one-line summary of a result)


def _report_jacobian(r):
    k = 'exact' if r['exact'] else f"{r['n_probes']} probes"
    return (f"jacobian: ||J - I||_F / sqrt(D) per block {np.round(r['deviation'], 3).tolist()} "
            f"({k}, max s.e. {max(r['se']):.3f})")


def _report_usefulness(r):
    return (f"usefulness: {r['n_significant']}/{len(r['significant'])} blocks significant "
            f"(linear stand-in raises the loss > {100 * r['threshold']:.0f}%), loss ratios "
            f"{np.round(r['loss_ratio'], 3).tolist()}")


def _report_token_collapse(r):
    return (f"token_collapse: erank per state {np.round(r['erank'], 1).tolist()} "
            f"(of at most {r['max_rank']})")


def _report_prune_lm(r):
    worst = int(np.argmax(r['delta']))
    return (f"prune_lm: loss {r['loss']:.4f} nats; largest rise: block {worst} "
            f"(+{r['delta'][worst]:.4f} ± {r['se'][worst]:.4f})")


ANALYSES = {
    'jacobian': (lambda model, w, bs, args: jacobian_deviation(model, w, bs, n_probes=getattr(args, 'jacobian_probes', JACOBIAN_PROBES),
                                                               seed=getattr(args, 'seed', 0), progress=True),
                 (16, 512), _report_jacobian),
    'usefulness': (lambda model, w, bs, args: usefulness(model, w, bs, threshold=getattr(args, 'usefulness_threshold', USEFULNESS_THRESHOLD),
                                                         progress=True),
                   (16, 256), _report_usefulness),
    'token_collapse': (lambda model, w, bs, args: token_collapse(model, w, bs, progress=True),
                       (256, 512), _report_token_collapse),
    'prune_lm': (lambda model, w, bs, args: prune_lm(model, w, bs, progress=True), (16, 256), _report_prune_lm),
}
