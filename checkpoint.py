"""
The run directory (train.py's --out_dir) in one file: writing, sealing, reading and verifying
checkpoints, keeping the best state, locking the folder, cleaning what a killed run left,
and the one line a Ctrl-C or SIGTERM prints. Used by train.py, probe.py, sample.py and study/.

    ckpt = checkpoint.load_checkpoint('out/run/ckpt.pt')           # verified, weights_only
    model, ckpt = checkpoint.load_model('out/run/ckpt.pt', 'cpu')  # a GPT in eval mode

A run's folder:
  ckpt.pt            the latest checkpoint; a resume starts from it
  ckpt_best.pt       the state of the lowest validation loss (a hard link to ckpt.pt's bytes then)
  ckpt_nonfinite.pt  the state at a NaN/Inf, for a diagnosis (never resumed)
  metrics.jsonl      one JSON row per log step and evaluation
  summary.json       written when the run reaches max_iters
  train.lock         flock'ed by the run that writes the folder

Every file is written through atomic_write: a temp file NAME.<pid>.tmp beside it, fsync,
rename, fsync of the folder; a crash or kill -9 at any moment leaves the last complete file.
Each checkpoint is sealed with its sha256 in the same file: torch.save's zip archive gets
the 71-byte archive comment b'sha256:<64 hex>', the hash of every byte before it, so the
hash is written and renamed with the file, and torch.load reads the file as before.
load_checkpoint checks the seal before unpickling (a flipped byte, a cut-off file) and
unpickles with weights_only=True (no code runs from a file a user loads). A file without a
seal (plain torch.save, another tool's) cannot be verified: every reader refuses it in one line
unless its user passes --allow_unsealed=True (UNSEALED_SETTING).
"""

import errno
import hashlib
import json
import os
import shutil
import signal
import struct
import sys
import time
from pathlib import Path

import torch

from tools.untrusted import describe_load_error

REPO_ROOT = Path(__file__).resolve().parent
# the files a run writes in out_dir (each through atomic_write, or a hard link, via NAME.<pid>.tmp)
OUT_FILES = ('ckpt.pt', 'ckpt_best.pt', 'ckpt_nonfinite.pt', 'metrics.jsonl', 'summary.json')
# what a checkpoint must hold for train.py to resume from it
CHECKPOINT_PARTS = ('model', 'model_args', 'optimizer', 'iter_num', 'loader', 'rng')
SEAL = b'sha256:'  # the archive comment: SEAL + the 64 hex digits of the sha256 of the bytes before it
SEAL_LEN = len(SEAL) + 64
EOCD = b'PK\x05\x06'  # a zip's end-of-central-directory record: 22 bytes, its comment's length in the last 2
UNSEALED_SETTING = '--allow_unsealed=True'  # reads a file without a seal, unverified (train, probe, sample, convert)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (damaged, cut off, unsealed, foreign); the message is one
    line, `reason` its cause alone (without the advice)."""

    def __init__(self, msg, reason=None):
        super().__init__(msg)
        self.reason = reason or msg


# -----------------------------------------------------------------------------
# one line for a user error; what a failed start undoes

def say(msg):
    """One line, as one write (a signal's line never lands between it and its newline)."""
    sys.stdout.write(f"{msg}\n")
    sys.stdout.flush()


cleanups = []  # run by fail(): undo what a failed start created (the lock, an empty out_dir)


def fail(msg):
    """A user error: one line, no traceback."""
    for fn in cleanups:
        fn()
    sys.exit(f"error: {msg}")

# -----------------------------------------------------------------------------
# Ctrl-C and SIGTERM

_run = {'out_dir': '.', 'init_from': 'scratch', 'eval_only': False, 'where': lambda: None, 'master': True,
        'resume_iter': None,  # the iteration of out_dir/ckpt.pt, where a resume starts (None: none yet)
        'defer': False, 'pending': None}  # a signal during a checkpoint write waits for its end


def catch_signals(out_dir, init_from, eval_only, where, master=True):
    """Ctrl-C (SIGINT) and SIGTERM (what SLURM and Kubernetes send before they kill) at any
    moment: one line saying from which iteration a resume starts, instead of a traceback or
    silence. where(): the iteration being trained, None before the loop starts."""
    _run.update(out_dir=out_dir, init_from=init_from, eval_only=eval_only, where=where, master=master)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)


