"""checkpoint.py and tools/untrusted.py at their boundaries, in-process: a file without a seal
is not a verified file (refused unless --allow_unsealed=True), the best state named only when
it unpickles, fsync before the rename, a write interrupted mid-way, the resume point moved by
ckpt.pt alone, another user's live process, a damaged best hard-linked to ckpt.pt, refusals
found through __context__, torch's legacy format with its pickles in a row, a plain pickle.
Each test names the bug it is written to catch. (Real runs: tests/test_run_directory.py.)
Run: python -m pytest tests/test_checkpoint.py -q"""

import builtins
import datetime
import os
import pickle
import signal
import struct
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

import checkpoint
from model import GPT, GPTConfig
from tools import convert, untrusted

CFG = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=32, vocab_size=257)


def whole(iter_num=3, val_loss=4.25):
    torch.manual_seed(0)
    return {'model': GPT(CFG).state_dict(), 'model_args': asdict(CFG), 'config': {}, 'iter_num': iter_num,
            'val_loss': val_loss}


def flip(path, pos):
    data = bytearray(Path(path).read_bytes())
    data[pos] ^= 0x01
    Path(path).write_bytes(bytes(data))


def strip_seal(path):
    """The file as it was before its seal: the 71-byte comment gone, its length back to 0 (a valid zip)."""
    data = bytearray(Path(path).read_bytes())[:-checkpoint.SEAL_LEN]
    data[-2:] = struct.pack('<H', 0)
    Path(path).write_bytes(bytes(data))


# -----------------------------------------------------------------------------
# an unsealed file is not a verified file

def test_a_file_without_a_seal_is_refused_unless_the_user_accepts_it(tmp_path):
    """Bug caught: an unsealed file read unverified and silently (as when a seal is stripped)."""
    path = tmp_path / 'ckpt.pt'
    torch.save(whole(), path)  # another tool's writer: no seal
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.load_checkpoint(path)
    msg = str(e.value)
    assert 'has no seal' in msg and '--allow_unsealed=True' in msg and '\n' not in msg
    assert checkpoint.load_checkpoint(path, unsealed=True)['iter_num'] == 3
    with pytest.raises(checkpoint.CheckpointError, match='has no seal'):
        checkpoint.load_model(path)
    assert checkpoint.load_model(path, unsealed=True)[1]['iter_num'] == 3


