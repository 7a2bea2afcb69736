"""
Tests of the evaluation sets (data/evals/prepare.py) and their scoring (probes/evals.py).

    python -m pytest tests/test_evals.py -q

Fixture files in every source schema are written by the tests; the real data in
../shared/data is used only by the last test, which skips when it is absent.
"""

import gzip
import hashlib
import importlib.util
import io
import json
import math
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from probes import evals  # noqa: E402

SHARED_DATA = REPO.parent / 'shared' / 'data'
PREPARE_PY = REPO / 'data' / 'evals' / 'prepare.py'
_spec = importlib.util.spec_from_file_location('evals_prepare', PREPARE_PY)
prepare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prepare)

# -----------------------------------------------------------------------------
# toy tokenizers and models


class ByteEnc:
    """One token per UTF-8 byte, eot = 256."""
    eot = 256
    vocab_size = 257

    def encode(self, text):
        return list(text.encode('utf-8'))

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode('utf-8', errors='replace')


class WordEnc:
    """GPT-2-like pieces: leading whitespace sticks to the next word ("Answer:", " Paris")."""
    eot = 0

    def __init__(self):
        self.vocab, self.inv = {}, {}

    def encode(self, text):
        ids = []
        for piece in re.findall(r"\s?\S+|\s+", text):
            if piece not in self.vocab:
                self.vocab[piece] = len(self.vocab) + 1
                self.inv[self.vocab[piece]] = piece
            ids.append(self.vocab[piece])
        return ids

    def decode(self, ids):
        return ''.join(self.inv[i] for i in ids)


def unigram_logits_fn(probs):
    """A 'model' whose next-byte distribution is the same at every position: log p = log probs."""
    logp = torch.log(probs)

    def fn(idx):
        return logp.expand(idx.shape[0], idx.shape[1], -1).clone()  # (B, T, V)
    return fn


def byte_probs(p_x=0.5, p_y=0.1, p_space=0.2):
    # 'x', 'y', ' ' get the given mass; the other 254 ids share the rest equally
    probs = torch.full((257,), (1 - p_x - p_y - p_space) / 254, dtype=torch.float64)
    probs[ord('x')], probs[ord('y')], probs[ord(' ')] = p_x, p_y, p_space
    return probs


class CumMeanLM(nn.Module):
    """Tiny causal LM: logits_t = W · mean(emb(x_1..x_t)). Causal, so right padding cannot leak."""

    def __init__(self, vocab=257, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):  # (B, T) -> (B, T, V)
        h = self.emb(idx).cumsum(1)  # (B, T, d)
        h = h / torch.arange(1, idx.shape[1] + 1, device=idx.device)[None, :, None]
        return self.head(h)


def write_jsonl(path, records):
    with open(path, 'w', encoding='utf-8') as f:
        for r in records:
            f.write(json.dumps(r) + '\n')


def arc_record(qid, stem, texts, labels, key):
    return {'id': qid, 'question': {'stem': stem, 'choices': [{'text': t, 'label': l} for t, l in zip(texts, labels)]},
            'answerKey': key}

# -----------------------------------------------------------------------------
# encode_pair


def test_encode_pair_moves_trailing_whitespace():
    enc = WordEnc()
    ctx, cont = evals.encode_pair(enc, "Question: Capital of France?\nAnswer: ", "Paris")
    # the space belongs to the answer token " Paris", not to a lone " " token after the context
    assert ctx == enc.encode("Question: Capital of France?\nAnswer:")
    assert enc.decode(cont) == " Paris" and len(cont) == 1
    ctx, cont = evals.encode_pair(enc, "tests\n[BEGIN]\n", "def f(): pass\n")
    assert enc.decode(ctx) == "tests\n[BEGIN]"
    assert enc.decode(cont) == "\ndef f(): pass\n"  # the newline after [BEGIN] is scored
    # no trailing whitespace: continuation = whole minus the context's tokens
    ctx, cont = evals.encode_pair(enc, "Answer:", " 42")
    assert ctx + cont == enc.encode("Answer: 42") and enc.decode(cont) == " 42"
    # empty context is replaced by eot, as lm-eval does
    assert evals.encode_pair(enc, "", "hi") == ([enc.eot], enc.encode("hi"))