def on_signal(signum, frame=None):
    """Exits 130 (SIGINT) or 143 (SIGTERM) after one line; during a checkpoint write it waits
    until the write ends, so the line names the checkpoint on disk."""
    if _run['defer']:
        _run['pending'] = signum
        return
    for s in (signal.SIGINT, signal.SIGTERM):  # one line, however many signals follow (a group and its parent)
        signal.signal(s, signal.SIG_IGN)
    what = 'interrupted' if signum == signal.SIGINT else f'terminated ({signal.Signals(signum).name})'
    ckpt, it, resume_iter = os.path.join(_run['out_dir'], 'ckpt.pt'), _run['where'](), _run['resume_iter']
    if _run['eval_only']:
        msg = f"{what} (eval_only: nothing was written)"
    elif it is None:
        for fn in cleanups:  # undo what the start created (an out_dir holding only the lock)
            fn()
        msg = f"{what} before training started; " + (
            f"nothing was changed: the same command resumes from {ckpt}" if _run['init_from'] == 'resume'
            else "no checkpoint was written: run the same command again")
    elif resume_iter is None:
        msg = f"{what} at iteration {it}, before the first checkpoint: nothing to resume; run the same command again"
    else:
        lost = it - resume_iter
        msg = (f"{what} at iteration {it}; a resume (--init_from=resume) starts from iteration {resume_iter}, "
               f"the last checkpoint ({ckpt})" + (f": {lost} iteration{'s' if lost > 1 else ''} will run again"
                                                   if lost > 0 else ''))
    if _run['master']:
        print(msg, flush=True)
    sys.exit(128 + signum)

# -----------------------------------------------------------------------------
# the lock, and what a killed run left


def lock_out_dir(out_dir):
    """An exclusive flock on out_dir/train.lock, held until the process ends (the kernel
    releases it on any exit, kill -9 included): two runs never write one out_dir. The file
    names the holder's pid. Returns the open file (keep it referenced); None without flock."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        return None
    created = not os.path.isdir(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, 'train.lock')
    f = open(path, 'a+')
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        time.sleep(0.2)  # a holder that has just taken the lock writes its pid next
        f.seek(0)
        other = f.read().strip() or '?'
        f.close()
        fail(f"{out_dir} is in use by another train.py (pid {other}, holding {path}): wait for it to "
             f"end, or use another --out_dir")
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()

    def undo():  # a failed start leaves out_dir as it found it
        if os.path.exists(path) and sorted(os.listdir(out_dir)) == ['train.lock']:
            os.remove(path)
            if created:
                os.rmdir(out_dir)
    cleanups.append(undo)
    return f


def pid_alive(pid):
    """Whether a process other than this one runs with that pid."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)  # signal 0: only checks
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except (OverflowError, ValueError):  # no such pid can exist
        return False
    return True


def remove_stale_temp(out_dir, locked, say=say):
    """Removes the partial files NAME.<pid>.tmp (atomic_write's, NAME one of OUT_FILES) that a
    process killed mid-write left in out_dir, in one line. locked: this process holds
    out_dir's lock, and every writer of out_dir holds it, so each such file is stale, whatever
    its pid now names (pids are reused). Without a lock (no flock here) a file whose pid runs
    is kept, and named in one line."""
    removed, kept = [], []
    for name in sorted(os.listdir(out_dir)):
        base, _, pid = name.removesuffix('.tmp').rpartition('.')
        if not (name.endswith('.tmp') and pid.isdigit() and base in OUT_FILES):
            continue
        if not locked and pid_alive(int(pid)):
            kept.append(f"{name} (pid {pid} is running)")
            continue
        path = os.path.join(out_dir, name)
        removed.append(f"{name} ({os.path.getsize(path) / 1e6:,.1f} MB)")
        os.remove(path)
    if removed:
        say(f"removed {len(removed)} partial file{'s' if len(removed) > 1 else ''} that a killed run left "
            f"mid-write in {out_dir}: {', '.join(removed)}")
    if kept:
        say(f"note: kept {', '.join(kept)} in {out_dir}: remove it once that process has ended")