def test_a_stripped_seal_with_a_flipped_weight_byte_is_refused(tmp_path):
    """The held-out case: a sealed checkpoint, its seal stripped and one weight byte flipped."""
    path = tmp_path / 'ckpt.pt'
    checkpoint.save_checkpoint(str(path), whole())
    strip_seal(path)
    flip(path, path.stat().st_size // 2)
    assert checkpoint.verify(path) is False  # a plain zip again
    with pytest.raises(checkpoint.CheckpointError, match='has no seal'):
        checkpoint.load_checkpoint(path)


def test_convert_writes_sealed_checkpoints(tmp_path):
    """Bug caught: tools/convert.py's own unsealed writer."""
    out = tmp_path / 'converted' / 'ckpt.pt'
    convert.save_checkpoint(whole(), out)
    assert checkpoint.verify(out) is True and not list(out.parent.glob('*.tmp'))
    assert checkpoint.load_checkpoint(out)['iter_num'] == 3


# -----------------------------------------------------------------------------
# the best state, proven readable

def sealed_unpicklable(path):
    """A sealed file whose pickle the allow-list refuses (a datetime where a tensor should be): its
    seal matches, yet it cannot be loaded."""
    torch.save({'model': {'w': datetime.date(2020, 1, 1)}, 'model_args': asdict(CFG)}, path)
    checkpoint.seal(path)
    assert checkpoint.verify(path) is True


def test_a_sealed_best_that_cannot_be_unpickled_is_lost_and_ckpt_pt_is_named_with_its_numbers(tmp_path):
    """Bug caught: the best trusted on its seal alone, and the lost line sending the user to
    ckpt.pt as if it were the best."""
    checkpoint.save_checkpoint(str(tmp_path / 'ckpt.pt'), whole(iter_num=8, val_loss=5.125))
    sealed_unpicklable(tmp_path / 'ckpt_best.pt')
    path, note = checkpoint.best_state(str(tmp_path), 4, 3.5)
    assert path is None and '\n' not in note
    assert note.startswith('the best state (iteration 4, val loss 3.5000) is lost: ckpt_best.pt holds code or '
                           'unknown classes (datetime.date)'), note
    assert f"what is usable is {tmp_path / 'ckpt.pt'} (iteration 8, val loss 5.1250), a later state, not the best" \
        in note


def test_a_good_best_is_named_and_a_missing_one_is_said(tmp_path):
    checkpoint.save_checkpoint(str(tmp_path / 'ckpt.pt'), whole(iter_num=8), best=True)
    assert checkpoint.best_state(str(tmp_path), 8, 4.25) == (str(tmp_path / 'ckpt_best.pt'),
                                                             'the best state is in ckpt_best.pt (iteration 8, val loss '
                                                             '4.2500)')
    os.remove(tmp_path / 'ckpt_best.pt')
    path, note = checkpoint.best_state(str(tmp_path), 8, 4.25)
    assert path is None and 'ckpt_best.pt is missing' in note and 'iteration 8' in note


def test_a_damaged_best_hard_linked_to_ckpt_pt_points_at_no_copy(tmp_path):
    """Bug caught: instead() naming the damaged file itself (the same bytes under another name)."""
    checkpoint.save_checkpoint(str(tmp_path / 'ckpt.pt'), whole(), best=True)
    assert os.path.samefile(tmp_path / 'ckpt.pt', tmp_path / 'ckpt_best.pt')
    flip(tmp_path / 'ckpt.pt', 100)
    assert checkpoint.instead(tmp_path / 'ckpt_best.pt') == 'restore a good copy'
    assert checkpoint.instead(tmp_path / 'ckpt.pt') == 'restore a good copy'
    checkpoint.save_checkpoint(str(tmp_path / 'other' / 'ckpt.pt'), whole())
    checkpoint.save_checkpoint(str(tmp_path / 'other' / 'ckpt_best.pt'), whole())
    flip(tmp_path / 'other' / 'ckpt_best.pt', 100)
    assert checkpoint.instead(tmp_path / 'other' / 'ckpt_best.pt') == \
        f"use {tmp_path / 'other' / 'ckpt.pt'} instead (it verifies), or restore a good copy"


# -----------------------------------------------------------------------------
# writing: fsync, interruption, the resume point

def test_the_file_is_fsynced_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    """Bug caught: no fsync before os.replace (a power loss could leave the new name on empty bytes)."""
    events, fsync, replace = [], os.fsync, os.replace

    def watched_fsync(fd):
        events.append(('fsync', os.path.realpath(f'/proc/self/fd/{fd}')))
        return fsync(fd)

    def watched_replace(a, b):
        events.append(('replace', os.path.realpath(b)))
        return replace(a, b)
    monkeypatch.setattr(os, 'fsync', watched_fsync)
    monkeypatch.setattr(os, 'replace', watched_replace)
    path = tmp_path / 'summary.json'
    checkpoint.write_json(str(path), {'a': 1})
    tmp = f"{path}.{os.getpid()}.tmp"
    assert events == [('fsync', tmp), ('replace', str(path)), ('fsync', str(tmp_path))], events


def test_an_interrupt_mid_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    """A real SIGINT (Python's KeyboardInterrupt) half-way through writing. Bug caught: the temp
    file removed only for Exception, so an interrupt left NAME.<pid>.tmp behind."""
    path = tmp_path / 'metrics.jsonl'
    path.write_text('old\n')

    def half_then_interrupt(tmp):
        with open(tmp, 'w') as f:
            f.write('new, half')
            f.flush()
            os.kill(os.getpid(), signal.SIGINT)
            f.write(' never')
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            checkpoint.atomic_write(str(path), half_then_interrupt)
    finally:
        signal.signal(signal.SIGINT, before)
    assert path.read_text() == 'old\n' and sorted(p.name for p in tmp_path.iterdir()) == ['metrics.jsonl']


@pytest.fixture
def run_state():
    saved = dict(checkpoint._run)
    yield checkpoint._run
    checkpoint._run.clear()
    checkpoint._run.update(saved)


def test_only_ckpt_pt_moves_the_resume_point(tmp_path, run_state, capsys):
    """Bug caught: writing ckpt_best.pt (iteration 0's, before any ckpt.pt) counted as a checkpoint
    to resume from, so a signal then named a resume that does not exist."""
    run_state.update(out_dir=str(tmp_path), init_from='scratch', eval_only=False, where=lambda: 1, master=True,
                     resume_iter=None, defer=False, pending=None)
    checkpoint.save_checkpoint(str(tmp_path / 'ckpt_best.pt'), whole(iter_num=0))
    assert run_state['resume_iter'] is None
    with pytest.raises(SystemExit) as e:
        checkpoint.on_signal(signal.SIGTERM)
    assert e.value.code == 143
    assert 'before the first checkpoint: nothing to resume' in capsys.readouterr().out
    checkpoint.save_checkpoint(str(tmp_path / 'ckpt.pt'), whole(iter_num=2))
    assert run_state['resume_iter'] == 2


def test_another_users_live_process_is_alive(monkeypatch):
    """kill(pid, 0) on another user's process raises PermissionError: it runs. Bug caught: such a
    pid taken as dead, and its live temp file removed."""
    def kill(pid, sig):
        raise PermissionError(1, 'Operation not permitted')
    monkeypatch.setattr(os, 'kill', kill)
    assert checkpoint.pid_alive(os.getpid() + 1) is True
    monkeypatch.setattr(os, 'kill', lambda pid, sig: (_ for _ in ()).throw(ProcessLookupError()))
    assert checkpoint.pid_alive(os.getpid() + 1) is False
    assert checkpoint.pid_alive(os.getpid()) is False  # this process is not "another"


# -----------------------------------------------------------------------------
# tools/untrusted.py

class Planted:
    def __init__(self, fn, arg):
        self.fn, self.arg = fn, arg

    def __reduce__(self):
        return self.fn, (self.arg,)


def test_a_refusal_found_only_as_context_is_still_a_refusal():
    """An allow-list refusal that another error was raised *while handling* (implicit chaining:
    __context__, not __cause__). Bug caught: only __cause__ followed."""
    try:
        try:
            raise untrusted.RefusedGlobal('posix.system')
        except untrusted.RefusedGlobal:
            raise RuntimeError('reading the shard failed')
    except RuntimeError as e:
        assert e.__cause__ is None and isinstance(e.__context__, untrusted.RefusedGlobal)
        assert untrusted.refused_global(e) == 'posix.system'
    assert untrusted.refused_global(RuntimeError('plain')) is None


def test_every_pickle_of_torchs_legacy_format_is_scanned(tmp_path):
    """torch's legacy format is five pickles in a row (magic number, protocol, system info, the
    object, the storage keys): the planted global is in the fourth. Bug caught: the first alone."""
    path = tmp_path / 'legacy.pt'
    torch.save({'w': torch.zeros(2), 'x': Planted(builtins.exec, '1')}, path, _use_new_zipfile_serialization=False)
    assert '__builtin__.exec' in untrusted.pickle_globals(path)
    with pytest.raises(Exception) as e:
        torch.load(path, weights_only=True)
    line = untrusted.describe_load_error(e.value, path)  # torch names it 'exec': the scan finds its module
    assert 'holds code or unknown classes (__builtin__.exec)' in line


def test_a_plain_pickle_is_called_a_plain_pickle_not_damaged(tmp_path):
    """pickle.dump of plain containers: torch's weights-only load refuses it, and the line says why.
    Bug caught: a whole pickle taken for damaged bytes (the 'whole' flag lost)."""
    path = tmp_path / 'plain.pkl'
    with open(path, 'wb') as f:
        pickle.dump({'model': {'a': 1}}, f, protocol=4)
    with pytest.raises(Exception) as e:
        torch.load(path, weights_only=True)
    line = untrusted.describe_load_error(e.value, path)
    assert line is not None and 'a plain pickle, not a torch.save file' in line
    junk = tmp_path / 'junk.pt'
    junk.write_bytes(b'\x80\x04not a pickle at all')
    with pytest.raises(Exception) as e:
        torch.load(junk, weights_only=True)
    assert untrusted.describe_load_error(e.value, junk) is None  # damaged: the caller says so


# -----------------------------------------------------------------------------
# the one line of a signal, by case (the runs themselves: tests/test_run_directory.py, test_signals.py)

@pytest.mark.parametrize('case, signum, where, resume_iter, init_from, eval_only, line', [
    ('eval', signal.SIGINT, None, None, 'resume', True, 'interrupted (eval_only: nothing was written)'),
    ('start', signal.SIGTERM, None, None, 'scratch', False,
     'terminated (SIGTERM) before training started; no checkpoint was written: run the same command again'),
    ('start-resume', signal.SIGINT, None, 4, 'resume', False,
     'interrupted before training started; nothing was changed: the same command resumes from {ckpt}'),
    ('no-checkpoint', signal.SIGTERM, 3, None, 'scratch', False,
     'terminated (SIGTERM) at iteration 3, before the first checkpoint: nothing to resume; run the same command again'),
    ('one-lost', signal.SIGINT, 5, 4, 'scratch', False,
     'interrupted at iteration 5; a resume (--init_from=resume) starts from iteration 4, the last checkpoint ({ckpt}): '
     '1 iteration will run again'),
    ('many-lost', signal.SIGTERM, 9, 4, 'scratch', False,
     'terminated (SIGTERM) at iteration 9; a resume (--init_from=resume) starts from iteration 4, the last checkpoint '
     '({ckpt}): 5 iterations will run again'),
    ('none-lost', signal.SIGTERM, 4, 4, 'scratch', False,
     'terminated (SIGTERM) at iteration 4; a resume (--init_from=resume) starts from iteration 4, the last checkpoint '
     '({ckpt})'),
])
def test_each_moment_of_a_signal_has_its_line(case, signum, where, resume_iter, init_from, eval_only, line, tmp_path,
                                             run_state, capsys):
    run_state.update(out_dir=str(tmp_path), init_from=init_from, eval_only=eval_only, where=lambda: where,
                     master=True, resume_iter=resume_iter, defer=False, pending=None)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit) as e:
            checkpoint.on_signal(signum)
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    assert e.value.code == 128 + signum
    assert capsys.readouterr().out == line.format(ckpt=tmp_path / 'ckpt.pt') + '\n'