def test_encode_pair_gpt2():
    tok = pytest.importorskip('data.tokenizer')
    enc = tok.get_tokenizer('gpt2')
    ctx, cont = evals.encode_pair(enc, "Question: What is the capital of France?\nAnswer: ", "Paris")
    assert ctx == enc.encode("Question: What is the capital of France?\nAnswer:")
    assert cont == enc.encode(" Paris") and len(cont) == 1

# -----------------------------------------------------------------------------
# continuation_logprobs


def test_truncation_keeps_continuation_and_aligns_targets():
    torch.manual_seed(0)
    table = torch.randn(257, 257, dtype=torch.float64)  # bigram logits: next-token scores given the current token
    logp_table = table.log_softmax(-1)
    seen_T = []

    def bigram(idx):
        seen_T.append(idx.shape[1])
        return table[idx]  # (B, T, V)

    rng = random.Random(0)
    ctx = [rng.randrange(256) for _ in range(50)]
    cont = [rng.randrange(256) for _ in range(5)]
    whole = ctx + cont
    want = sum(logp_table[whole[j - 1], whole[j]].item() for j in range(len(ctx), len(whole)))
    (got, n, greedy), = evals.continuation_logprobs(bigram, ByteEnc(), [(ctx, cont)], max_len=8)
    assert max(seen_T) == 8  # the context was cut to fit
    assert n == 5 and got == pytest.approx(want, abs=1e-4)
    # is_greedy (lm-eval's): every scored token the bigram's argmax after its predecessor
    assert greedy == all(table[whole[j - 1]].argmax() == whole[j] for j in range(len(ctx), len(whole)))
    chain = [7]
    for _ in range(4):
        chain.append(int(table[chain[-1]].argmax()))
    (_, _, greedy), = evals.continuation_logprobs(bigram, ByteEnc(), [(ctx + chain[:1], chain[1:])], max_len=8)
    (_, _, not_greedy), = evals.continuation_logprobs(bigram, ByteEnc(), [(ctx + chain[:1], chain[1:3] + [
        int(table[chain[2]].argsort()[-2])])], max_len=8)  # the last token the runner-up
    assert greedy and not not_greedy
    (full, _, _), = evals.continuation_logprobs(bigram, ByteEnc(), [(ctx, cont)], max_len=2048)
    assert full == pytest.approx(want, abs=1e-4)  # a bigram model sees the same predecessors either way
    # a continuation longer than max_len: only its last max_len tokens are scored
    long_cont = [rng.randrange(256) for _ in range(12)]
    whole = ctx + long_cont
    want = sum(logp_table[whole[j - 1], whole[j]].item() for j in range(len(whole) - 8, len(whole)))
    (got, n, _), = evals.continuation_logprobs(bigram, ByteEnc(), [(ctx, long_cont)], max_len=8)
    assert n == 8 and got == pytest.approx(want, abs=1e-4)


def test_batching_matches_one_at_a_time():
    torch.manual_seed(0)
    model = CumMeanLM().eval()
    enc = ByteEnc()
    rng = random.Random(1)
    words = ['alpha', 'beta', 'gamma', 'delta', 'x', 'yy', '42', 'the end']
    pairs = [(' '.join(rng.choices(words, k=rng.randint(1, 9))) + ':', ' ' + rng.choice(words)) for _ in range(11)]
    assert len({len(enc.encode(c + x)) for c, x in pairs}) > 3  # lengths differ, so padding is exercised
    batched = evals.continuation_logprobs(model, enc, pairs, batch_size=4, max_len=40)
    single = evals.continuation_logprobs(model, enc, pairs, batch_size=1, max_len=40)
    assert [s.n_tokens for s in batched] == [s.n_tokens for s in single] == [len(enc.encode(x)) for _, x in pairs]
    for b, s in zip(batched, single):
        assert b.logprob == pytest.approx(s.logprob, abs=1e-4) and b.greedy == s.greedy
    # and both equal a direct computation on the unpadded sequence
    c, x = pairs[3]
    ids = torch.tensor([enc.encode(c + x)])
    with torch.no_grad():
        logp = model(ids)[0].log_softmax(-1)
    k = len(enc.encode(x))
    want = sum(logp[t - 1, ids[0, t]].item() for t in range(ids.shape[1] - k, ids.shape[1]))
    assert batched[3].logprob == pytest.approx(want, abs=1e-4)


