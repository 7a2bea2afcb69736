"""
What train.py refuses before its first step, each in one line (checkpoint.fail: `error: ...`,
exit status 1, the lock and an out_dir the start created removed), in the order train.py asks:

  settings        a value out of its range (a count below 1, beta1 = 1.5, a fraction above 1,
                  --memory_gib=-1, ...), an unknown init_from, fast or decay_on
  out_dir         an out_dir that is a file, or on a folder this process cannot write
                  (a read-only file system, another user's folder)
  device          a device that is no torch device, CUDA absent or unusable, a dtype that
                  is none or is not for this device, FSDP outside torchrun, an accumulation
                  that the processes do not divide
  data            a missing data_dir, a meta.json that is no JSON object, a val.bin shorter
                  than one sequence, no vocab_size known
  model_args      an unknown residual scheme, a shape GPTConfig refuses
  resume          a model setting other than the checkpoint's, model_args that make no model
                  (and notes each schedule setting that differs)
  scratch         a new run in an out_dir that holds one
  token_ids       a token id at or past the model's vocab_size in train.bin or val.bin
  finished        a resume past max_iters, or of a finished run
  weights         weights or optimizer state that do not fit the model

Each check takes plain values (no globals), so tests/test_checks.py stages each refusal, and
the value just inside it, in-process.
"""

import difflib
import importlib.util
import json
import math
import os
from dataclasses import asdict

import torch

import fast as fastpath
from checkpoint import fail
from data.loader import open_tokens
from model import GPTConfig
from residuals import RESIDUALS

# key -> (lowest allowed, lowest itself allowed, highest allowed, highest itself allowed); None: unbounded.
# A None value keeps its documented meaning and is not checked.
RANGES = {
    'eval_interval': (1, True, None, None), 'log_interval': (1, True, None, None), 'eval_iters': (1, True, None, None),
    'gradient_accumulation_steps': (1, True, None, None), 'batch_size': (1, True, None, None),
    'block_size': (1, True, None, None), 'max_iters': (1, True, None, None), 'stop_iter': (1, True, None, None),
    'warmup_iters': (0, True, None, None), 'learning_rate': (0, False, None, None),
    'tokens_per_param': (0, False, None, None), 'weight_decay': (0, True, None, None),
    'grad_clip': (0, True, None, None),
    'warmup_frac': (0, True, 1, True), 'min_lr_frac': (0, True, 1, True), 'attnres_eps': (0, False, None, None),
    'dist_timeout': (0, False, None, None), 'memory_gib': (0, False, None, None),
    'beta1': (0, True, 1, False), 'beta2': (0, True, 1, False),  # AdamW's decay rates: 1 never forgets, > 1 grows
}
WHY = {'warmup_frac': 'a fraction of max_iters', 'min_lr_frac': 'a fraction of the peak learning rate',
       'beta1': "AdamW's decay rate of the gradient's mean", 'beta2': "AdamW's decay rate of its square",
       'memory_gib': "the memory the plan is held against, in GiB"}


def in_range(key, value):
    """None when `value` lies in RANGES[key] (or is None), else the one line that refuses it."""
    low, low_ok, high, high_ok = RANGES[key]
    if value is None:
        return None
    inside = (value > low or (low_ok and value == low)) and \
        (high is None or value < high or (high_ok and value == high))
    if inside:
        return None
    if high is None:
        return f"{key}={value:g} must be {'>=' if low_ok else '>'} {low}" + (f" ({WHY[key]})" if key in WHY else '')
    span = f"{'[' if low_ok else '('}{low}, {high}{']' if high_ok else ')'}"
    return f"{key}={value:g} must be in {span} ({WHY[key]})"


def settings(cfg):
    """Refuses, from train.py's settings `cfg` (a dict): a number outside RANGES, an init_from
    other than 'scratch' / 'resume', a fast setting fast.resolve refuses, a decay_on other than
    'all' / 'matrices', auto_batch=True with fsdp=True, wandb_log=True without the wandb package."""
    for key in RANGES:
        msg = in_range(key, cfg[key])
        if msg:
            fail(msg)
    if cfg['init_from'] not in ('scratch', 'resume'):
        fail(f"init_from={cfg['init_from']!r}: use 'scratch' or 'resume'")
    try:
        fastpath.resolve(cfg['fast'], 'cpu')
    except ValueError as e:
        fail(str(e))
    if cfg['decay_on'] not in ('all', 'matrices'):
        fail(f"decay_on={cfg['decay_on']!r}: use 'all' (the study's weight-decay groups) or 'matrices' (nanoGPT's)")
    if cfg['auto_batch'] and cfg['fsdp']:
        fail("auto_batch=True plans an unsharded model: drop --fsdp=True, or set --batch_size yourself")
    if cfg['wandb_log'] and importlib.util.find_spec('wandb') is None:
        fail("wandb_log=True needs the wandb package: pip install wandb (or drop --wandb_log=True)")