def test_a_flipped_checkpoint_names_the_verified_one_beside_it(tmp_path):
    checkpoint.save_checkpoint(str(tmp_path / 'ckpt.pt'), whole())
    checkpoint.save_checkpoint(str(tmp_path / 'ckpt_best.pt'), whole())
    flip(tmp_path / 'ckpt.pt', 1000)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.load_checkpoint(tmp_path / 'ckpt.pt')
    assert str(e.value).endswith(f"use {tmp_path / 'ckpt_best.pt'} instead (it verifies), or restore a good copy")


def test_a_checkpoint_lacking_parts_names_them(tmp_path):
    part = {k: v for k, v in whole().items() if k not in ('model_args', 'iter_num')}
    checkpoint.save_checkpoint(str(tmp_path / 'ckpt.pt'), part)
    with pytest.raises(checkpoint.CheckpointError, match=r'ckpt\.pt lacks model_args, iter_num: not a whole'):
        checkpoint.load_checkpoint(tmp_path / 'ckpt.pt', parts=('model', 'model_args', 'iter_num', 'config'))


def test_a_compiled_models_state_dict_loads(tmp_path):
    """torch.compile prefixes every key with '_orig_mod.': load_model takes it off."""
    ck = whole()
    ck['model'] = {f'_orig_mod.{k}': v for k, v in ck['model'].items()}
    checkpoint.save_checkpoint(str(tmp_path / 'ckpt.pt'), ck)
    model, _ = checkpoint.load_model(tmp_path / 'ckpt.pt')
    assert torch.equal(model.lm_head.weight, whole()['model']['lm_head.weight'])


