"""
The KV cache of generation (model.KVCache, sample.py): for every scheme, greedy generation
with the cache writes the same tokens as recomputing the context for every token (fp32,
prompts of several lengths, past block_size); the cache holds exactly the bytes of
cost.kv_cache_bytes (paper Sec. 4.4) at several shapes, in fp32 and under bf16 autocast; the
training forward is the same with and without it; a step past block_size is refused.

    python -m pytest tests/test_kv_cache.py -q
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cost  # noqa: E402
import fast  # noqa: E402
import sample  # noqa: E402
from checkpoint import save_checkpoint  # noqa: E402
from model import GPT, GPTConfig, KVCache  # noqa: E402
from residuals import RESIDUALS  # noqa: E402

BLOCK = 12


def make(residual, n_layer=3, n_embd=32, n_head=4, n_kv_head=2, block_size=BLOCK, vocab_size=61, seed=0):
    """A tiny fp32 model with every parameter random (zero queries, identity routing or zero
    gates would hide a depth state that crosses tokens); Block AttnRes in blocks of 2."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_embd=n_embd,
                          n_head=n_head, n_kv_head=n_kv_head, residual=residual, attnres_blocks=n_layer))
    fast.randomise(model, seed)
    return model.float().eval()


def greedy_recomputed(model, idx, n):
    """An independent greedy loop: every token from a full forward of the last block_size
    tokens, no cache. Returns the tokens (B, n) and each step's logits (n, B, V)."""
    out, logits = idx, []
    with torch.no_grad():
        for _ in range(n):
            lg = model(out[:, -model.config.block_size:])[0][:, -1]  # (B, V)
            logits.append(lg)
            out = torch.cat([out, lg.argmax(-1, keepdim=True)], dim=1)
    return out[:, idx.size(1):], torch.stack(logits)


@pytest.mark.parametrize('residual', list(RESIDUALS))
def test_cached_greedy_generation_equals_recomputing_for_every_scheme(residual):
    """Prompts of 1, 5 and 15 tokens (the last longer than block_size = 12), 14 new tokens:
    the first two prompts cross block_size while generating (the cache fills, then the window
    slides); batch of 2. The same tokens as the recomputing loop, and at every step a top-2
    margin wider than the cached logits' distance, so the equality is not a lucky tie."""
    model = make(residual)
    gen = torch.Generator().manual_seed(1)
    for T in (1, 5, 15):
        idx = torch.randint(0, 61, (2, T), generator=gen)
        want, logits = greedy_recomputed(model, idx, 14)
        got = sample.generate(model, idx, 14, temperature=0)
        assert torch.equal(got[:, :T], idx)
        assert torch.equal(got[:, T:], want), f"prompt of {T}: {got[:, T:].tolist()} != {want.tolist()}"
        # teacher-forced on the same tokens, the cached logits are the recomputed ones
        cached = torch.stack(cached_logits(model, idx, want))  # (n, B, V)
        err = (cached - logits).abs().amax()
        top2 = logits.topk(2, dim=-1).values
        assert err < 1e-4 and (top2[..., 0] - top2[..., 1]).min() > 2 * err, (residual, T, err)


def test_moda_generation_with_the_fast_paths_on():
    """MoDA with its fast paths on (the depth cache in place of MoDA.block, SDPA for the joint
    softmax): cached generation takes the plain block, whose attention the KV cache feeds, and
    gives the tokens of the plain model's recomputing loop; its logits match to 1e-4."""
    model = make('moda')
    idx = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(1))
    want, logits = greedy_recomputed(model, idx, 10)
    assert [p.name for p in fast.setup(model, True, 'cpu')] == ['moda_depth_cache', 'moda_sdpa']
    try:
        got = sample.generate(model, idx, 10, temperature=0)
        assert torch.equal(got[:, 5:], want)
        assert (torch.stack(cached_logits(model, idx, want)) - logits).abs().amax() < 1e-4
        assert (greedy_recomputed(model, idx, 10)[1] - logits).abs().amax() < 1e-4  # the fast training forward
    finally:
        fast.disable(model)


def cached_logits(model, prompt, tokens):
    """The logits of every step of sample.stream's cached path, fed `tokens` (B, n) instead of
    its own picks: a list of n (B, V) tensors."""
    out, cache, idx = [], None, prompt
    bs = model.config.block_size
    with torch.no_grad():
        for t in range(tokens.size(1)):
            if cache is not None and cache.pos < bs:
                h = model.hidden(idx[:, -1:], cache=cache)
            else:
                cache = KVCache(model.config.n_layer)
                h = model.hidden(idx[:, -bs:], cache=cache)
            out.append(model.head(h[:, -1:])[:, -1])
            idx = torch.cat([idx, tokens[:, t:t + 1]], dim=1)
    return out


def test_the_cache_runs_one_token_per_step_until_the_window_is_full():
    """What the cache buys: after the prompt, each step runs the blocks on 1 token, until the
    context reaches block_size; then every step runs the last block_size tokens (the window
    slides). Without the cache every step runs the whole context."""
    model = make('preln')
    seen = []
    hidden = model.hidden
    model.hidden = lambda idx, *a, **k: (seen.append(idx.size(1)), hidden(idx, *a, **k))[1]
    sample.generate(model, torch.zeros(1, 5, dtype=torch.long), 10, temperature=0)
    assert seen == [5] + [1] * 7 + [BLOCK] * 2  # contexts 5, 6, ..., 12, then 12 + 1 and 12 + 2 cropped
    seen.clear()
    sample.generate(model, torch.zeros(1, 5, dtype=torch.long), 10, temperature=0, kv_cache=False)
    assert seen == [5, 6, 7, 8, 9, 10, 11, 12, 12, 12]