def out_dir(path):
    """Refuses an out_dir that is a file (or lies under one) or that this process cannot write:
    a read-only file system, a folder without write permission. Creates nothing."""
    p = os.path.abspath(path)
    while not os.path.exists(p):  # the nearest part that exists: where the folders would be made
        p = os.path.dirname(p)
    if not os.path.isdir(p):
        fail(f"out_dir={path!r}: {p} is a file, not a folder: give another --out_dir")
    if not os.access(p, os.W_OK | os.X_OK):
        why = 'is on a read-only file system' if os.statvfs(p).f_flag & os.ST_RDONLY else \
            'is not writable by this user'
        fail(f"out_dir={path!r}: {p} {why}: give an --out_dir you can write to")


def device(device, dtype, ddp, fsdp):
    """(device type, dtype) of a run on `device` (dtype None: bf16 autocast on CUDA where
    supported, else float32). Refuses a device that is no torch device, cuda without CUDA, a
    device that cannot run a tensor op (mps without it, meta), a dtype other than float32 /
    bfloat16 / float16, autocast off CUDA, fsdp=True without torchrun."""
    try:
        torch.device(device)
    except RuntimeError:
        fail(f"device={device!r} is not a torch device: use 'cpu', 'cuda', 'cuda:N' or 'mps'")
    device_type = 'cuda' if device.startswith('cuda') else device.split(':')[0]
    if device_type == 'cuda' and not torch.cuda.is_available():
        fail(f"device={device!r} but CUDA is not available here: use --device=cpu")
    try:  # e.g. mps on a build without it, or meta (no data)
        torch.zeros(1, device=device).item()
    except (RuntimeError, AssertionError, NotImplementedError) as e:
        why = str(e).splitlines()[0]
        fail(f"device={device!r} cannot run here ({why if len(why) < 100 else why[:97] + '...'}): use --device=cpu")
    if dtype is None:
        dtype = 'bfloat16' if device_type == 'cuda' and torch.cuda.is_bf16_supported() else 'float32'
    if dtype not in ('float32', 'bfloat16', 'float16'):
        fail(f"dtype={dtype!r}: use float32, bfloat16 or float16")
    if device_type != 'cuda' and dtype != 'float32':
        fail(f"dtype={dtype!r} autocast is for CUDA only; on {device_type} use --dtype=float32")
    if fsdp and not ddp:
        fail("fsdp=True shards over processes: launch with torchrun (or drop --fsdp=True)")
    return device_type, dtype


def accumulation(steps, world_size):
    """Each process's share of `steps` micro-steps; refuses a count the processes do not divide."""
    if steps % world_size:
        fail(f"gradient_accumulation_steps={steps} is not divisible by the {world_size} processes: use a "
             f"multiple of {world_size}")
    return steps // world_size


def gpu_sized(n_embd, n_layer, vocab_size, ffn_hidden, tokens_per_iter):
    """The note for a GPU-sized run on a CPU (None for a CPU-sized one): it would take minutes or
    more per iteration."""
    ffn = ffn_hidden or 16 * math.ceil(8 * n_embd / 3 / 16)
    params = n_layer * (4 * n_embd * n_embd + 3 * n_embd * ffn) + 2 * (vocab_size or 50280) * n_embd
    if params <= 50e6 and tokens_per_iter <= 65536:
        return None
    return (f"note: this run is sized for a GPU (about {params / 1e6:.0f}M parameters, {tokens_per_iter:,} tokens "
            f"per iteration): on a CPU an iteration takes minutes or more. For a CPU use config/cpu_attnres.py or "
            f"config/cpu_preln.py (minutes in all), or a config/mini/ config")


