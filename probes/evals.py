"""
Evaluation scoring of DepthBench (paper, arXiv 2609.32534): ARC-Easy accuracy by
comparing choice log-likelihoods (used by single-layer pruning, Fig. 8 left) and the
completion-only domain NLL of coding / STEM / math (Fig. 4). Prompts, pair encoding and
scoring: docs/probes.md, evaluations.

Everything here is model-agnostic: a model is any callable

    logits_fn(idx: LongTensor (B, T)) -> FloatTensor (B, T, V)     # logits at every position

so the same code scores a full model, a model with a block skipped, a pruned one, etc.
The data comes from data/evals/<task>.jsonl written by `python data/evals/prepare.py`.
The tokenizer is a parameter everywhere: a model trained with the 'byte' tokenizer must be
scored with it. Typical use (probe.py does this):

    enc = get_tokenizer('gpt2')
    items = load_task('arc_easy')
    pairs = prepare_pairs(enc, items)               # tokenize once, reuse for every pruned model
    for l in range(L):                              # block l dropped; logits (B, T, V)
        logits_fn = lambda idx: model(idx, order=[b for b in range(L) if b != l])[0]
        res = arc_easy_accuracy(logits_fn, enc, items, pairs=pairs, max_len=model.config.block_size)

Run `python -m probes.evals [--tokenizer gpt2] [--eval_dir data/evals]` to print, per prepared task,
the number of examples and answer tokens, and how many pairs exceed common context lengths.
"""

import argparse
import json
import math
from pathlib import Path

import torch

EVAL_DIR = Path(__file__).resolve().parents[1] / 'data' / 'evals'
TASKS = ['arc_easy', 'sciq', 'gpqa', 'gsm8k', 'math500', 'mbpp', 'humaneval']
CATEGORIES = {'coding': ['mbpp', 'humaneval'], 'stem': ['sciq', 'gpqa'], 'math': ['gsm8k', 'math500']}
NLL_TASKS = [t for names in CATEGORIES.values() for t in names]

# -----------------------------------------------------------------------------
# data

