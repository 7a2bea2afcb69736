"""
lm-evaluation-harness on this project's models (probes/harness.py, data/evals/harness): the
harness runs the shipped task files offline against a tiny model (multiple choice, rolling
perplexity, generation on the KV cache, which writes what recomputing writes); the project's
own ARC-Easy score (probes/evals.py, and probe.py's pruning scan) equals the harness's on the
same questions; the rolling windows score every token once; generation stops where the harness
says; model_args and bad input; the command line (slow).

    python -m pytest tests/test_harness.py -q
"""

import importlib.util
import math
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.nn as nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import fast  # noqa: E402
from checkpoint import save_checkpoint  # noqa: E402
import probe  # noqa: E402
from data.tokenizer import get_tokenizer  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from probes import evals  # noqa: E402
from probes.harness import TASKS_DIR, DepthBenchLM  # noqa: E402

_spec = importlib.util.spec_from_file_location('evals_prepare', REPO / 'data' / 'evals' / 'prepare.py')
prepare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prepare)
SHIPPED = ['depthbench_arc_easy', 'depthbench_gsm8k', 'depthbench_webtext']


def byte_model(residual='attnres', block_size=256, seed=0):
    """A tiny byte-level model (257 ids) with every parameter random, so that its choices differ."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=257, block_size=block_size, n_layer=2, n_head=2, n_embd=32, residual=residual))
    fast.randomise(model, seed)
    return model.eval()


@pytest.fixture(scope='module')
def tasks():
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)  # the shipped files only: fast


def evaluate(lm, tasks, names):
    return lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=tasks, log_samples=True, bootstrap_iters=0)


def test_the_harness_runs_the_shipped_tasks_offline(tasks):
    """All three shipped tasks, one run: 100 ARC-Easy questions, 10 GSM8K problems, 8 web
    documents. A choice's log-likelihood is the model's, summed over the choice's tokens by
    hand; bits per byte is minus the documents' log-likelihoods over their bytes; generation
    with the KV cache writes the text that recomputing the context writes."""
    model = byte_model()
    out = evaluate(DepthBenchLM(model=model, tokenizer='byte', batch_size=16), tasks, SHIPPED)
    res, samples = out['results'], out['samples']
    assert [res[t]['sample_len'] for t in SHIPPED] == [100, 10, 8]
    assert 0 <= res['depthbench_arc_easy']['acc,none'] <= 1
    # one ARC choice by hand: log p(" " + choice | "Question: ...\nAnswer:"), bytes
    s = samples['depthbench_arc_easy'][3]
    ctx, cont = s['arguments'][1]
    assert ctx.startswith('Question: ') and ctx.endswith('\nAnswer:') and cont == ' ' + s['doc']['choices']['text'][1]
    ids = torch.tensor([list((ctx + cont).encode())])
    with torch.no_grad():
        logp = model(ids)[0][0].log_softmax(-1)
    want = sum(logp[t - 1, ids[0, t]].item() for t in range(len(ctx), ids.size(1)))
    assert float(s['resps'][1][0][0]) == pytest.approx(want, abs=1e-4)
    # rolling: bits per byte from the documents' log-likelihoods
    docs = samples['depthbench_webtext']
    lls = [float(d['resps'][0][0]) for d in docs]
    n_bytes = sum(len(d['doc']['text'].encode()) for d in docs)
    assert res['depthbench_webtext']['bits_per_byte,none'] == pytest.approx(-sum(lls) / n_bytes / math.log(2))
    # generation: the same text without the cache
    again = evaluate(DepthBenchLM(model=model, tokenizer='byte', kv_cache=False), tasks, ['depthbench_gsm8k'])
    cached = [d['resps'][0][0] for d in samples['depthbench_gsm8k']]
    assert cached == [d['resps'][0][0] for d in again['samples']['depthbench_gsm8k']]
    assert len(set(cached)) > 1 and all(0 < len(t) <= 64 for t in cached)  # up to max_gen_toks bytes, one character each


def test_own_arc_easy_score_equals_the_harness(tasks, tmp_path):
    """The 100 shipped questions through data/evals/prepare.py and probes/evals.py (the
    project's prompt format and scoring), and through probe.py's pruning scan (its baseline):
    the harness's acc and acc_norm, and per question the same correct answers and choice
    log-likelihoods."""
    model, enc = byte_model(), get_tokenizer('byte')
    harness = evaluate(DepthBenchLM(model=model, tokenizer=enc), tasks, ['depthbench_arc_easy'])
    h_res = harness['results']['depthbench_arc_easy']
    h_docs = sorted(harness['samples']['depthbench_arc_easy'], key=lambda d: d['doc_id'])
    prepare.prepare(['arc_easy'], tmp_path, tmp_path / 'evals', files={'arc_easy': TASKS_DIR / 'arc_easy_100.jsonl'})
    items = evals.load_task('arc_easy', tmp_path / 'evals')
    assert [it['id'] for it in items] == [d['doc']['id'] for d in h_docs]
    own = evals.arc_easy_accuracy(lambda idx: model(idx)[0], enc, items, max_len=256)
    assert own['acc'] == h_res['acc,none'] and own['acc_norm'] == h_res['acc_norm,none']
    assert own['correct'] == [d['acc'] for d in h_docs] and own['correct_norm'] == [d['acc_norm'] for d in h_docs]
    for lps, d in zip(own['logprobs'], h_docs):
        assert lps == pytest.approx([float(r[0][0]) for r in d['resps']], abs=1e-4)
    assert own['pred'] != own['pred_norm']  # acc and acc_norm pick differently somewhere: both are checked
    scan = probe.prune_scan(model, enc, items, batch_size=8, chunk_items=32)
    assert scan['baseline'] == {'acc': h_res['acc,none'], 'acc_norm': h_res['acc_norm,none']}


class Bigram(nn.Module):
    """logits[t] = a fixed table's row of token t: log p(next | current), whatever came before."""

    def __init__(self, V=257):
        super().__init__()
        self.table = torch.randn(V, V, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def forward(self, idx):
        return self.table[idx]


def test_loglikelihood_rolling_scores_every_token_once():
    """The harness's disjoint windows of max_length = 16 over a 75-byte string: with a bigram
    model the total is exactly sum_t log p(x_t | x_{t-1}), x_{-1} = end-of-text: every token
    scored once, after its predecessor, across window edges."""
    bigram, enc = Bigram(), get_tokenizer('byte')
    lm = DepthBenchLM(logits_fn=bigram, tokenizer=enc, max_length=16, batch_size=3)
    text = 'the quick brown fox jumps over the lazy dog; pack my box with five dozen jugs'
    ids = [enc.eot] + list(text.encode())
    logp = bigram.table.log_softmax(-1)
    want = sum(logp[a, b].item() for a, b in zip(ids[:-1], ids[1:]))
    got, = lm.loglikelihood_rolling([Instance('loglikelihood_rolling', {}, (text,), 0)], disable_tqdm=True)
    assert got == pytest.approx(want, abs=1e-4)  # fp32 log-softmax
    short, = lm.loglikelihood_rolling([Instance('loglikelihood_rolling', {}, (text[:10],), 0)], disable_tqdm=True)
    assert short == pytest.approx(sum(logp[a, b].item() for a, b in zip(ids[:10], ids[1:11])), abs=1e-4)


class Counter(nn.Module):
    """A 'model' that writes the byte after the last one ('a' -> 'b'), and end-of-text after
    'z'; it takes a KV cache as GPT.hidden does."""

    def __init__(self):
        super().__init__()
        self.config = GPTConfig(vocab_size=257, block_size=32, n_layer=1, n_head=1, n_embd=2)
        self.unused = nn.Parameter(torch.zeros(1))

    def hidden(self, idx, cache=None):
        if cache is not None:
            cache.pos += idx.size(1)
        return idx

    def head(self, h):
        nxt = torch.where(h == ord('z'), 256, h + 1)
        return nn.functional.one_hot(nxt, 257).float()


@pytest.mark.parametrize('kv_cache', [True, False])
def test_generate_until_stops_where_the_harness_says(kv_cache):
    """Stop strings (the text is cut before the first, which may span tokens), max_gen_toks,
    the end-of-text token; a stop string never met: the whole max_gen_toks."""
    lm = DepthBenchLM(model=Counter(), tokenizer='byte', device='cpu', kv_cache=kv_cache)
    reqs = [('a', {'until': ['d']}), ('a', {'until': ['ef'], 'max_gen_toks': 10}), ('a', {'until': [], 'max_gen_toks': 3}),
            ('w', {'until': ['Question:'], 'max_gen_toks': 10}), ('a', {'until': 'q', 'do_sample': False}),
            ('k', {'until': ['!'], 'max_gen_toks': 5})]
    got = lm.generate_until([Instance('generate_until', {}, r, i) for i, r in enumerate(reqs)], disable_tqdm=True)
    assert got == ['bc', 'bcd', 'bcd', 'xyz', 'bcdefghijklmnop', 'lmnop']


def test_model_args_and_bad_input(tmp_path):
    """--model_args as the harness parses them (ckpt, kv_cache, batch_size), and one-line errors."""
    model = byte_model(block_size=64)
    ckpt = tmp_path / 'run' / 'ckpt.pt'
    ckpt.parent.mkdir()
    save_checkpoint(str(ckpt), {'model': model.state_dict(), 'model_args': asdict(model.config), 'config': {'dataset': 'x'},
                'iter_num': 0, 'tokenizer': 'byte'})
    lm = DepthBenchLM.create_from_arg_string(f'ckpt={ckpt.parent},kv_cache=False', {'batch_size': '4', 'device': 'cpu'})
    assert (lm.kv_cache, lm.batch_size, lm.max_length, lm.tokenizer_name) == (False, 4, 64, 'byte')
    assert lm.get_model_info()['residual'] == 'attnres'
    bare = tmp_path / 'bare.pt'  # another tool's file: no seal, refused in one line naming the model_arg
    torch.save(torch.load(ckpt, weights_only=True), bare)
    with pytest.raises(ValueError, match=r'^[^\n]*has no seal.*add allow_unsealed=True to --model_args[^\n]*$'):
        DepthBenchLM.create_from_arg_string(f'ckpt={bare}', {'device': 'cpu'})
    assert DepthBenchLM.create_from_arg_string(f'ckpt={bare},allow_unsealed=True', {'device': 'cpu'}).max_length == 64
    with pytest.raises(ValueError, match='does not take pretrained'):
        DepthBenchLM.create_from_arg_string(f'ckpt={ckpt},pretrained=gpt2')
    with pytest.raises(ValueError, match="batch_size='auto'"):
        DepthBenchLM(model=model, tokenizer='byte', batch_size='auto')
    with pytest.raises(ValueError, match='more than the model'):
        DepthBenchLM(model=model, tokenizer='gpt2')
    with pytest.raises(ValueError, match='needs a model'):
        DepthBenchLM(logits_fn=Bigram(), tokenizer='byte').generate_until([Instance('generate_until', {}, ('a', {}), 0)])


@pytest.mark.slow  # the harness's command line indexes its 14,000 built-in tasks first: about 25 s
def test_the_command_line(tmp_path):
    """The documented command (docs/evaluation.md): a table with the task's acc."""
    model = byte_model()
    ckpt = tmp_path / 'ckpt.pt'
    save_checkpoint(str(ckpt), {'model': model.state_dict(), 'model_args': asdict(model.config), 'config': {'dataset': 'x'},
                'iter_num': 0, 'tokenizer': 'byte'})
    cmd = [sys.executable, '-m', 'probes.harness', '--model', 'depthbench', '--model_args', f'ckpt={ckpt}',
           '--tasks', 'depthbench_arc_easy', '--include_path', 'data/evals/harness', '--limit', '20', '--device', 'cpu']
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    row = [line for line in r.stdout.splitlines() if line.startswith('|depthbench_arc_easy')]
    assert row and '|acc' in row[0], r.stdout


def test_a_missing_checkpoint_on_the_command_line_is_one_line(tmp_path, monkeypatch, capsys):
    """What the command line does when the harness builds the model from --model_args
    ckpt=<missing>: one line naming the file, no traceback (the harness itself is stood in for)."""
    import lm_eval.__main__
    from probes import harness
    monkeypatch.setattr(lm_eval.__main__, 'cli_evaluate', lambda: DepthBenchLM.create_from_arg_string(
        f'ckpt={tmp_path / "none.pt"}', {'device': 'cpu'}))
    with pytest.raises(SystemExit) as e:
        harness.main()
    msg = str(e.value.code)
    assert msg.startswith('error:') and 'none.pt' in msg and '\n' not in msg, msg