# -----------------------------------------------------------------------------
# writing


def fsync_replace(tmp, path):
    """os.replace(tmp, path) once tmp's bytes are on the disk (fsync), then fsync the
    directory so that the rename itself survives a power loss."""
    with open(tmp, 'rb+') as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems cannot fsync a directory
        pass
    finally:
        os.close(fd)


def atomic_write(path, write):
    """write(tmp) writes the file at the path tmp, a temp name unique to this process beside
    path; then fsync and rename: a crash or a full disk mid-write never leaves a truncated
    file at path, nor a temp file behind. (torch.save is given the path, not a Python file
    object: its C++ writer then runs no Python, so a signal lands after the write.)"""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        write(tmp)
        fsync_replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_bytes(tmp, data):
    with open(tmp, 'wb') as f:
        f.write(data)


def nbytes(obj):
    """Bytes of the tensors in a (nested) state dict: the size of its checkpoint, roughly."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    return 0


def write_failed(path, e, need_bytes=None):
    """One line (fail) for a write that failed: a full disk or quota, the file-size limit
    (ulimit -f), or an I/O error, naming the disk and the space; the last complete files are kept."""
    d = os.path.dirname(os.path.abspath(path))
    free = shutil.disk_usage(d).free
    need = f", about {need_bytes / 1e6:,.1f} MB needed" if need_bytes else ''
    try:
        import resource
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        limit = None if limit == resource.RLIM_INFINITY else limit
    except ImportError:  # not POSIX
        limit = None
    ckpt = os.path.join(d, 'ckpt.pt')
    # a resume needs a checkpoint: before the first one, the fix is to run the command again
    then = f"and resume; {ckpt} (the last complete checkpoint) is kept" if os.path.exists(ckpt) else \
        "and run the same command again (no checkpoint to resume from yet)"
    # torch's C++ writer gives no errno: a write larger than the limit is the limit's
    if getattr(e, 'errno', None) == errno.EFBIG or (limit is not None and need_bytes and need_bytes >= limit):
        fail(f"cannot write {path}: it would pass this process's file-size limit (ulimit -f: {limit / 1e6:,.1f} MB"
             f"{need}; {free / 1e6:,.1f} MB free on {d}): raise it (ulimit -f unlimited) {then}")
    if getattr(e, 'errno', None) in (errno.EROFS, errno.EACCES, errno.EPERM):
        fail(f"cannot write {path}: {os.strerror(e.errno).lower()} ({d}): use an --out_dir you can write to "
             f"{then}")
    full = getattr(e, 'errno', None) in (errno.ENOSPC, errno.EDQUOT) or 'No space left' in str(e) \
        or (need_bytes is not None and free < need_bytes)
    why = 'the disk is full' if full else f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    fail(f"cannot write {path}: {why} ({d}: {free / 1e6:,.1f} MB free{need}): free space, or move "
         f"--out_dir to another disk, {then}")


def full_state(model, optimizer, fsdp=False):
    """(model state dict, optimizer state dict) as plain tensors, gathered on every rank when
    FSDP shards them (a collective: every rank calls it)."""
    if not fsdp:
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=opts)
    if not optimizer.state:  # nothing stepped yet (ckpt_best.pt at iteration 0): get_optimizer_state_dict
        # would fill the state with a zero-lr AdamW step, and the first real step would count as the
        # second (other bias corrections): the groups alone, parameters by name, as it writes them
        names = {id(p): n for n, p in model.named_parameters()}
        opt = {'state': {}, 'param_groups': [dict(g, params=[names[id(p)] for p in g['params']])
                                             for g in optimizer.param_groups]}
    else:
        opt = get_optimizer_state_dict(model, optimizer, options=opts)
    return model_state, opt


def seal(tmp):
    """Appends the sha256 of the file at tmp (a torch.save zip) as its archive comment."""
    with open(tmp, 'r+b') as f:
        f.seek(-22, os.SEEK_END)
        eocd = f.read(22)
        assert eocd[:4] == EOCD and eocd[20:] == b'\0\0', f"{tmp}: not a zip archive without a comment"
        f.seek(-2, os.SEEK_END)
        f.write(struct.pack('<H', SEAL_LEN))  # the comment's length, inside the hashed bytes
        f.seek(0)
        digest = hashlib.file_digest(f, 'sha256').hexdigest()
        f.seek(0, os.SEEK_END)
        f.write(SEAL + digest.encode())


def save_checkpoint(path, ckpt, best=False):
    """torch.save(ckpt) to path, sealed with its sha256 and written atomically (a kill -9 at
    any moment leaves the previous file whole); best: also keep it as ckpt_best.pt beside it
    (a hard link: no second copy on disk). A signal waits for the end. One line (fail) if the
    write fails."""
    _run['defer'] = True
    try:
        os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
        try:
            atomic_write(path, lambda tmp: (torch.save(ckpt, tmp), seal(tmp)))
            if best:
                best_path = os.path.join(os.path.dirname(path), 'ckpt_best.pt')
                tmp = f"{best_path}.{os.getpid()}.tmp"
                try:
                    os.link(path, tmp)  # the same bytes under a second name; replacing ckpt.pt later keeps them
                    os.replace(tmp, best_path)
                except OSError:  # no hard links here: a copy
                    if os.path.exists(tmp):
                        os.remove(tmp)
                    atomic_write(best_path, lambda t: shutil.copyfile(path, t))
        except (OSError, RuntimeError) as e:  # torch reports a failed write as a RuntimeError
            write_failed(path, e, nbytes(ckpt))
        if os.path.basename(path) == 'ckpt.pt':
            _run['resume_iter'] = ckpt.get('iter_num')
    finally:
        _run['defer'] = False
    if _run['pending'] is not None:
        on_signal(_run['pending'])


def write_json(path, obj):
    """obj as indented JSON at path, atomically; one line (fail) if the write fails."""
    try:
        atomic_write(path, lambda tmp: write_bytes(tmp, json.dumps(obj, indent=1).encode()))
    except OSError as e:
        write_failed(path, e)

# -----------------------------------------------------------------------------
# reading and verifying


def verify(path):
    """Checks the sha256 sealed into a checkpoint file: True when it matches, False for a
    file with no seal (written by plain torch.save). Raises CheckpointError (one line naming
    the file and what to use instead) for a mismatch or a damaged seal."""
    size = os.path.getsize(path)
    with open(path, 'rb') as f:
        if size >= SEAL_LEN + 22:
            f.seek(size - SEAL_LEN - 22)
            eocd = f.read(22)
            if eocd[:4] == EOCD:  # sealed (torch.save writes no comment)
                comment = f.read()
                digest = comment[len(SEAL):].decode('ascii', 'replace')
                ok = eocd[20:] == struct.pack('<H', SEAL_LEN) and comment.startswith(SEAL)
                if ok:
                    f.seek(0)
                    h = hashlib.sha256()
                    left = size - SEAL_LEN
                    while left:
                        chunk = f.read(min(left, 1 << 24))
                        h.update(chunk)
                        left -= len(chunk)
                    ok = h.hexdigest() == digest
                if not ok:
                    why = "does not match the sha256 recorded in it (a byte changed, or the file was cut, after it " \
                          "was written)"
                    raise CheckpointError(f"{path} {why}: {instead(path)}", why)
                return True
    return False


def instead(path):
    """What to use in place of a damaged checkpoint: the other of ckpt.pt / ckpt_best.pt
    beside it when that one verifies, else a good copy."""
    d, name = os.path.split(str(path))
    other = os.path.join(d, {'ckpt.pt': 'ckpt_best.pt'}.get(name, 'ckpt.pt'))
    if other != str(path) and os.path.exists(other) and not os.path.samefile(other, path):
        try:
            good = verify(other)
        except (CheckpointError, OSError):
            good = False
        if good:
            return f"use {other} instead (it verifies), or restore a good copy"
    return "restore a good copy"


def load_checkpoint(path, parts=('model', 'model_args'), unsealed=False, mmap=False):
    """A train.py checkpoint as a dict on the CPU: its seal verified, unpickled with
    weights_only=True (the allow-list: tensors and plain containers), holding `parts`. A file
    without a seal is refused unless `unsealed` (the user's --allow_unsealed=True). mmap: the
    tensors are mapped, not read (a check that the file unpickles). Raises FileNotFoundError for
    a missing file and CheckpointError (one line) for a damaged, cut-off, unsealed, refused or
    foreign one."""
    path = str(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path} not found; train one with `python train.py CONFIG` "
                                f"or give the path of an existing ckpt.pt")
    if not verify(path) and not unsealed:
        why = "has no seal (the sha256 every DepthBench writer adds): it was cut off (truncated), or written by " \
              "another tool, and cannot be verified"
        raise CheckpointError(f"{path} {why}: {instead(path)}; for another tool's checkpoint that you trust, pass "
                              f"{UNSEALED_SETTING} to read it unverified", why)
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=True, mmap=mmap)
    except Exception as e:  # RuntimeError / EOFError / UnpicklingError for damaged files
        refused = describe_load_error(e, path)  # a file holding code or unknown classes: said so, by name
        if refused:
            raise CheckpointError(f"checkpoint {refused}", refused.removeprefix(f"{path} ").split(':')[0]) from None
        why = f"cannot be read ({type(e).__name__}): the file is truncated or not a torch checkpoint"
        raise CheckpointError(f"checkpoint {path} {why}; {instead(path)}", why) from None
    missing = [k for k in parts if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        why = f"lacks {', '.join(missing)}: not a whole train.py checkpoint"
        raise CheckpointError(f"{path} {why}; restore a good copy", why)
    return ckpt


def iteration_of(path):
    """The iteration of the checkpoint at path, read without its tensors (mmap) and unverified;
    None for a missing or unreadable file."""
    try:
        return torch.load(path, map_location='cpu', weights_only=True, mmap=True).get('iter_num')
    except Exception:  # missing, damaged, or not a dict
        return None


def load_model(ckpt_path, device='cpu', fast=False, unsealed=False):
    """Loads a train.py checkpoint (load_checkpoint: verified; unsealed: --allow_unsealed=True) into
    GPT in eval mode on `device`, with the fast paths `fast` ('auto' | True | False, fast/) in place
    after their start-up check. Returns (model, ckpt), ckpt without 'model' and optimizer state. Raises
    FileNotFoundError, ValueError (CheckpointError) for a damaged or foreign file and
    fast.FastPathMismatch when a fast path disagrees with residuals.py."""
    import fast as fastpath
    from model import GPT, GPTConfig
    ckpt = load_checkpoint(ckpt_path, unsealed=unsealed)
    cfg = GPTConfig.from_dict(ckpt['model_args'])
    with torch.device(device):  # built where it runs (fast init on a GPU; buffers computed as usual)
        model = GPT(cfg)
    state = {k.removeprefix('_orig_mod.'): v for k, v in ckpt['model'].items()}
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"checkpoint {ckpt_path} does not match its model_args ({str(e).splitlines()[0]}); "
                         f"was it written by a different version of model.py / residuals.py?") from None
    model.eval()
    fastpath.setup(model, fast, device)
    return model, {k: v for k, v in ckpt.items() if k not in ('model', 'optimizer')}


def read_meta(path):
    """A data directory's meta.json as a dict ({} when absent); ValueError when unreadable."""
    path = Path(path)
    if not path.is_file():
        return {}
    try:
        meta = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}): prepare the data again") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{path} is not a JSON object: prepare the data again")
    return meta