def test_logits_shape_is_checked():
    with pytest.raises(ValueError, match='every position'):
        evals.continuation_logprobs(lambda idx: torch.zeros(idx.shape[0], 257), ByteEnc(), [("a:", " b")])

# -----------------------------------------------------------------------------
# ARC-Easy accuracy


def test_arc_easy_acc_and_acc_norm(tmp_path):
    raw = tmp_path / 'raw'
    raw.mkdir()
    write_jsonl(raw / 'arc_easy_test.jsonl', [
        # 'y' wins on the sum, 'yy' per character of the choice text (it would lose per character of
        # " yy", the leading space counted); gold is 'yy', with numeric labels
        arc_record('q1', 'Pick one', ['y', 'yy'], ['1', '2'], '2'),
        # 'x' wins both ways and is gold
        arc_record('q2', 'Pick two', ['x', 'yyyy'], ['A', 'B'], 'A'),
        # the rare 'z' is gold and loses both ways
        arc_record('q3', 'Pick three', ['z', 'x', 'yy'], ['A', 'B', 'C'], 'A'),
    ])
    out = tmp_path / 'evals'
    prepare.prepare(['arc_easy'], raw, out)
    items = evals.load_task('arc_easy', out)
    assert [it['gold'] for it in items] == [1, 0, 0]
    probs = byte_probs()
    enc = ByteEnc()
    res = evals.arc_easy_accuracy(unigram_logits_fn(probs), enc, items, batch_size=2)
    lp = {c: math.log(probs[ord(c)].item()) for c in 'xyz '}
    assert res['logprobs'][0] == pytest.approx([lp[' '] + lp['y'], lp[' '] + 2 * lp['y']])
    assert res['pred'] == [0, 0, 1] and res['pred_norm'] == [1, 0, 1]
    assert res['acc'] == pytest.approx(1 / 3) and res['acc_norm'] == pytest.approx(2 / 3) and res['n'] == 3
    # pre-tokenized pairs give the same answer
    again = evals.arc_easy_accuracy(unigram_logits_fn(probs), enc, items, pairs=evals.prepare_pairs(enc, items))
    assert again['pred_norm'] == res['pred_norm']
    with pytest.raises(ValueError, match='prepare_pairs'):
        evals.arc_easy_accuracy(unigram_logits_fn(probs), enc, items, pairs=evals.prepare_pairs(enc, items[:2]))

def test_arc_ties_go_to_the_first_choice():
    """A uniform model: every continuation token has log-prob -ln 257, so a choice of n
    characters (plus the leading space) scores -(n + 1) ln 257, -(n + 1)/n ln 257 per character.
    acc picks the shortest, acc_norm the longest; equal lengths tie exactly, and the first wins."""
    items = [{'prompt': 'Q: a?\nAnswer:', 'choices': ['ab', 'cd', 'ef'], 'gold': 2},
             {'prompt': 'Q: b?\nAnswer:', 'choices': ['abc', 'de', 'fg'], 'gold': 2},
             {'prompt': 'Q: c?\nAnswer:', 'choices': ['x', 'yyy', 'zzz'], 'gold': 1}]
    r = evals.arc_easy_accuracy(lambda idx: torch.zeros(*idx.shape, 257), ByteEnc(), items, batch_size=2)
    lp = -math.log(257)
    assert r['logprobs'] == [pytest.approx([(len(c) + 1) * lp for c in it['choices']]) for it in items]
    assert r['pred'] == [0, 1, 0] and r['pred_norm'] == [0, 0, 1]
    assert r['acc'] == pytest.approx(0.0) and r['acc_norm'] == pytest.approx(1 / 3)
    for it, lps, p, pn in zip(items, r['logprobs'], r['pred'], r['pred_norm']):  # numpy's argmax: the first
        assert p == int(np.argmax(lps)) and pn == int(np.argmax([v / len(c) for v, c in zip(lps, it['choices'])]))


# -----------------------------------------------------------------------------
# domain NLL