def load_task(name, eval_dir=EVAL_DIR):
    """Read the prepared items of one task from eval_dir/<name>.jsonl (see data/evals/prepare.py).
    Returns a list of dicts: {"task", "id", "prompt", "answer"}, or for arc_easy
    {"task", "id", "prompt", "choices", "gold"}. Raises ValueError for an unknown task and
    FileNotFoundError (naming the prepare command) when the file is absent."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {TASKS}")
    path = Path(eval_dir) / f"{name}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; run `python data/evals/prepare.py --tasks {name}` "
                                f"from the repo root (add --file {name}=PATH or --hub if the raw data is elsewhere)")
    with open(path, encoding='utf-8') as f:
        items = [json.loads(line) for line in f if line.strip()]
    key = 'choices' if name == 'arc_easy' else 'answer'
    for i, item in enumerate(items):
        if 'prompt' not in item or key not in item:
            raise ValueError(f"{path}: record {i} lacks '{'prompt' if 'prompt' not in item else key}'; "
                             f"re-run `python data/evals/prepare.py --tasks {name}`")
    return items


def load_tasks(names=NLL_TASKS, eval_dir=EVAL_DIR):
    """Load every task of `names` that has been prepared; absent ones are left out (domain_nll
    reports them as skipped). Returns dict name -> items."""
    return {n: load_task(n, eval_dir) for n in names if (Path(eval_dir) / f"{n}.jsonl").is_file()}

# -----------------------------------------------------------------------------
# tokenization

def encode_pair(enc, context, continuation):
    """lm-eval's pair encoding (docs/probes.md, evaluations): trailing whitespace of the context moves to
    the continuation; whole = encode(context + continuation); the continuation tokens are
    whole[len(encode(context)):]. No special tokens. An empty context becomes [enc.eot], as
    lm-eval does. Returns (ctx_ids, cont_ids), two lists of ints; raises ValueError if the
    continuation encodes to no tokens."""
    if context == '':
        ctx_ids, cont_ids = [enc.eot], enc.encode(continuation)
    else:
        n_space = len(context) - len(context.rstrip())
        if n_space:  # e.g. the "\n" after "[BEGIN]" is scored as part of the answer
            context, continuation = context[:-n_space], context[-n_space:] + continuation
        whole = enc.encode(context + continuation)
        ctx_ids = enc.encode(context)
        cont_ids = whole[len(ctx_ids):]
    if not cont_ids:
        raise ValueError(f"continuation {continuation!r} has no tokens of its own; every answer must be non-empty")
    return ctx_ids, cont_ids


def prepare_pairs(enc, items):
    """Tokenize items once, so repeated scoring (a pruning scan calls the scorer L times) is cheap.
    NLL items give one (ctx_ids, cont_ids) pair each; an ARC item gives one pair per choice,
    with continuation " " + choice, flattened in item order. Returns a list of pairs."""
    pairs = []
    for item in items:
        if 'choices' in item:
            pairs.extend(encode_pair(enc, item['prompt'], ' ' + c) for c in item['choices'])
        else:
            pairs.append(encode_pair(enc, item['prompt'], item['answer']))
    return pairs

# -----------------------------------------------------------------------------
# scoring

def _default_device(logits_fn):
    # an nn.Module knows where its weights are; any other callable is assumed to run on the CPU
    params = getattr(logits_fn, 'parameters', None)
    if callable(params):
        p = next(iter(params()), None)
        if p is not None:
            return p.device
    return torch.device('cpu')


@torch.no_grad()
def continuation_logprobs(logits_fn, enc, pairs, *, batch_size=8, max_len=2048, device=None, pad_id=None, progress=False,
                          desc='scoring'):
    """Sum of log p(continuation tokens | context) for each pair (docs/probes.md, evaluations).

    pairs: (context, continuation) strings, encoded with encode_pair, or (ctx_ids, cont_ids)
    token lists from prepare_pairs. Each sequence ctx + cont keeps its last max_len + 1 tokens
    (left truncation, as lm-eval), the model reads the first max_len of them, and the last
    len(cont) positions are scored, so truncation only ever drops context. A continuation longer
    than max_len tokens has only its last max_len tokens scored (n_tokens says how many).
    Sequences are sorted by length (longest first, so memory problems show at once), right-
    padded with pad_id (default enc.eot; padding sits after every scored position, so a causal
    model never sees it) and run batch_size at a time; log-softmax is in fp32.
    device: where idx is sent; default: the device of logits_fn's parameters if it is an
    nn.Module, else CPU (pass it when logits_fn is a lambda around a GPU model).
    Returns a list, in the input order, of (sum_logprob in nats (<= 0), n_tokens).
    Raises ValueError on an empty context or continuation, or on a logits shape mismatch."""
    assert max_len >= 1 and batch_size >= 1
    device = _default_device(logits_fn) if device is None else torch.device(device)
    pad_id = enc.eot if pad_id is None else pad_id
    inputs, targets = [], []
    for ctx, cont in pairs:
        if isinstance(ctx, str):
            ctx, cont = encode_pair(enc, ctx, cont)
        if not ctx or not cont:
            raise ValueError("every pair needs a non-empty context and continuation; use encode_pair to build them")
        window = (list(ctx) + list(cont))[-(max_len + 1):]  # left truncation
        n = min(len(cont), len(window) - 1)
        inputs.append(window[:-1])
        targets.append(window[-n:])
    order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
    results = [None] * len(inputs)
    starts = range(0, len(order), batch_size)
    if progress:
        from tqdm import tqdm
        starts = tqdm(starts, desc=desc, unit='batch', disable=None)  # desc: what is scored; no bar in a log file
    for s in starts:
        batch = order[s:s + batch_size]
        T = len(inputs[batch[0]])  # longest in the batch, as sorted
        idx = torch.full((len(batch), T), pad_id, dtype=torch.long)  # (B, T)
        for r, i in enumerate(batch):
            idx[r, :len(inputs[i])] = torch.tensor(inputs[i])
        logits = logits_fn(idx.to(device))  # (B, T, V)
        if logits.dim() != 3 or logits.shape[:2] != idx.shape:
            raise ValueError(f"logits_fn returned shape {tuple(logits.shape)} for input {tuple(idx.shape)}; "
                             "it must return logits at every position, (B, T, V)")
        sums = []
        for r, i in enumerate(batch):
            t_in, n = len(inputs[i]), len(targets[i])
            logp = logits[r, t_in - n:t_in].float().log_softmax(-1)  # (n, V), position t predicts token t+1
            tgt = torch.tensor(targets[i], device=logp.device)  # (n,)
            sums.append(logp.gather(-1, tgt[:, None]).sum())
        for i, v in zip(batch, torch.stack(sums).tolist()):  # one device sync per batch
            results[i] = (v, len(targets[i]))
    return results


def arc_easy_accuracy(logits_fn, enc, items, *, pairs=None, batch_size=8, max_len=2048, device=None, progress=False):
    """Zero-shot multiple-choice accuracy on ARC-Easy (Fig. 8 left; docs/probes.md, evaluations; lm-eval arc_easy).

    Each choice is scored by the summed log-prob of " " + choice given "Question: ...\\nAnswer:".
    acc: argmax of the sums; acc_norm: argmax of sum / character length of the raw choice text
    (the leading space not counted). Ties go to the first choice, as numpy's argmax.
    items: from load_task('arc_easy'); pairs: prepare_pairs(enc, items) to skip re-tokenizing.
    Returns dict(acc, acc_norm (fractions in [0, 1]), n, pred, pred_norm (chosen indices per
    item), logprobs (per item, per choice, nats)). Raises ValueError if pairs do not match items."""
    if pairs is None:
        pairs = prepare_pairs(enc, items)
    n_choices = [len(item['choices']) for item in items]
    if len(pairs) != sum(n_choices):
        raise ValueError(f"{len(pairs)} pairs for {sum(n_choices)} choices; build them with prepare_pairs(enc, items)")
    scores = continuation_logprobs(logits_fn, enc, pairs, batch_size=batch_size, max_len=max_len,
                                   device=device, progress=progress, desc='ARC-Easy')
    pred, pred_norm, logprobs = [], [], []
    k = 0
    for item, m in zip(items, n_choices):
        lp = [scores[k + j][0] for j in range(m)]
        norm = [v / len(c) for v, c in zip(lp, item['choices'])]  # per character of the choice text
        pred.append(max(range(m), key=lambda j: (lp[j], -j)))
        pred_norm.append(max(range(m), key=lambda j: (norm[j], -j)))
        logprobs.append(lp)
        k += m
    n = len(items)
    gold = [item['gold'] for item in items]
    return {'acc': sum(p == g for p, g in zip(pred, gold)) / max(n, 1),
            'acc_norm': sum(p == g for p, g in zip(pred_norm, gold)) / max(n, 1),
            'n': n, 'pred': pred, 'pred_norm': pred_norm, 'logprobs': logprobs}


def domain_nll(logits_fn, enc, tasks_data, *, pairs=None, batch_size=8, max_len=2048, device=None, progress=False):
    """Completion-only NLL of the reference answers (Fig. 4; docs/probes.md, evaluations), in nats per token.

    tasks_data: dict task -> items (e.g. load_tasks()); pairs: optional dict task -> prepare_pairs.
    Per task: nll = sum over examples of -log p(answer tokens) / total answer tokens (token-
    weighted; ppl = exp(nll)). Per category (CATEGORIES): 'nll' = unweighted mean of its tasks'
    nll (the study's code does not combine them; this is the figure's choice) and 'nll_pooled' =
    token-weighted over its tasks. A task of NLL_TASKS absent from tasks_data is listed in
    'skipped' and in its category's 'missing'; the category then uses the tasks it has (None if none).
    'n_truncated' counts examples whose prompt + answer did not fit in max_len + 1 tokens.
    Returns {'tasks': {task: {nll, ppl, nll_sum, n_tokens, n_examples, n_truncated}},
             'categories': {cat: {nll, nll_pooled, tasks, missing}}, 'skipped': [...]}."""
    pairs = dict(pairs or {})
    tasks = {}
    present = [name for name, items in tasks_data.items() if items is not None]
    for name, items in tasks_data.items():
        if items is None:
            continue
        if name not in NLL_TASKS:
            raise ValueError(f"{name!r} is not a domain-NLL task; choose from {NLL_TASKS}")
        p = pairs.get(name) or prepare_pairs(enc, items)
        scores = continuation_logprobs(logits_fn, enc, p, batch_size=batch_size, max_len=max_len, device=device,
                                       progress=progress,
                                       desc=f"domain NLL {present.index(name) + 1}/{len(present)}: {name}")
        if not scores:
            raise ValueError(f"task {name!r} has no items; re-run `python data/evals/prepare.py --tasks {name}`")
        nll_sum = -sum(s for s, _ in scores)
        n_tokens = sum(n for _, n in scores)
        tasks[name] = {'nll': nll_sum / n_tokens, 'ppl': math.exp(nll_sum / n_tokens),
                       'nll_sum': nll_sum, 'n_tokens': n_tokens, 'n_examples': len(scores),
                       'n_truncated': sum(len(c) + len(x) > max_len + 1 for c, x in p)}
    categories = {}
    for cat, names in CATEGORIES.items():
        have = [t for t in names if t in tasks]
        categories[cat] = {
            'nll': sum(tasks[t]['nll'] for t in have) / len(have) if have else None,
            'nll_pooled': (sum(tasks[t]['nll_sum'] for t in have) / sum(tasks[t]['n_tokens'] for t in have)
                           if have else None),
            'tasks': have, 'missing': [t for t in names if t not in tasks]}
    return {'tasks': tasks, 'categories': categories, 'skipped': [t for t in NLL_TASKS if t not in tasks]}

# -----------------------------------------------------------------------------

def main(argv=None):
    parser = argparse.ArgumentParser(description="Token statistics of the prepared evaluation sets")
    parser.add_argument('--tokenizer', default='gpt2', help="gpt2, byte or path/to/tokenizer.json (tokenizer.get_tokenizer)")
    parser.add_argument('--eval_dir', default=str(EVAL_DIR))
    args = parser.parse_args(argv)
    from data.tokenizer import get_tokenizer
    try:
        enc = get_tokenizer(args.tokenizer)
        found = False
        for name in TASKS:
            if not (Path(args.eval_dir) / f"{name}.jsonl").is_file():
                print(f"{name:<10} not prepared")
                continue
            found = True
            pairs = prepare_pairs(enc, load_task(name, args.eval_dir))
            lens = [len(c) + len(x) for c, x in pairs]
            n_ans = sum(len(x) for _, x in pairs)
            over = ' '.join(f"{sum(l > m + 1 for l in lens)}@{m}" for m in (256, 512, 1024, 2048))
            print(f"{name:<10} {len(pairs):>6,} pairs  {n_ans:>9,} answer tokens  longest {max(lens):>5,}  truncated: {over}")
        if not found:
            raise FileNotFoundError(f"no task files in {args.eval_dir}; run `python data/evals/prepare.py` first")
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}")


if __name__ == '__main__':
    main()