def data_dir_for(ckpt):
    """The data directory of a checkpoint's training config: its data_dir if set, else
    data/<dataset> relative to the working directory or, failing that, to the repository
    root. None when the config names neither."""
    config = ckpt.get('config') or {}
    if config.get('data_dir'):
        return Path(config['data_dir'])
    dataset = config.get('dataset')
    if not dataset:
        return None
    for root in (Path.cwd(), REPO_ROOT):
        if (root / 'data' / dataset).is_dir():
            return root / 'data' / dataset
    return Path('data') / dataset


def tokenizer_name_for(ckpt, val_bin=None):
    """Which tokenizer a checkpoint was trained with: the one it records ('tokenizer', written by
    train.py from its data's meta.json), else config['tokenizer'], else 'tokenizer' of the meta.json
    beside val_bin or its data directory, else the dataset's suffix ('_byte' -> byte), else by vocab size."""
    config = ckpt.get('config') or {}
    if ckpt.get('tokenizer') or config.get('tokenizer'):
        return ckpt.get('tokenizer') or config['tokenizer']
    for meta in ([Path(val_bin).parent / 'meta.json'] if val_bin else []) + \
                ([data_dir_for(ckpt) / 'meta.json'] if data_dir_for(ckpt) else []):
        if meta.is_file():
            name = read_meta(meta).get('tokenizer')
            if name:
                return name
    if str(config.get('dataset', '')).endswith('_byte') or ckpt['model_args'].get('vocab_size', 50280) <= 257:
        return 'byte'
    return 'gpt2'