def data(data_dir, block_size, vocab_size, named=True):
    """(meta.json of data_dir as a dict, {} when absent; the vocab_size: the given one, else
    meta.json's). Refuses a data_dir the user named (`named`) that does not exist, a meta.json
    that is not a JSON object with an integer vocab_size, a missing, empty or odd-sized train.bin
    or val.bin (for data/<dataset>: the line says how to prepare it), a val.bin shorter than
    block_size + 1 tokens, no vocab_size anywhere."""
    if named and not os.path.isdir(data_dir):
        fail(f"data_dir={data_dir!r} does not exist: prepare data there with "
             f"python data/fineweb_edu/prepare.py --input FILES --out_dir={data_dir}")
    meta_path, meta = os.path.join(data_dir, 'meta.json'), {}
    if os.path.exists(meta_path):
        try:
            with open(meta_path) as f:
                meta = json.load(f)
        except (ValueError, UnicodeDecodeError) as e:
            fail(f"{meta_path} is not valid JSON ({e}): prepare the data again, or remove the file and pass "
                 f"--vocab_size")
        if not isinstance(meta, dict) or not isinstance(meta.get('vocab_size', 0), int):
            fail(f"{meta_path} is not a JSON object with an integer vocab_size: prepare the data again")
    open_tokens(os.path.join(data_dir, 'train.bin'))  # missing, empty or odd-sized: one line (data.loader)
    val_path = os.path.join(data_dir, 'val.bin')
    if len(open_tokens(val_path)) < block_size + 1:
        fail(f"{val_path} holds fewer than block_size+1 = {block_size + 1} tokens: lower --block_size or prepare "
             f"more validation data")
    if vocab_size is None:
        if 'vocab_size' not in meta:  # guessing 50280 (GPT-2) for byte-level data would train a wrong model
            fail(f"{meta_path} {'has no vocab_size' if meta else 'not found'}: prepare the data with "
                 f"data/<dataset>/prepare.py (which writes it), or pass --vocab_size=N")
        vocab_size = meta['vocab_size']
    return meta, vocab_size


def model_args(cfg, keys):
    """GPTConfig fields (n_kv_head and ffn_hidden resolved) of the settings `cfg` for the model
    `keys`. Refuses an unknown residual scheme (naming the closest) and a shape GPTConfig refuses."""
    residual = cfg['residual']
    if residual not in RESIDUALS:
        close = difflib.get_close_matches(str(residual).lower(), RESIDUALS, n=2)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ''
        fail(f"unknown residual={residual!r}{hint}; known: {', '.join(RESIDUALS)}")
    try:
        return asdict(GPTConfig(**{k: cfg[k] for k in keys}))
    except (ValueError, TypeError) as e:
        fail(str(e))


def resumed_settings(ckpt, ckpt_path, keys, keys_set, run_keys, model_keys):
    """The settings a resume takes from its checkpoint `ckpt`: {key: value} for every key of `keys`
    that this command line (or a config file) does not set (`keys_set`) and that is not a key
    of the invocation (`run_keys`); the model keys from its model_args. Refuses model_args that
    make no model."""
    try:  # from_dict: a field older checkpoints lack takes the value they were trained with
        saved = {k: v for k, v in asdict(GPTConfig.from_dict(ckpt['model_args'])).items() if k in model_keys}
    except (ValueError, TypeError) as e:
        fail(f"{ckpt_path}: its model_args do not make a model ({e}); restore a good copy or start fresh in "
             f"another --out_dir")
    saved.update(ckpt.get('config') or {})
    return {k: saved[k] for k in keys if k not in keys_set and k not in run_keys and k in saved}


# settings a resumed run may change, though it then no longer continues the run exactly
SCHEDULE_KEYS = ('max_iters', 'learning_rate', 'tokens_per_param', 'warmup_iters', 'warmup_frac', 'min_lr_frac',
                 'weight_decay', 'decay_on', 'beta1', 'beta2', 'grad_clip', 'batch_size', 'gradient_accumulation_steps',
                 'seed', 'dataset')


