"""
The data a run reads (data/loader.py's TokenLoader and open_tokens; train.py's data dir): the
loader's rank offset and position across process counts (chunk ids name the chunks), and the
token files and meta.json checked before training (empty or odd files, ids past the
vocabulary, damaged meta.json; each one line, nothing written). data/tokenizer.py and the
prepare scripts are in tests/test_prepare.py.
Run: python -m pytest tests/test_data.py -q"""

import numpy as np
import pytest
import torch

import checkpoint
from data.loader import TokenLoader, open_tokens
from test_train import TINY, data_dir, load, one_line_error, train  # noqa: F401 (fixture)


# -----------------------------------------------------------------------------
# the loader: rank offsets, and positions across process counts


@pytest.fixture()
def tokens(tmp_path):
    """A token file whose chunk i (of T+1 = 4 tokens) starts with the id i: ids name chunks."""
    path = tmp_path / 'tok.bin'
    np.repeat(np.arange(64, dtype=np.uint16), 4).tofile(path)
    return str(path)


def chunks_of(loader, n):
    return [loader.next_batch()[0][:, 0].tolist() for _ in range(n)]


def test_loader_rank_offset_splits_each_micro_step_between_processes(tokens):
    """Rank r of 2 takes the r-th half of the job's micro-step: together the two ranks see the
    chunks one process sees in two micro-steps, in the same order, over an epoch boundary."""
    TL = TokenLoader
    one = chunks_of(TL(tokens, 2, 3, rank=0, world=1, seed=5), 40)  # 64 chunks: 32 steps an epoch
    r0 = chunks_of(TL(tokens, 2, 3, rank=0, world=2, seed=5), 20)
    r1 = chunks_of(TL(tokens, 2, 3, rank=1, world=2, seed=5), 20)
    assert [c for a, b in zip(r0, r1) for c in (a, b)] == one
    assert sorted(sum(one[:32], [])) == list(range(64))  # one epoch: every chunk once
    assert sorted(sum(one[32:], [])) != sum(one[32:], [])  # a shuffle, not file order


def test_loader_position_resumes_on_another_process_count(tokens):
    """A state saved by 1 process after 3 micro-steps, loaded by 2 (or the other way round):
    the job continues with exactly the chunks an uninterrupted single process sees next."""
    TL = TokenLoader
    ref = chunks_of(TL(tokens, 2, 3, world=1, seed=1), 14)
    single = TL(tokens, 2, 3, world=1, seed=1)
    chunks_of(single, 4)
    state = single.state_dict()
    ranks = [TL(tokens, 2, 3, rank=r, world=2, seed=1) for r in (0, 1)]
    for ld in ranks:
        ld.load_state_dict(state)
    got = [c for step in zip(*(chunks_of(ld, 4) for ld in ranks)) for c in step]
    assert got == ref[4:12]
    back = TL(tokens, 2, 3, world=1, seed=1)
    back.load_state_dict(ranks[0].state_dict())  # 2 processes -> 1
    assert chunks_of(back, 2) == ref[12:14]


# -----------------------------------------------------------------------------
# token files and the data dir, checked before training


def test_empty_or_odd_token_files_are_refused(tmp_path):
    (tmp_path / 'e.bin').write_bytes(b'')
    (tmp_path / 'o.bin').write_bytes(b'abc')
    with pytest.raises(SystemExit, match='is empty'):
        open_tokens(str(tmp_path / 'e.bin'))
    with pytest.raises(SystemExit, match='odd number of bytes'):
        open_tokens(str(tmp_path / 'o.bin'))


def test_token_ids_past_the_vocabulary_in_train_bin_are_found_up_front_with_meta_json(data_dir, tmp_path):
    """meta.json says 257, train.bin holds id 300 in its last chunk: one line before the model
    is built, not an IndexError mid-run; nothing is written."""
    bad = tmp_path / 'bad'
    bad.mkdir()
    for f in ('val.bin', 'meta.json'):
        (bad / f).write_bytes((data_dir / f).read_bytes())
    ids = np.fromfile(data_dir / 'train.bin', dtype=np.uint16)
    ids[-3] = 300
    ids.tofile(bad / 'train.bin')
    r = train(*TINY, f'--data_dir={bad}', f'--out_dir={tmp_path / "out"}', '--max_iters=2', check=False)
    one_line_error(r, 'train.bin holds token id 300', 'vocab_size=257')
    assert 'model:' not in r.stdout and not (tmp_path / 'out').exists()


def test_damaged_data_and_checkpoints_give_one_line_errors(data_dir, tmp_path):
    def copy_data(name, **files):
        d = tmp_path / name
        d.mkdir()
        for f in ('train.bin', 'val.bin', 'meta.json'):
            (d / f).write_bytes(files[f] if f in files else (data_dir / f).read_bytes())
        return d
    run = lambda d, *a: train(*TINY, f'--data_dir={d}', f'--out_dir={tmp_path / "o" / d.name}', *a, check=False)
    one_line_error(run(copy_data('empty', **{'train.bin': b''})), 'train.bin is empty')
    one_line_error(run(copy_data('odd', **{'val.bin': (data_dir / 'val.bin').read_bytes()[:-1]})),
                   'val.bin has an odd number of bytes')
    one_line_error(run(copy_data('garbled', **{'meta.json': b'{"vocab_size": 25'})), 'meta.json is not valid JSON')
    one_line_error(run(copy_data('list', **{'meta.json': b'[257]'})), 'meta.json is not a JSON object')
    nometa = copy_data('nometa')
    (nometa / 'meta.json').unlink()  # byte-level data: 50280 (GPT-2) would be a silent guess
    one_line_error(run(nometa), f'{nometa}/meta.json not found', '--vocab_size')
    ids = np.fromfile(data_dir / 'train.bin', dtype=np.uint16)
    ids[-5] = 400  # past --vocab_size=300, in train.bin only: found before training, not mid-run
    ids.tofile(nometa / 'train.bin')
    one_line_error(run(nometa, '--vocab_size=300'), 'train.bin holds token id 400', 'vocab_size=300')
    assert list((tmp_path / 'o').iterdir()) == []  # a failed start leaves no out_dir, lock or metrics.jsonl
    out = tmp_path / 'ck'
    train(*TINY, f'--data_dir={data_dir}', f'--out_dir={out}', '--max_iters=1', '--eval_interval=1')
    good = load(out / 'ckpt.pt')
    resume = [f'--out_dir={out}', '--init_from=resume', '--max_iters=2']
    checkpoint.save_checkpoint(str(out / 'ckpt.pt'), {k: v for k, v in good.items() if k != 'loader'})
    one_line_error(train(*resume, check=False), 'ckpt.pt lacks loader')
    torch.save([1, 2], out / 'ckpt.pt')
    checkpoint.seal(out / 'ckpt.pt')  # sealed: what is refused is its content
    one_line_error(train(*resume, check=False), 'ckpt.pt lacks model, model_args')
    checkpoint.save_checkpoint(str(out / 'ckpt.pt'), dict(good, model_args=dict(good['model_args'], residual='attnres'),
                                                         config=dict(good['config'], residual='attnres')))
    one_line_error(train(*resume, check=False), "do not fit its model_args (residual='attnres'")