# -----------------------------------------------------------------------------
# train.py's run folder: resume, metrics.jsonl, the best state


def load_for_resume(out_dir, unsealed=False):
    """out_dir/ckpt.pt for --init_from=resume: verified (unsealed: --allow_unsealed=True) and whole
    (CHECKPOINT_PARTS); one line (fail) otherwise. A signal from here on names its iteration as
    where a resume starts."""
    path = os.path.join(out_dir, 'ckpt.pt')
    if not os.path.exists(path):
        fail(f"init_from='resume' but {path} does not exist: start with --init_from=scratch")
    try:
        ckpt = load_checkpoint(path, parts=CHECKPOINT_PARTS, unsealed=unsealed)
    except (CheckpointError, OSError) as e:
        fail(f"{e}; or start fresh with --init_from=scratch in another --out_dir")
    _run['resume_iter'] = ckpt['iter_num']
    return ckpt


def restore(ckpt, scaler, loader, tokens_per_iter):
    """Puts a resumed run's state back (the optimizer's is loaded by train.py): the fp16 loss
    scaler, the data loader's position, the RNG states (CUDA's where the run has one). Returns
    (iter_num, best_val_loss, best_iter, tokens trained; an older checkpoint without a count: at
    today's batch)."""
    if ckpt.get('scaler'):
        scaler.load_state_dict(ckpt['scaler'])
    loader.load_state_dict(ckpt['loader'])
    torch.set_rng_state(ckpt['rng']['torch'])
    if torch.device(loader.device).type == 'cuda' and 'cuda' in ckpt['rng']:
        torch.cuda.set_rng_state(ckpt['rng']['cuda'])
    it = ckpt['iter_num']
    return it, ckpt.get('best_val_loss', float('inf')), ckpt.get('best_iter'), ckpt.get('tokens', it * tokens_per_iter)