def test_without_hard_links_the_best_state_is_a_verified_copy(tmp_path, monkeypatch):
    def no_link(a, b):
        raise OSError(1, 'hard links not supported')
    monkeypatch.setattr(os, 'link', no_link)
    checkpoint.save_checkpoint(str(tmp_path / 'ckpt.pt'), whole(), best=True)
    assert not os.path.samefile(tmp_path / 'ckpt.pt', tmp_path / 'ckpt_best.pt')
    assert (tmp_path / 'ckpt.pt').read_bytes() == (tmp_path / 'ckpt_best.pt').read_bytes()
    assert checkpoint.verify(tmp_path / 'ckpt_best.pt') and sorted(p.name for p in tmp_path.iterdir()) == \
        ['ckpt.pt', 'ckpt_best.pt']


def test_a_killed_runs_one_partial_file_is_named_in_the_singular(tmp_path):
    (tmp_path / 'ckpt.pt.123.tmp').write_bytes(b'x' * 2_000_000)
    (tmp_path / 'notes.txt.123.tmp').write_bytes(b'not the run\'s')
    said = []
    checkpoint.remove_stale_temp(str(tmp_path), locked=True, say=said.append)
    assert said == [f"removed 1 partial file that a killed run left mid-write in {tmp_path}: ckpt.pt.123.tmp (2.0 MB)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ['notes.txt.123.tmp']


def test_json_is_written_indented(tmp_path):
    checkpoint.write_json(str(tmp_path / 's.json'), {'a': [1]})
    assert (tmp_path / 's.json').read_text() == '{\n "a": [\n  1\n ]\n}'


def test_a_refusal_is_found_as_a_cause_in_a_wrapper_and_named_from_torchs_message(tmp_path):
    """Where a refusal hides: the __cause__ of a wrapper (after a None __context__), the
    {rank: (exception, traceback)} failures of torch.distributed.checkpoint's wrapper, and torch's
    own weights-only message, which names the global after 'GLOBAL'."""
    def wrapped():
        try:
            raise RuntimeError('reading failed') from untrusted.RefusedGlobal('posix.system')
        except RuntimeError as e:
            return e
    e = wrapped()
    assert e.__context__ is None and untrusted.refused_global(e) == 'posix.system'

    class CheckpointException(Exception):  # torch.distributed.checkpoint's: failures by rank
        def __init__(self, failures):
            super().__init__('a rank failed')
            self.failures = failures
    assert untrusted.refused_global(CheckpointException({0: (untrusted.RefusedGlobal('builtins.exec'), 'tb')})) == \
        'builtins.exec'
    assert untrusted.refused_global(CheckpointException({1: untrusted.RefusedGlobal('os.system')})) == 'os.system'
    assert untrusted.refused_global(CheckpointException({0: (ValueError('io'), 'tb')})) is None
    path = tmp_path / 'code.pt'
    torch.save({'x': Planted(os.system, 'true')}, path)
    with pytest.raises(pickle.UnpicklingError) as e:
        torch.load(path, weights_only=True)
    assert untrusted.refused_global(e.value) == 'posix.system'
    assert untrusted.describe_load_error(e.value, path) == (
        f"{path} holds code or unknown classes (posix.system): refused, nothing in it was run; get the file again "
        f"from a source you trust")


def test_the_scanner_reads_zip_members_and_protocol_4_names_from_the_memo(tmp_path):
    """pickle_globals reads opcodes only. A torch.save zip: its data.pkl member (GLOBAL opcodes);
    a protocol-4 pickle.dump: STACK_GLOBAL, whose module string the second time is fetched from
    the memo (MEMOIZE, BINGET), so builtins.eval is only found by following the memo."""
    z = tmp_path / 'z.pt'
    torch.save({'w': torch.zeros(2), 'x': Planted(builtins.exec, '1')}, z)
    assert untrusted.pickle_globals(z)[-1] == '__builtin__.exec'
    p = tmp_path / 'p.pkl'
    with open(p, 'wb') as f:
        pickle.dump({'a': Planted(builtins.exec, '1'), 'b': Planted(builtins.eval, '2')}, f, protocol=4)
    assert untrusted.pickle_globals(p) == ['builtins.exec', 'builtins.eval']
    with pytest.raises(Exception) as e:
        torch.load(z, weights_only=True)
    assert 'unknown classes (__builtin__.exec)' in untrusted.describe_load_error(e.value, z)  # torch said 'exec'