@pytest.mark.parametrize('shape', [
    # n_layer, n_embd, n_head, n_kv_head, tokens, batch, dtype
    (2, 32, 4, 4, 9, 1, torch.float32),     # MHA
    (3, 48, 6, 2, 12, 2, torch.float32),    # GQA, the cache filled to block_size
    (4, 64, 4, 1, 7, 3, torch.bfloat16),    # one KV head, bf16 autocast: the paper's 2 bytes
])
def test_the_cache_holds_the_bytes_of_the_kv_formula(shape):
    """Prompt, then single tokens, then a chunk of 2: cache.nbytes() (the storage under every
    cached tensor, each counted once) = cost.kv_cache_bytes for every scheme: the sequence
    cache 2 L T H_kv hd bytes B, nothing more (MoDA's depth slots do not outlive a token)."""
    L, d, H, Hkv, T, B, dtype = shape
    for residual in RESIDUALS:
        model = make(residual, n_layer=L, n_embd=d, n_head=H, n_kv_head=Hkv)
        idx = torch.randint(0, 61, (B, T), generator=torch.Generator().manual_seed(0))
        cache = KVCache(L)
        with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            model.hidden(idx[:, :T - 3], cache=cache)
            model.hidden(idx[:, T - 3:T - 2], cache=cache)
            model.hidden(idx[:, T - 2:], cache=cache)
        assert cache.pos == T and all(k.dtype == dtype for k in cache.k + cache.v)
        want = cost.kv_cache_bytes(L, d, T, n_head=H, n_kv_head=Hkv, bytes_per_elem=dtype.itemsize, batch=B,
                                   residual=residual)
        assert cache.nbytes() == want, (residual, cache.nbytes(), want)
    assert cost.kv_cache_bytes(2, 32, 9, n_head=4, bytes_per_elem=4) == 2 * 2 * 9 * 4 * 8 * 4  # by hand: 4,608


def test_the_training_forward_is_the_same_with_and_without_a_cache():
    """The cache is an argument used only when given: a prefill into an empty cache runs the
    training forward's ops (bit for bit), and without a cache every attention is SDPA's
    is_causal with no mask, as before the cache existed."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append((q.size(2), k.size(2), attn_mask is None, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)
    for residual in RESIDUALS:
        model = make(residual)
        idx = torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            plain = model.hidden(idx)
            assert torch.equal(model.hidden(idx, cache=KVCache(3)), plain), residual
        torch.nn.functional.scaled_dot_product_attention = spy
        try:
            calls.clear()
            with torch.no_grad():
                model.hidden(idx)
        finally:
            torch.nn.functional.scaled_dot_product_attention = sdpa
        # MoDA calls SDPA only at position 0 (its other blocks attend over depth too)
        assert calls and all(c == (10, 10, True, True) for c in calls), (residual, calls)


def test_a_step_past_block_size_is_refused():
    """pos + T = block_size is the last that fits (RoPE's table, the trained length); one more is a one-line error."""
    model = make('attnres')
    cache = KVCache(3)
    with torch.no_grad():
        model.hidden(torch.zeros(1, BLOCK - 1, dtype=torch.long), cache=cache)
        model.hidden(torch.zeros(1, 1, dtype=torch.long), cache=cache)
        assert cache.pos == BLOCK
        with pytest.raises(ValueError, match=f"sequence length {BLOCK + 1} exceeds block_size {BLOCK}"):
            model.hidden(torch.zeros(1, 1, dtype=torch.long), cache=cache)


def test_sample_py_with_and_without_the_cache(tmp_path, capsys):
    """sample.py greedy: --kv_cache=False writes the same text; stderr's last line gives the tokens per second."""
    from dataclasses import asdict
    model = make('moda', vocab_size=257)
    ckpt = tmp_path / 'ckpt.pt'
    save_checkpoint(str(ckpt), {'model': model.state_dict(), 'model_args': asdict(model.config), 'config': {'dataset': 'x'},
                'iter_num': 0, 'tokenizer': 'byte'})
    args = [f'--init_from={ckpt}', '--device=cpu', '--start=abc', '--num_samples=2', '--max_new_tokens=20',
            '--temperature=0']
    cached = sample.main(args)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith('40 tokens in ') and 'tokens/s (KV cache, cpu, float32)' in err, err
    assert sample.main(args + ['--kv_cache=False']) == cached
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert 'tokens/s (no KV cache' in err, err


def test_cost_py_measures_the_cache_against_the_formula(capsys):
    """`python cost.py --kv_cache` (docs/cost.md's table): measured bytes, the formula's, the
    two generations' tokens (the same), a ratio of times; a bad length is one line."""
    rows = cost.measure_kv_cache(['attnres', 'moda'], [(2, 32, {'n_kv_head': 2})], prompt_len=6, new_tokens=5,
                                 rounds=1, vocab_size=61, n_head=4)
    for r in rows:
        assert r['tokens'] == 11 and r['cache_bytes'] == r['formula_bytes'] == 2 * 2 * 11 * 2 * 8 * 4
        assert r['same_tokens'] and r['speedup'] > 0 and r['tokens_per_s_cache'] > 0
    assert cost.main(['--kv_cache', '--schemes=preln', '--shapes=2x32', '--n_head=4', '--seq_len=4',
                      '--new_tokens=2', '--iters=1']) == 0
    out = capsys.readouterr().out
    assert 'KV cache: a prompt of 4 tokens, then 2 greedy tokens' in out and '| preln | 2 | 32 | 4/4 | 6 |' in out
    assert cost.main(['--kv_cache', '--schemes=preln', '--shapes=2x32', '--n_head=4', '--new_tokens=0']) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith('error:') and 'new_tokens=0' in err and '\n' not in err
