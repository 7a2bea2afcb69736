"""
Evaluation scoring of DepthBench (paper, arXiv 2609.32534): ARC-Easy accuracy by
comparing choice log-likelihoods (used by single-layer pruning, Fig. 8 left) and the
completion-only domain NLL of coding / STEM / math (Fig. 4). Prompts, pair encoding and
scoring: docs/probes.md, evaluations.

Both go through lm-evaluation-harness's pieces (probes/harness.py): pairs are encoded as the
harness encodes them (`encode_pair`), scored by the one scoring function the lm_eval adapter
uses (`continuation_logprobs`), and ARC-Easy's acc and acc_norm are the harness's own
(its arc_easy task's process_results). What stays here is what the harness does not do: the
domain NLL (token-weighted over the answers), and scoring with any logits function, so that
the pruning scan can score a model with a block skipped without reloading anything:

    logits_fn(idx: LongTensor (B, T)) -> FloatTensor (B, T, V)     # logits at every position

The data comes from data/evals/<task>.jsonl written by `python data/evals/prepare.py`.
The tokenizer is a parameter everywhere: a model trained with the 'byte' tokenizer must be
scored with it. Typical use (probe.py does this):

    enc = get_tokenizer('gpt2')
    items = load_task('arc_easy')
    pairs = prepare_pairs(enc, items)               # tokenize once, reuse for every pruned model
    for l in range(L):                              # block l dropped; logits (B, T, V)
        logits_fn = lambda idx: model(idx, order=[b for b in range(L) if b != l])[0]
        res = arc_easy_accuracy(logits_fn, enc, items, pairs=pairs, max_len=model.config.block_size)

The same accuracy from the harness itself, on the shipped slice: `python -m probes.harness
--model depthbench --model_args ckpt=... --tasks depthbench_arc_easy --include_path
data/evals/harness` (tests/test_harness.py holds the two equal).

Run `python -m probes.evals [--tokenizer gpt2] [--eval_dir data/evals]` to print, per prepared task,
the number of examples and answer tokens, and how many pairs exceed common context lengths.
"""

import argparse
import json
import math
from pathlib import Path

from probes.harness import arc_easy_task, continuation_logprobs, encode_pair  # noqa: F401 (continuation_logprobs: shared)

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

def prepare_pairs(enc, items):
    """Tokenize items once (encode_pair, the harness's encoding), so repeated scoring (a pruning
    scan calls the scorer L times) is cheap. NLL items give one (ctx_ids, cont_ids) pair each;
    an ARC item gives one pair per choice, with continuation " " + choice (the harness's
    target_delimiter), flattened in item order. Returns a list of pairs."""
    pairs = []
    for item in items:
        if 'choices' in item:
            pairs.extend(encode_pair(enc, item['prompt'], ' ' + c) for c in item['choices'])
        else:
            pairs.append(encode_pair(enc, item['prompt'], item['answer']))
    return pairs

# -----------------------------------------------------------------------------
# scoring

def arc_easy_accuracy(logits_fn, enc, items, *, pairs=None, batch_size=8, max_len=2048, device=None, progress=False):
    """Zero-shot multiple-choice accuracy on ARC-Easy (Fig. 8 left; docs/probes.md, evaluations; lm-eval arc_easy).

    Each choice is scored by the summed log-prob of " " + choice given "Question: ...\\nAnswer:"
    (continuation_logprobs); acc and acc_norm per question are the harness's (arc_easy_task's
    process_results: argmax of the sums, and of sum / character length of the raw choice text,
    the leading space not counted; ties go to the first choice, numpy's argmax).
    items: from load_task('arc_easy'); pairs: prepare_pairs(enc, items) to skip re-tokenizing.
    Returns dict(acc, acc_norm (fractions in [0, 1]), n, pred, pred_norm (the chosen indices per
    item), correct, correct_norm (per item, 0/1), logprobs (per item, per choice, nats)).
    Raises ValueError if pairs do not match items."""
    if pairs is None:
        pairs = prepare_pairs(enc, items)
    n_choices = [len(item['choices']) for item in items]
    if len(pairs) != sum(n_choices):
        raise ValueError(f"{len(pairs)} pairs for {sum(n_choices)} choices; build them with prepare_pairs(enc, items)")
    if not items:
        return {'acc': 0.0, 'acc_norm': 0.0, 'n': 0, 'pred': [], 'pred_norm': [], 'correct': [], 'correct_norm': [],
                'logprobs': []}
    scores = continuation_logprobs(logits_fn, enc, pairs, batch_size=batch_size, max_len=max_len,
                                   device=device, progress=progress, desc='ARC-Easy')
    task = arc_easy_task(items)
    pred, pred_norm, correct, correct_norm, logprobs = [], [], [], [], []
    k = 0
    for doc, m in zip(task.test_docs(), n_choices):
        s = scores[k:k + m]
        r = task.process_results(doc, [(x.logprob, x.greedy) for x in s])  # the harness's acc, acc_norm
        lp = [x.logprob for x in s]
        norm = [v / len(c) for v, c in zip(lp, doc['choices'])]  # the choices picked, for paired comparisons
        pred.append(max(range(m), key=lambda j: (lp[j], -j)))
        pred_norm.append(max(range(m), key=lambda j: (norm[j], -j)))
        assert (pred[-1] == doc['gold']) == bool(r['acc']) and (pred_norm[-1] == doc['gold']) == bool(r['acc_norm'])
        correct.append(float(r['acc']))
        correct_norm.append(float(r['acc_norm']))
        logprobs.append(lp)
        k += m
    n = len(items)
    return {'acc': sum(correct) / n, 'acc_norm': sum(correct_norm) / n, 'n': n,
            'pred': pred, 'pred_norm': pred_norm, 'correct': correct, 'correct_norm': correct_norm,
            'logprobs': logprobs}


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
        nll_sum = -sum(s.logprob for s in scores)
        n_tokens = sum(s.n_tokens for s in scores)
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