def test_domain_nll_token_weighted_and_categories():
    probs = byte_probs()
    enc = ByteEnc()
    data = {
        'mbpp': [{'prompt': 'task\n[BEGIN]\n', 'answer': 'xx\n'}],
        'humaneval': [{'prompt': 'def f():\n', 'answer': '    y\n'}, {'prompt': 'def g():\n', 'answer': 'x'}],
        'sciq': [{'prompt': 'Question: q\nAnswer:', 'answer': ' xy'}],
    }
    res = evals.domain_nll(unigram_logits_fn(probs), enc, data)
    nlp = {c: -math.log(probs[ord(c)].item()) for c in 'xy \n'}
    # the prompt's trailing "\n" is scored as part of the answer
    mbpp = (nlp['\n'] + 2 * nlp['x'] + nlp['\n']) / 4
    he_sum = (nlp['\n'] + 4 * nlp[' '] + nlp['y'] + nlp['\n']) + (nlp['\n'] + nlp['x'])
    he = he_sum / 9
    assert res['tasks']['mbpp']['nll'] == pytest.approx(mbpp)
    assert res['tasks']['humaneval']['nll'] == pytest.approx(he)  # token-weighted, not a mean of per-example means
    assert res['tasks']['humaneval']['n_tokens'] == 9 and res['tasks']['humaneval']['n_examples'] == 2
    assert res['tasks']['sciq']['ppl'] == pytest.approx(math.exp((nlp[' '] + nlp['x'] + nlp['y']) / 3))
    coding = res['categories']['coding']
    assert coding['nll'] == pytest.approx((mbpp + he) / 2)
    assert coding['nll_pooled'] == pytest.approx((4 * mbpp + he_sum) / 13)
    assert res['categories']['stem']['missing'] == ['gpqa']
    assert res['categories']['stem']['nll'] == pytest.approx(res['tasks']['sciq']['nll'])
    assert res['categories']['math']['nll'] is None
    assert res['skipped'] == ['gpqa', 'gsm8k', 'math500']
    # truncation is reported
    short = evals.domain_nll(unigram_logits_fn(probs), enc, data, max_len=8)
    assert short['tasks']['mbpp']['n_truncated'] == 1 and short['tasks']['sciq']['n_truncated'] == 1


class Terminal(io.StringIO):
    """A stderr that says it is a terminal: progress bars are drawn only there."""

    def isatty(self):
        return True


def test_domain_nll_progress_bars_name_the_task(monkeypatch):
    data = {'mbpp': [{'prompt': 'task\n', 'answer': 'xx\n'}], 'sciq': [{'prompt': 'Q:', 'answer': ' xy'}]}
    monkeypatch.setattr(sys, 'stderr', Terminal())
    evals.domain_nll(unigram_logits_fn(byte_probs()), ByteEnc(), data, progress=True)
    err = sys.stderr.getvalue()
    assert 'domain NLL 1/2: mbpp' in err and 'domain NLL 2/2: sciq' in err


def test_load_task_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match='prepare.py'):
        evals.load_task('gsm8k', tmp_path)
    with pytest.raises(ValueError, match='unknown task'):
        evals.load_task('arc_hard', tmp_path)
    write_jsonl(tmp_path / 'gsm8k.jsonl', [{'task': 'gsm8k', 'id': '0', 'prompt': 'p'}])
    with pytest.raises(ValueError, match="lacks 'answer'"):
        evals.load_task('gsm8k', tmp_path)

# -----------------------------------------------------------------------------
# prepare.py on fixture files in each source schema


def _write_fixtures(raw):
    write_jsonl(raw / 'arc_easy_test.jsonl', [
        arc_record('NYSED_1', 'All matter is made of', ['air', 'elements', 'water', 'soil'], ['1', '2', '3', '4'], '2'),
        arc_record('Mercury_1', 'Which is a gas?', ['ice', 'steam', 'rock'], ['A', 'B', 'C'], 'B'),
    ])
    write_jsonl(raw / 'sciq_validation.jsonl', [
        {'question': 'Who proposed evolution?', 'distractor1': 'a', 'distractor2': 'b', 'distractor3': 'c',
         'correct_answer': 'darwin', 'support': ''},
        {'question': 'What is wet land?', 'distractor1': 'a', 'distractor2': 'b', 'distractor3': 'c',
         'correct_answer': 'wetland', 'support': 'A wetland is wet.'},
    ])
    write_jsonl(raw / 'gsm8k_test.jsonl', [{'question': 'What is 2+2?', 'answer': '2+2=<<2+2=4>>4\n#### 4'}])
    write_jsonl(raw / 'math500_test.jsonl', [{'problem': 'Find $x$.', 'solution': 'So $x=\\boxed{1}$.', 'answer': '1',
                                              'subject': 'Algebra', 'level': 1, 'unique_id': 'test/algebra/1.json'}])
    write_jsonl(raw / 'mbpp.jsonl', [
        {'text': f'Task {i}.', 'code': f'def f{i}():\r\n\treturn {i}', 'task_id': i, 'test_setup_code': '',
         'test_list': [f'assert f{i}() == {i}', 'assert True', 'assert 1'], 'challenge_test_list': []}
        for i in (10, 11, 510, 511)])
    with gzip.open(raw / 'HumanEval.jsonl.gz', 'wt', encoding='utf-8') as f:
        f.write(json.dumps({'task_id': 'HumanEval/0', 'prompt': 'def f():\n    """Doc."""\n',
                            'entry_point': 'f', 'canonical_solution': '    return 1\n', 'test': ''}) + '\n')