def _row_iter(line):
    """The 'iter' of one metrics.jsonl line; None for a line cut off by a crash mid-write."""
    try:
        return json.loads(line)['iter']
    except (ValueError, KeyError, TypeError):
        return None


class MetricsLog:
    """out_dir/metrics.jsonl, one JSON row per line, for a run starting at iter_num: a resume
    drops the rows logged after its checkpoint (iterations it repeats), so each iteration has
    one row; a new run moves an earlier run's rows (one that left no checkpoint) to
    metrics_old<k>.jsonl, so the file never holds two histories as one. The file is opened
    with the first row: a failed start leaves none."""

    def __init__(self, out_dir, init_from, iter_num, say=say, wandb=None):
        self.path, self.file, self.wandb = os.path.join(out_dir, 'metrics.jsonl'), None, wandb
        if init_from == 'resume' and os.path.exists(self.path):
            with open(self.path) as f:
                rows = [line for line in f if (it := _row_iter(line)) is not None and it <= iter_num]
            try:
                atomic_write(self.path, lambda tmp: write_bytes(tmp, ''.join(rows).encode()))
            except OSError as e:
                write_failed(self.path, e)
        elif init_from == 'scratch' and os.path.exists(self.path) and os.path.getsize(self.path):
            k = 1
            while os.path.exists(os.path.join(out_dir, f'metrics_old{k}.jsonl')):
                k += 1
            old = os.path.join(out_dir, f'metrics_old{k}.jsonl')
            os.replace(self.path, old)
            say(f"note: {self.path} held the rows of an earlier run that left no checkpoint to resume: moved to {old}")

    def write(self, row):
        try:
            if self.file is None:
                self.file = open(self.path, 'a')
            self.file.write(json.dumps(row) + '\n')
            self.file.flush()
        except OSError as e:
            write_failed(self.path, e)
        if self.wandb is not None:  # train.py --wandb_log=True: the same row, as W&B scalars
            self.wandb.log(wandb_row(row), step=row['iter'])