def resume(ckpt, config, keys_set, effective, model_keys):
    """The notes of a resume: one per schedule setting of this command line that differs from the
    checkpoint's run. Refuses a model setting (`effective`: model_args of the settings, so a
    config file that sets a key to its default counts) other than the checkpoint's."""
    saved = ckpt['model_args']
    for k in model_keys:
        if k in saved and effective[k] != saved[k]:
            fail(f"{k}={effective[k]!r} differs from the checkpoint's {saved[k]!r}: a resumed run keeps "
                 f"the checkpoint's model; drop {k} from the command line (or config file), or start a new run "
                 f"in another --out_dir")
    notes = []
    for k in keys_set:  # allowed, but the run no longer continues exactly
        old = (ckpt.get('config') or {}).get(k, config[k])
        if k in SCHEDULE_KEYS and config[k] != old:
            notes.append(f"note: {k}={config[k]!r} differs from the checkpoint's run ({old!r}): "
                         f"the resumed run does not continue it exactly")
    return notes


def scratch(out_dir, ckpt_path):
    """Refuses a new run in an out_dir that holds one (never overwrite a run, or mix two runs' metrics)."""
    if os.path.exists(ckpt_path):
        fail(f"{out_dir} already holds a run ({ckpt_path}): continue or evaluate it with --init_from=resume, "
             f"or start anew in another --out_dir")


CHUNK = 2**26  # tokens read at once by token_ids (128 MB of uint16)


def token_ids(paths, vocab_size, meta, meta_path):
    """Refuses data the model cannot embed: a meta.json vocab_size above the model's, or a token id
    >= vocab_size in any of `paths` (both splits, whatever meta.json says: a file may hold other
    data than its meta.json; one pass, in chunks of CHUNK tokens). On a GPU such an id is a device
    assert mid-run; on a CPU an IndexError."""
    if vocab_size < meta.get('vocab_size', 0):
        fail(f"the model's vocab_size={vocab_size} is smaller than the data's ({meta['vocab_size']}, "
             f"{meta_path}): use the data the model was made for, or a vocab_size >= {meta['vocab_size']}")
    for path in paths:
        tokens = open_tokens(path)
        top = max(int(tokens[i:i + CHUNK].max()) for i in range(0, len(tokens), CHUNK))
        if top >= vocab_size:
            fail(f"{path} holds token id {top}, past the model's vocab_size={vocab_size}: "
                 f"use the data the model was made for, or a larger vocab_size")


def finished(iter_num, max_iters, out_dir):
    """Refuses a resume with nothing to train: its checkpoint past max_iters, or at max_iters with
    summary.json written (a run killed after its last checkpoint but before summary.json is
    completed by the resume)."""
    done = os.path.exists(os.path.join(out_dir, 'summary.json'))
    if iter_num > max_iters or (iter_num == max_iters and done):
        fail(f"the checkpoint is at iteration {iter_num}, max_iters={max_iters}: "
             + ("the run is finished" if iter_num == max_iters else "max_iters is behind it")
             + "; raise --max_iters to train on")


def weights(model, ckpt, ckpt_path):
    """Loads the checkpoint's weights into `model`; refuses weights of another scheme or shape than
    its model_args say."""
    try:
        model.load_state_dict(ckpt['model'])
    except RuntimeError as e:
        fail(f"the weights in {ckpt_path} do not fit its model_args (residual={ckpt['model_args']['residual']!r}, "
             f"n_layer={ckpt['model_args']['n_layer']}): {str(e).splitlines()[0][:200]}; restore a good copy")


def optimizer_state(optimizer, state, ckpt_path, fsdp_model=None):
    """Loads an optimizer state dict (a full one into `fsdp_model`'s shards under FSDP); refuses one
    that does not fit the model's parameters."""
    try:
        if fsdp_model is not None:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
            set_optimizer_state_dict(fsdp_model, optimizer, state, options=StateDictOptions(full_state_dict=True))
            return
        optimizer.load_state_dict(state)
    except (ValueError, KeyError, RuntimeError) as e:
        fail(f"the optimizer state in {ckpt_path} does not fit the model ({type(e).__name__}: "
             f"{str(e).splitlines()[0][:150]}): restore a good copy")


def fast_paths(ran, now):
    """The note for a resume whose fast paths (names, `now`) differ from those its checkpoint's run
    recorded (`ran`; None: not recorded): another rounding, allowed, but the resumed run does
    not continue bit-identically. None when they agree."""
    if ran is None or ran == now:
        return None
    return (f"note: the fast paths ({', '.join(now) or 'none'}) differ from the checkpoint's run's "
            f"({', '.join(ran) or 'none'}): the resumed run does not continue it bit-identically")
