"""
Running a model with interventions, shared by probe.py and probes/analysis.py: micro-batches of
evaluation windows, the clean scheme states of a batch, continuing a state through another
block order (skip / swap / drop, docs/probes.md), and `PrefixRunner`, which reuses the clean
run's prefix so that the O(L^2) interventions of Sec. 4 cost O(L^2 / 2) blocks.
"""

import hashlib

import torch.nn.functional as F
from tqdm import tqdm


def batches(windows, batch_size, device, desc=None, progress=False):
    """Yields micro-batches (b, T) of the windows on `device`."""
    starts = range(0, len(windows), batch_size)
    for s in tqdm(starts, desc=desc, unit='batch', disable=None if progress else True, leave=False):
        yield windows[s:s + batch_size].to(device)


def device_of(model):
    return next(model.parameters()).device

# -----------------------------------------------------------------------------
# prefix reuse: run the shared prefix once, continue it for every intervention

def clean_states(model, idx):
    """The scheme states after the embedding and after each block of the default order:
    a list of n_layer + 1 states (never modified in place, so they can be continued)."""
    res, rope = model.residual, (model.rope_cos[:idx.size(1)], model.rope_sin[:idx.size(1)])
    states = [res.begin(model.wte(idx))]
    for b in range(model.config.n_layer):
        states.append(res.block(states[-1], b, model.blocks[b], rope))
    return states


def run_from(model, state, order, seq_len, skip=(), record=None):
    """Continues a scheme state through the blocks of `order` (skipping those in `skip` with
    the scheme's skip rule), as GPT.hidden does after its prefix. With record=[] appends
    (probe_state, lens_state) after every block. Returns the final state (not yet `end`ed)."""
    res, rope = model.residual, (model.rope_cos[:seq_len], model.rope_sin[:seq_len])
    for b in order:
        state = res.skip(state, b) if b in skip else res.block(state, b, model.blocks[b], rope)
        if record is not None:
            record.append((res.probe(state), res.lens(state)))
    return state


class PrefixRunner:
    """GPT.hidden / logits with interventions, reusing the clean run of each input batch.

    The clean states of a batch are computed once (keyed by the token ids) and kept until
    clear(). A request (order, skip) starts from the clean state after its longest prefix
    that agrees with the default order and skips nothing, so skipping block s costs L - s
    blocks and swapping blocks i < j costs L - i, instead of L each time."""

    def __init__(self, model):
        self.model, self._cache = model, {}

    def states(self, idx):
        key = (tuple(idx.shape), hashlib.sha1(idx.cpu().numpy().tobytes()).hexdigest())
        if key not in self._cache:
            self._cache[key] = clean_states(self.model, idx)
        return self._cache[key]

    def clear(self):
        self._cache.clear()

    def hidden(self, idx, order=None, skip=(), record=None):
        """Same result and record as model.hidden(idx, order, skip, record): h (B, T, d)."""
        order = list(range(self.model.config.n_layer)) if order is None else list(order)
        k = 0
        while k < len(order) and order[k] == k and k not in skip:
            k += 1
        states, res = self.states(idx), self.model.residual
        if record is not None:
            record.extend((res.probe(s), res.lens(s)) for s in states[:k + 1])
        return res.end(run_from(self.model, states[k], order[k:], idx.size(1), skip, record))

    def logits(self, idx, order=None, skip=()):
        """(B, T, V) logits of the model run with `order` / `skip`."""
        return self.model.head(self.hidden(idx, order, skip))


def swap_order(n_layer, i, j):
    """The default block order with blocks i and j exchanged (Eq. 4)."""
    order = list(range(n_layer))
    order[i], order[j] = order[j], order[i]
    return order


def flat(z):
    # a probe state as one vector per token, in fp32: (B, T, ...) -> (B, T, D); HC streams -> R^{m d}
    return z.float().flatten(2)


def ce_sum(logits, idx):
    # summed next-token cross-entropy (nats) over the T - 1 predictions of each window
    V = logits.size(-1)
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, V), idx[:, 1:].reshape(-1), reduction='sum').item()