def wandb_row(row):
    """A metrics.jsonl row as W&B scalars at step row['iter']: a per-block list becomes one key per
    block ('block_grad_norm/0', ...), so that each block gets its own curve; None values are left
    out. An evaluation row's lr (the rate of the iteration about to start) is left out too: at the
    same step, the training row's lr is the rate that step was trained with."""
    out = {}
    for k, v in row.items():
        if isinstance(v, list):
            out.update({f"{k}/{b}": x for b, x in enumerate(v)})
        elif v is not None and k != 'iter' and not (k == 'lr' and 'val_loss' in row):
            out[k] = v
    if row.get('block_grad_norm'):
        g = row['block_grad_norm']
        out['grad_first_last_ratio'] = g[0] / max(g[-1], 1e-12)
    return out


def best_state(out_dir, best_iter, best_val_loss=None):
    """(path of ckpt_best.pt, or None when it is lost; one line saying where the run's best state
    is). The best state is named only when proven readable: its seal verifies and it unpickles
    with the allow-list (tensors mapped, not read). A lost one's line names what is usable
    instead: ckpt.pt, its iteration and validation loss (a later state, not the best)."""
    path = os.path.join(out_dir, 'ckpt_best.pt')
    at = f"iteration {best_iter}" + (f", val loss {best_val_loss:.4f}" if best_val_loss is not None else '')
    try:
        load_checkpoint(path, mmap=True)
        return path, f"the best state is in ckpt_best.pt ({at})"
    except FileNotFoundError:
        why = "ckpt_best.pt is missing"
    except (CheckpointError, OSError) as e:
        why = f"ckpt_best.pt {getattr(e, 'reason', e)}"
    ckpt = os.path.join(out_dir, 'ckpt.pt')
    try:
        last = load_checkpoint(ckpt, parts=('iter_num',), mmap=True)
        val = last.get('val_loss')
        usable = (f"what is usable is {ckpt} (iteration {last['iter_num']}"
                  + (f", val loss {val:.4f}" if isinstance(val, float) else '') + "), a later state, not the best")
    except (CheckpointError, OSError) as e:
        usable = f"{ckpt} is not usable either ({getattr(e, 'reason', e)})"
    return None, f"the best state ({at}) is lost: {why}; {usable}"