def test_prepare_fixture_formats(tmp_path):
    raw, out = tmp_path / 'raw', tmp_path / 'evals'
    raw.mkdir()
    _write_fixtures(raw)
    gpqa_csv = tmp_path / 'gpqa_diamond.csv'
    gpqa_csv.write_text('Record ID,Question,Correct Answer,Incorrect Answer 1,Incorrect Answer 2,'
                        'Incorrect Answer 3,Explanation\nrecABC, What is H2O? ,water , ice,fire,air,It is water. \n')
    manifest = prepare.prepare(prepare.TASKS, raw, out, files={'gpqa': str(gpqa_csv)})
    load = lambda t: [json.loads(l) for l in open(out / f'{t}.jsonl', encoding='utf-8')]  # noqa: E731

    arc = load('arc_easy')
    assert arc[0] == {'task': 'arc_easy', 'id': 'NYSED_1', 'prompt': 'Question: All matter is made of\nAnswer:',
                      'choices': ['air', 'elements', 'water', 'soil'], 'gold': 1}
    assert arc[1]['gold'] == 1 and arc[1]['choices'] == ['ice', 'steam', 'rock']

    sciq = load('sciq')
    assert sciq[0]['prompt'] == 'Question: Who proposed evolution?\nAnswer:'
    assert sciq[0]['answer'] == ' darwin\nExplanation: '
    assert sciq[1]['answer'] == ' wetland\nExplanation: A wetland is wet.'

    gsm = load('gsm8k')
    assert gsm[0]['prompt'] == 'Question: What is 2+2?\nAnswer:'
    assert gsm[0]['answer'] == ' 2+2=<<2+2=4>>4\n#### 4'

    math500 = load('math500')
    assert math500[0]['prompt'] == 'Problem:\nFind $x$.\n\nSolution:'
    assert math500[0]['answer'] == ' So $x=\\boxed{1}$.' and math500[0]['id'] == 'test/algebra/1.json'

    mbpp = load('mbpp')
    assert [m['id'] for m in mbpp] == ['mbpp/11', 'mbpp/510']  # 10 and 511 are not test tasks
    assert mbpp[0]['prompt'] == ('You are an expert Python programmer, and here is your task: Task 11. '
                                 'Your code should pass these tests:\n\nassert f11() == 11\nassert True\nassert 1\n[BEGIN]\n')
    assert mbpp[0]['answer'] == 'def f11():\r\n\treturn 11\n'

    he = load('humaneval')
    assert he == [{'task': 'humaneval', 'id': 'HumanEval/0', 'prompt': 'def f():\n    """Doc."""\n',
                   'answer': '    return 1\n'}]

    gpqa, = load('gpqa')
    order = ['water', 'ice', 'fire', 'air']  # correct first, stripped, then shuffled by sha256(Record ID)
    random.Random(int(hashlib.sha256(b'recABC').hexdigest()[:16], 16)).shuffle(order)
    assert gpqa['prompt'] == ('Question: What is H2O?\nChoices:\n' +
                              ''.join(f'{"ABCD"[k]}. {c}\n' for k, c in enumerate(order)) + 'Answer:')
    assert gpqa['answer'] == ' water\nExplanation: It is water.' and gpqa['id'] == 'recABC'

    assert {t: e['count'] for t, e in manifest['tasks'].items()} == {
        'arc_easy': 2, 'sciq': 2, 'gpqa': 1, 'gsm8k': 1, 'math500': 1, 'mbpp': 2, 'humaneval': 1}
    assert any('validation' in n and 'test' in n for n in manifest['tasks']['sciq']['notes'])
    assert json.loads((out / 'manifest.json').read_text()) == manifest


def test_prepare_skips_missing_and_merges_manifest(tmp_path, capsys):
    raw, out = tmp_path / 'raw', tmp_path / 'evals'
    raw.mkdir()
    write_jsonl(raw / 'gsm8k_test.jsonl', [{'question': 'q', 'answer': 'a'}] * 3)
    manifest = prepare.prepare(['gsm8k', 'gpqa'], raw, out)
    line = [l for l in capsys.readouterr().out.splitlines() if l.startswith('skip gpqa')]
    assert len(line) == 1 and '--file gpqa=PATH' in line[0]
    assert 'gpqa' in manifest['skipped'] and not (out / 'gpqa.jsonl').exists()
    write_jsonl(raw / 'math500_test.jsonl', [{'problem': 'p', 'solution': 's'}])
    manifest = prepare.prepare(['math500'], raw, out)
    assert manifest['tasks']['gsm8k']['count'] == 3 and manifest['tasks']['math500']['count'] == 1
    (raw / 'gsm8k_test.jsonl').unlink()                       # a later run without gsm8k's source
    manifest = prepare.prepare(['gsm8k'], raw, out)
    assert manifest['tasks']['gsm8k']['count'] == 3 and (out / 'gsm8k.jsonl').is_file()
    assert 'keeping the gsm8k.jsonl' in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match='is not a folder'):
        prepare.prepare(['gsm8k'], tmp_path / 'nonexist', out)


def test_prepare_bad_input_is_one_line_error(tmp_path):
    raw, out = tmp_path / 'raw', tmp_path / 'evals'
    raw.mkdir()
    (raw / 'gsm8k_test.jsonl').write_text('{"question": "q", "answer": "a"}\n{not json\n')
    r = subprocess.run([sys.executable, str(PREPARE_PY), '--input_dir', str(raw), '--out_dir', str(out),
                        '--tasks', 'gsm8k'], capture_output=True, text=True)
    assert r.returncode == 1 and 'Traceback' not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and 'gsm8k_test.jsonl:2' in r.stderr
    write_jsonl(raw / 'sciq_validation.jsonl', [{'question': 'q', 'support': ''}])
    with pytest.raises(ValueError, match=r"sciq_validation\.jsonl: record 0: missing required field 'correct_answer'"):
        prepare.prepare(['sciq'], raw, out)
    write_jsonl(raw / 'arc_easy_test.jsonl', [arc_record('q', 's', ['a', 'b'], ['A', 'B'], 'C')])
    with pytest.raises(ValueError, match="answerKey"):
        prepare.prepare(['arc_easy'], raw, out)
    with pytest.raises(SystemExit):
        prepare.main(['--file', 'nosuchtask=x.jsonl', '--out_dir', str(out)])

# -----------------------------------------------------------------------------
# real data


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason='../shared/data is absent')
def test_prepare_real_data(tmp_path):
    manifest = prepare.prepare(prepare.TASKS, SHARED_DATA, tmp_path)
    counts = {t: e['count'] for t, e in manifest['tasks'].items()}
    assert counts == {'arc_easy': 2376, 'sciq': 1000, 'gsm8k': 1319, 'math500': 500, 'mbpp': 500, 'humaneval': 164}
    assert 'gpqa' in manifest['skipped']
    arc = {it['id']: it for it in evals.load_task('arc_easy', tmp_path)}
    item = arc['NYSEDREGENTS_2015_8_28']  # numeric labels 1-4, answerKey "2"
    assert item['choices'][item['gold']] == 'elements'
    assert all(0 <= it['gold'] < len(it['choices']) for it in arc.values())
    mbpp = evals.load_task('mbpp', tmp_path)
    assert [m['id'] for m in mbpp] == [f'mbpp/{i}' for i in range(11, 511)]
    assert all(m['prompt'].endswith('\n[BEGIN]\n') and m['answer'].endswith('\n') for m in mbpp)
    gsm = evals.load_task('gsm8k', tmp_path)
    assert gsm[0]['prompt'].startswith('Question: Janet\u2019s ducks lay 16 eggs') and gsm[0]['answer'].endswith('#### 18')
    assert all(s['answer'].startswith(' ') and '\nExplanation: ' in s['answer'] for s in evals.load_task('sciq', tmp_path))
