"""
Pre-training of one DepthBench model (paper Sec. 2.3, Table 4; docs/training.md): a flat, commented script in the
spirit of nanoGPT. Every setting below is a module-level global; config files and
`--key=value` overrides replace them (configurator.py); `python train.py --help`
lists them all.

One GPU (or the CPU):
$ python train.py config/attnres_L32.py
Quick CPU run (about 8 minutes on 2 cores):
$ python train.py config/cpu_attnres.py
One node, 8 GPUs (DDP):
$ torchrun --standalone --nproc_per_node=8 train.py config/attnres_L32.py
Two nodes of 8 GPUs, on the first (master) node, IP 123.456.123.456:
$ torchrun --nproc_per_node=8 --nnodes=2 --node_rank=0 --master_addr=123.456.123.456 --master_port=1234 train.py config/attnres_L32.py
and on the worker node the same with --node_rank=1.
(If the nodes have no Infiniband interconnect, prepend NCCL_IB_DISABLE=1.)
Continue an interrupted run exactly where it stopped:
$ python train.py config/attnres_L32.py --init_from=resume

A resume takes the run's settings from its checkpoint, so the config file may be left out:
$ python train.py --out_dir=out/main/attnres_L32 --init_from=resume

Outputs in out_dir: ckpt.pt (latest checkpoint), ckpt_best.pt (lowest validation loss),
metrics.jsonl, summary.json, train.lock; checkpoint.py writes, seals and reads them, and
docs/training.md says what a run keeps and how it stops on a fault.
"""

import datetime
import difflib
import json
import math
import os
import sys
import time
import warnings
from collections import deque
from contextlib import nullcontext
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fast as fastpath
from checkpoint import (MetricsLog, best_state, catch_signals, fail, full_state, load_for_resume, lock_out_dir,
                        remove_stale_temp, save_checkpoint, write_json)
from configurator import ConfigError, comments_from_source, configure
from data.loader import TokenLoader, open_tokens, prepare_embedded_sample
from model import GPT, GPTConfig, estimate_mfu
from residuals import RESIDUALS

# -----------------------------------------------------------------------------
# default config values: a small Pre-LN model on FineWeb-Edu
# I/O
out_dir = 'out'  # checkpoint, metrics.jsonl and summary.json go here
eval_interval = 200  # evaluate on the held-out split (and checkpoint) every this many iterations
log_interval = 10  # console + metrics.jsonl line every this many iterations
eval_iters = 50  # batches per evaluation
eval_only = False  # evaluate once and exit
init_from = 'scratch'  # 'scratch' or 'resume' (from out_dir/ckpt.pt)
stop_iter = None  # stop (with a checkpoint) after this iteration without changing the schedule
# data
dataset = 'fineweb_edu'  # reads data/<dataset>/train.bin, val.bin, meta.json
data_dir = None  # a directory with train.bin/val.bin/meta.json to use instead of data/<dataset>
gradient_accumulation_steps = 8  # micro-steps per optimizer step, over all processes
batch_size = 8  # micro-batch size (sequences) per process
auto_batch = False  # pick the largest micro-batch that fits (plan.memory.train_memory) and raise gradient_accumulation_steps to keep the global batch
memory_gib = None  # the memory the plan is held against and auto_batch fills (90% of it); None = a GPU's total memory, the CPU's free RAM
block_size = 1024  # sequence length T
# model (paper Sec. 2.2, Table 1)
residual = 'preln'  # residual scheme, one of residuals.RESIDUALS
n_layer = 12  # L blocks
n_head = 16  # query heads
n_kv_head = None  # key/value heads (GQA); None = n_head
n_embd = 768  # d
ffn_hidden = None  # SwiGLU width; None = 16 * ceil(8d/3 / 16)
vocab_size = None  # None = from data/<dataset>/meta.json (50280 for GPT-2 BPE)
hc_streams = 4  # HC/mHC streams m
hc_out_init_scale = True  # HC/mHC: divide attn-out and MLP-down init by sqrt(m) (the study's)
hc_readout = 'auto'  # HC/mHC final norm: 'auto' (the study's: HC 'norm_sum', mHC 'mean'), 'norm_sum', 'sum', 'mean'
mhc_sinkhorn_iters = 20  # mHC Sinkhorn-Knopp iterations
mhc_sinkhorn = 'liger'  # mHC Sinkhorn: 'liger' (the study's default backend, 1e-6 eps), 'plain' (its PyTorch backend)
mhc_init = 'gap8'  # mHC init: 'gap8' (the study's newest, b_res 0/-8), 'gap8_diag8' (its earlier +8/-8), 'uniform'
attnres_blocks = 8  # Block AttnRes: number of blocks
attnres_eps = 1e-5  # AttnRes/Block AttnRes: eps of key norms, read norms and final norm (the study's)
# adamw optimizer (paper Sec. 2.3, Table 4)
learning_rate = None  # peak LR; None = the scheme's (2e-3; DeepNorm 1e-3; LNS 1e-2)
max_iters = None  # optimizer steps; None = tokens_per_param x parameters / tokens per step
tokens_per_param = 20.0  # token budget when max_iters is None
weight_decay = 0.1
decay_on = 'all'  # 'all' (the study's: every parameter but HC/mHC static routing) or 'matrices' (nanoGPT's)
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0  # clip the global gradient norm at this value; 0 disables
# learning rate schedule: linear warmup, then cosine to min_lr_frac x peak
warmup_iters = None  # None = warmup_frac x max_iters
warmup_frac = 0.1
min_lr_frac = 0.1
# system
device = 'cuda' if torch.cuda.is_available() else 'cpu'  # 'cpu', 'cuda', 'cuda:1', 'mps'; default: cuda if present
dtype = None  # None = bfloat16 autocast on CUDA, float32 elsewhere; 'float32', or 'bfloat16'/'float16' (CUDA only)
compile = None  # torch.compile each block's branches and the scheme's regions; None = on for CUDA, off elsewhere
fast = 'auto'  # fast paths (fast/): 'auto' = on for CUDA, off on the CPU; True; False = only residuals.py's plain code
fsdp = False  # shard parameters with FSDP2 (fully_shard) instead of DDP under torchrun
backend = None  # torch.distributed backend; None = nccl on CUDA, gloo on CPU
dist_timeout = 600  # seconds a process waits for its peers in a collective before the job fails
seed = 1337
# logging to Weights & Biases (rank 0 only; needs `pip install wandb`; WANDB_MODE=offline logs locally)
wandb_log = False  # also log every metrics.jsonl row, with the per-block arrays, to W&B
wandb_project = 'depthbench'  # W&B project
wandb_run_name = None  # W&B run name; None = the last component of out_dir
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str, type(None)))]
# the types of the keys whose default is None (the others keep their default's type)
none_default_types = {'stop_iter': int, 'max_iters': int, 'warmup_iters': int, 'n_kv_head': int, 'ffn_hidden': int,
                      'vocab_size': int, 'memory_gib': float, 'learning_rate': float, 'data_dir': str, 'dtype': str,
                      'compile': bool, 'backend': str, 'wandb_run_name': str, 'fast': (str, bool)}
try:
    keys_set = configure(globals(), config_keys, sys.argv[1:], help_text=comments_from_source(__file__),
                         none_types=none_default_types)
except ConfigError as e:
    sys.exit(f"error: {e}")
training = False  # whether the training loop has started: a signal then names the iteration a resume starts from
# Ctrl-C or SIGTERM at any moment: one line naming where a resume starts (checkpoint.py)
catch_signals(out_dir, init_from, eval_only, lambda: iter_num if training else None, int(os.environ.get('RANK', 0)) == 0)
# keys that belong to this invocation, not to the run: a resume never takes them from the checkpoint
RUN_CONTROL_KEYS = ('out_dir', 'init_from', 'eval_only', 'stop_iter', 'device', 'compile', 'backend', 'fsdp',
                    'dist_timeout')
# the model's settings (GPTConfig fields): a resumed run keeps the checkpoint's
MODEL_KEYS = ('vocab_size', 'block_size', 'n_layer', 'n_head', 'n_kv_head', 'n_embd', 'ffn_hidden', 'residual',
              'hc_streams', 'hc_out_init_scale', 'hc_readout', 'mhc_sinkhorn_iters', 'mhc_sinkhorn', 'mhc_init',
              'attnres_blocks', 'attnres_eps')
ckpt_path = os.path.join(out_dir, 'ckpt.pt')
if int(os.environ.get('RANK', 0)) == 0 and not eval_only:  # rank 0 writes out_dir; it alone holds the lock
    _out_lock = lock_out_dir(out_dir)
    remove_stale_temp(out_dir, locked=_out_lock is not None)  # a killed run's partial files
checkpoint = load_for_resume(out_dir) if init_from == 'resume' else None  # verified, whole
if checkpoint is not None:
    # the run's own settings, except those this command line (or a config file) sets: a resume
    # continues the run in out_dir whatever defaults the script has now
    try:  # from_dict: a field older checkpoints lack takes the value they were trained with
        _saved = {k: v for k, v in asdict(GPTConfig.from_dict(checkpoint['model_args'])).items() if k in MODEL_KEYS}
    except (ValueError, TypeError) as e:
        fail(f"{ckpt_path}: its model_args do not make a model ({e}); restore a good copy or start fresh in "
             f"another --out_dir")
    _saved.update(checkpoint.get('config') or {})
    for _k in config_keys:
        if _k not in keys_set and _k not in RUN_CONTROL_KEYS and _k in _saved:
            globals()[_k] = _saved[_k]
config = {k: globals()[k] for k in config_keys}  # saved in checkpoints and summary.json


# the ranges the script relies on: a bad value is one line here, not a traceback (or an
# endless run) later. None keeps its documented meaning.
RANGES = {  # key -> (lowest allowed value, whether the lowest value itself is allowed)
    'eval_interval': (1, True), 'log_interval': (1, True), 'eval_iters': (1, True),
    'gradient_accumulation_steps': (1, True), 'batch_size': (1, True), 'block_size': (1, True),
    'max_iters': (1, True), 'stop_iter': (1, True), 'warmup_iters': (0, True),
    'learning_rate': (0, False), 'tokens_per_param': (0, False), 'weight_decay': (0, True),
    'grad_clip': (0, True), 'warmup_frac': (0, True), 'min_lr_frac': (0, True), 'attnres_eps': (0, False),
    'dist_timeout': (0, False),
}
for _key, (_low, _inclusive) in RANGES.items():
    _v = globals()[_key]
    if _v is not None and (_v < _low or (_v == _low and not _inclusive)):
        fail(f"{_key}={_v:g} must be {'>=' if _inclusive else '>'} {_low}")
try:  # the fast setting's value, before any data is prepared or model built
    fastpath.resolve(fast, 'cpu')
except ValueError as e:
    fail(str(e))
if decay_on not in ('all', 'matrices'):
    fail(f"decay_on={decay_on!r}: use 'all' (the study's weight-decay groups) or 'matrices' (nanoGPT's)")
for _key in ('warmup_frac', 'min_lr_frac'):
    if globals()[_key] > 1:
        fail(f"{_key}={globals()[_key]} is a fraction: give a value in [0, 1]")


# -----------------------------------------------------------------------------
# distributed set-up and devices

ddp = int(os.environ.get('RANK', -1)) != -1  # launched by torchrun?
if ddp:
    rank, local_rank, world_size = int(os.environ['RANK']), int(os.environ['LOCAL_RANK']), int(os.environ['WORLD_SIZE'])
    if device.startswith('cuda'):
        device = f'cuda:{local_rank}'
        torch.cuda.set_device(device)
    # a frozen or dead peer fails the job after dist_timeout s instead of the default 30 minutes
    dist.init_process_group(backend=backend or ('nccl' if device.startswith('cuda') else 'gloo'),
                            timeout=datetime.timedelta(seconds=dist_timeout))
    master = rank == 0
    if gradient_accumulation_steps % world_size:
        fail(f"gradient_accumulation_steps={gradient_accumulation_steps} is not divisible by the "
             f"{world_size} processes: use a multiple of {world_size}")
    gradient_accumulation_steps //= world_size
else:
    rank, local_rank, world_size, master = 0, 0, 1, True
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
if compile is None:
    compile = device_type == 'cuda'
if fsdp and not ddp:
    fail("fsdp=True shards over processes: launch with torchrun (or drop --fsdp=True)")


def print0(*args, sep=' ', end='\n'):
    """print() on the master process, as one write: a Ctrl-C or SIGTERM line (checkpoint.on_signal)
    never lands between a line and its newline."""
    if master:
        sys.stdout.write(sep.join(map(str, args)) + end)
        sys.stdout.flush()


def out_of_memory(exc):
    """(the out-of-memory error in exc or in its chain of causes, whether compilation raised it):
    torch.compile wraps what its backend raises (BackendCompilerFailed.inner_exception); (None,
    False) for another error."""
    compiling, seen = False, set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        compiling = compiling or type(exc).__module__.startswith(('torch._dynamo', 'torch._inductor'))
        if isinstance(exc, torch.OutOfMemoryError) or (isinstance(exc, RuntimeError)
                                                        and 'out of memory' in str(exc).lower()):
            return exc, compiling
        exc = getattr(exc, 'inner_exception', None) or exc.__cause__ or exc.__context__
    return None, False


def oom_hook(kind, value, tb, default=sys.excepthook):
    """An out-of-memory error at any point (building, planning, compiling, training, evaluating):
    one line naming the config, the micro-batch and the fix, on every rank that ran out."""
    oom, compiling = out_of_memory(value)
    if oom is None:
        return default(kind, value, tb)
    from plan import memory as memory_plan
    from types import SimpleNamespace
    shape = SimpleNamespace(residual=residual, n_layer=n_layer, n_embd=n_embd)  # the run's (a resume: the checkpoint's)
    config_file = next((a for a in sys.argv[1:] if not a.startswith('--')), None)
    msg = memory_plan.oom_message(shape, batch_size, block_size, gradient_accumulation_steps * world_size,
                                  'compiling' if compiling else None, config_file)
    print(f"error: {msg}", file=sys.stderr, flush=True)


sys.excepthook = oom_hook

if device_type == 'cpu':  # say so up front: a GPU-sized model takes minutes to build here, and more to evaluate
    _d, _L, _V = n_embd, n_layer, vocab_size or 50280
    _ffn = ffn_hidden or 16 * math.ceil(8 * _d / 3 / 16)
    _approx_params = _L * (4 * _d * _d + 3 * _d * _ffn) + 2 * _V * _d  # attention + SwiGLU + embedding/head
    _tokens = gradient_accumulation_steps * world_size * batch_size * block_size
    if _approx_params > 50e6 or _tokens > 65536:
        print0(f"note: this run is sized for a GPU (about {_approx_params / 1e6:.0f}M parameters, {_tokens:,} tokens "
               f"per iteration): on a CPU an iteration takes minutes or more. For a CPU use config/cpu_attnres.py or "
               f"config/cpu_preln.py (minutes in all), or a config/mini/ config")


torch.manual_seed(seed)  # the same initial weights on every rank
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
autocast = nullcontext() if dtype == 'float32' else torch.autocast(device_type=device_type, dtype=ptdtype)

# -----------------------------------------------------------------------------
# data: uint16 token files of data/<dataset>/prepare.py


if data_dir is None:
    data_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', dataset)
    # the default data of a fresh clone: prepared from the embedded sample when absent (only
    # for data/fineweb_edu[_<tokenizer>]; a data_dir the user names must exist)
    from data.tokenizer import TOKENIZERS
    _sample_tok = 'gpt2' if dataset == 'fineweb_edu' else dataset.removeprefix('fineweb_edu_')
    if _sample_tok in TOKENIZERS and not all(os.path.exists(os.path.join(data_dir, f)) for f in ('train.bin', 'val.bin')):
        if master:
            prepare_embedded_sample(data_dir, _sample_tok, say=print0)
        if ddp:
            dist.barrier()  # the other ranks wait until rank 0 has written the files
elif not os.path.isdir(data_dir):
    fail(f"data_dir={data_dir!r} does not exist: prepare data there with "
         f"python data/fineweb_edu/prepare.py --input FILES --out_dir={data_dir}")
meta_path = os.path.join(data_dir, 'meta.json')
meta = {}
if os.path.exists(meta_path):
    try:
        with open(meta_path) as _f:
            meta = json.load(_f)
    except (ValueError, UnicodeDecodeError) as e:
        fail(f"{meta_path} is not valid JSON ({e}): prepare the data again, or remove the file and pass --vocab_size")
    if not isinstance(meta, dict) or not isinstance(meta.get('vocab_size', 0), int):
        fail(f"{meta_path} is not a JSON object with an integer vocab_size: prepare the data again")
train_path = os.path.join(data_dir, 'train.bin')
train_loader = TokenLoader(train_path, batch_size, block_size, rank, world_size, seed, device=device)
val_path = os.path.join(data_dir, 'val.bin')
if len(open_tokens(val_path)) < block_size + 1:
    fail(f"{val_path} holds fewer than block_size+1 = {block_size + 1} tokens: lower --block_size or prepare more validation data")
if vocab_size is None:
    if 'vocab_size' not in meta:  # guessing 50280 (GPT-2) for byte-level data would train a wrong model
        fail(f"{meta_path} {'has no vocab_size' if meta else 'not found'}: prepare the data with "
             f"data/<dataset>/prepare.py (which writes it), or pass --vocab_size=N")
    vocab_size = meta['vocab_size']

# -----------------------------------------------------------------------------
# model, optimizer, resume

def model_args_of_config():
    """GPTConfig fields (resolved: n_kv_head, ffn_hidden) of the current settings; one line if invalid."""
    if residual not in RESIDUALS:
        close = difflib.get_close_matches(str(residual).lower(), RESIDUALS, n=2)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ''
        fail(f"unknown residual={residual!r}{hint}; known: {', '.join(RESIDUALS)}")
    try:
        return asdict(GPTConfig(**{k: globals()[k] for k in MODEL_KEYS}))
    except (ValueError, TypeError) as e:
        fail(str(e))


# settings a resumed run may change, though it then no longer continues the run exactly
SCHEDULE_KEYS = ('max_iters', 'learning_rate', 'tokens_per_param', 'warmup_iters', 'warmup_frac', 'min_lr_frac',
                 'weight_decay', 'decay_on', 'beta1', 'beta2', 'grad_clip', 'batch_size', 'gradient_accumulation_steps',
                 'seed', 'dataset')
if init_from == 'resume':
    model_args = checkpoint['model_args']
    _effective = model_args_of_config()  # every model key, also one set to its default by a config file
    for k in MODEL_KEYS:
        if k in model_args and _effective[k] != model_args[k]:
            fail(f"{k}={_effective[k]!r} differs from the checkpoint's {model_args[k]!r}: a resumed run keeps "
                 f"the checkpoint's model; drop {k} from the command line (or config file), or start a new run "
                 f"in another --out_dir")
    for k in keys_set:  # allowed, but the run no longer continues exactly
        old = (checkpoint.get('config') or {}).get(k, config[k])
        if k in SCHEDULE_KEYS and config[k] != old:
            print0(f"note: {k}={config[k]!r} differs from the checkpoint's run ({old!r}): "
                   f"the resumed run does not continue it exactly")
elif init_from == 'scratch':
    model_args = model_args_of_config()  # bad settings first: a resume would not mend them
    if os.path.exists(ckpt_path):  # never overwrite a run, or mix two runs' metrics.jsonl
        fail(f"{out_dir} already holds a run ({ckpt_path}): continue or evaluate it with --init_from=resume, "
             f"or start anew in another --out_dir")
else:
    fail(f"init_from={init_from!r}: use 'scratch' or 'resume'")
if model_args['vocab_size'] < meta.get('vocab_size', 0):  # token ids past the embedding: an IndexError mid-run
    fail(f"the model's vocab_size={model_args['vocab_size']} is smaller than the data's ({meta['vocab_size']}, "
         f"{meta_path}): use the data the model was made for, or a vocab_size >= {meta['vocab_size']}")
# token ids past the embedding: an IndexError mid-run (a device assert on a GPU). Both splits,
# whatever meta.json says (a file may hold other data than its meta.json): one pass, in chunks
for _path in (val_path, train_path):
    _data = open_tokens(_path)
    _max_id = max(int(_data[i:i + 2**26].max()) for i in range(0, len(_data), 2**26))
    if _max_id >= model_args['vocab_size']:
        fail(f"{_path} holds token id {_max_id}, past the model's vocab_size={model_args['vocab_size']}: "
             f"use the data the model was made for, or a larger vocab_size")
try:
    model = GPT(GPTConfig.from_dict(model_args))  # from_dict: older checkpoints keep their readout
except ValueError as e:
    fail(str(e))
if checkpoint is not None:
    try:
        model.load_state_dict(checkpoint['model'])
    except RuntimeError as e:  # weights of another scheme or shape than model_args says
        fail(f"the weights in {ckpt_path} do not fit its model_args (residual={model_args['residual']!r}, "
             f"n_layer={model_args['n_layer']}): {str(e).splitlines()[0][:200]}; restore a good copy")
model.to(device)
raw_model = model  # the unwrapped module: what checkpoints and probes see
n_params = model.num_params()
try:  # the fast paths that apply (fast/), each checked against residuals.py on a tiny twin first
    fast_paths = fastpath.setup(raw_model, fast, device, dtype=ptdtype)
except (ValueError, fastpath.FastPathMismatch) as e:
    fail(str(e))
print0(fastpath.describe(fast_paths))
_ran = checkpoint.get('fast_paths') if checkpoint is not None else None  # None: not recorded
if _ran is not None and _ran != [p.name for p in fast_paths]:  # another rounding: allowed, but said
    print0(f"note: the fast paths ({', '.join(p.name for p in fast_paths) or 'none'}) differ from the checkpoint's "
           f"run's ({', '.join(_ran) or 'none'}): the resumed run does not continue it bit-identically")

if auto_batch and fsdp:
    fail("auto_batch=True plans an unsharded model: drop --fsdp=True, or set --batch_size yourself")
if not fsdp and not eval_only:  # the predicted peak memory held against the device's, and the micro-batch that fits
    from plan import memory as memory_plan
    device_bytes, _what = (memory_gib * 2**30, f"--memory_gib={memory_gib:g}") if memory_gib else \
        memory_plan.device_memory(device, raw_model)
    if auto_batch and device_bytes is None:
        fail(f"auto_batch=True needs the device's memory, which {device_type} does not report: give --memory_gib=...")
    _t = time.time()  # the model as it will run: its fast paths, and (compile on CUDA) inductor's partition of the
    # regions; on the CPU the eager plan, which keeps more than the compiled model, and is faster to probe
    mem = memory_plan.train_memory(raw_model.config, batch_size, block_size, device, dtype, model=raw_model,
                                   fast=fast_paths, compiled=compile and device_type == 'cuda')
    print0(memory_plan.format_memory(mem, device_bytes, _what) + f" [probed in {time.time() - _t:.0f} s]")
    if auto_batch:
        try:
            batch_size, gradient_accumulation_steps = memory_plan.auto_micro_batch(
                batch_size * gradient_accumulation_steps, mem['predict'], memory_plan.AUTO_BATCH_FILL * device_bytes)
        except ValueError as e:
            fail(str(e))
        train_loader.B = batch_size
        print0(f"auto_batch: micro-batch {batch_size}, gradient_accumulation_steps {gradient_accumulation_steps}")
    elif device_bytes is not None:  # stop now, not mid-step (on the CPU: under the kernel's OOM killer, silently)
        _msg = memory_plan.fit_message(mem, batch_size, block_size, gradient_accumulation_steps, device_bytes, _what,
                                       memory_plan.RUN_FILL.get(device_type, memory_plan.AUTO_BATCH_FILL), world_size)
        if _msg:
            fail(_msg)


if learning_rate is None:
    learning_rate = RESIDUALS[model.config.residual].peak_lr
tokens_per_iter = gradient_accumulation_steps * world_size * batch_size * block_size
if max_iters is None:
    max_iters = max(1, math.ceil(tokens_per_param * n_params / tokens_per_iter))
if warmup_iters is None:
    warmup_iters = int(warmup_frac * max_iters)
print0(f"model: {model.config.residual}, L={model.config.n_layer}, d={model.config.n_embd}, "
       f"{n_params:,} parameters ({model.num_params(non_embedding=True):,} without the embedding)")
for _line in raw_model.residual.notes():  # a setting that makes the scheme another (Block AttnRes in blocks of 1)
    print0(f"note: {_line}")
print0(f"tokens per iteration: {gradient_accumulation_steps} accum x {world_size} procs x {batch_size} seqs x "
       f"{block_size} tokens = {tokens_per_iter:,}; {max_iters:,} iterations = {max_iters * tokens_per_iter:,} tokens "
       f"({max_iters * tokens_per_iter / n_params:.3g} per parameter)")
print0(f"peak lr {learning_rate:g}, warmup {warmup_iters} iters, cosine to {min_lr_frac:g} x peak; "
       f"device {device}, dtype {dtype}, compile {compile}")

if fsdp:  # shard before the optimizer is built: FSDP2 replaces the parameters by DTensors
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    # F.linear returns a view for (B, T, d) inputs; FSDP2 warns in case the caller edits it in
    # place. No scheme does (residual updates are out of place: x = x + f), so the warning is noise.
    warnings.filterwarnings('ignore', message='FSDP2-wrapped module')
    mp = MixedPrecisionPolicy(param_dtype=ptdtype, reduce_dtype=torch.float32)
    # one unit per branch, so that each weight is gathered once per forward and once per backward.
    # The schemes call the branches, not Block.forward, and MoDA calls attn.qkv and attn.out apart
    # (its depth keys sit between them): the attention's unit is its four projections as one group,
    # gathered when the first runs and freed when all four have, however the scheme calls them.
    for blk in raw_model.blocks:
        a = blk.attn
        fully_shard([a.wq, a.wk, a.wv, a.wo], mp_policy=mp)
        fully_shard(blk.mlp, mp_policy=mp)
    fully_shard(raw_model, mp_policy=mp)
    autocast = nullcontext()  # FSDP2 casts the parameters itself
optimizer = raw_model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), 1e-8, device_type, decay_on)
# fp16 gradients underflow without loss scaling; for bf16 and fp32 the scaler is a no-op
scaler = torch.amp.GradScaler(device_type, enabled=dtype == 'float16')
iter_num, best_val_loss, best_iter = 0, float('inf'), None  # best_iter: the iteration of ckpt_best.pt's state
tokens_trained = 0  # summed step by step: a resume may change the batch
if checkpoint is not None:
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        set_optimizer_state_dict(raw_model, optimizer, checkpoint['optimizer'],
                                 options=StateDictOptions(full_state_dict=True))
    else:
        try:
            optimizer.load_state_dict(checkpoint['optimizer'])
        except (ValueError, KeyError, RuntimeError) as e:
            fail(f"the optimizer state in {ckpt_path} does not fit the model ({type(e).__name__}: "
                 f"{str(e).splitlines()[0][:150]}): restore a good copy")
    iter_num, best_val_loss = checkpoint['iter_num'], checkpoint.get('best_val_loss', float('inf'))
    tokens_trained = checkpoint.get('tokens', iter_num * tokens_per_iter)  # older checkpoints: at today's batch
    best_iter = checkpoint.get('best_iter')
    if checkpoint.get('scaler'):
        scaler.load_state_dict(checkpoint['scaler'])
    train_loader.load_state_dict(checkpoint['loader'])
    torch.set_rng_state(checkpoint['rng']['torch'])
    if device_type == 'cuda' and 'cuda' in checkpoint['rng']:
        torch.cuda.set_rng_state(checkpoint['rng']['cuda'])
    print0(f"resumed from {ckpt_path} at iteration {iter_num}")
    # a run killed after its final checkpoint but before summary.json: the resume writes it
    _finished = os.path.exists(os.path.join(out_dir, 'summary.json'))
    if (iter_num > max_iters or (iter_num == max_iters and _finished)) and not eval_only:
        fail(f"the checkpoint is at iteration {iter_num}, max_iters={max_iters}: "
             + ("the run is finished" if iter_num == max_iters else "max_iters is behind it")
             + "; raise --max_iters to train on")
    evaluated = checkpoint.get('evaluated', True)
    resumed_losses = checkpoint.get('val_loss'), checkpoint.get('train_loss')
    checkpoint = None  # free memory
# no second evaluation of a state the checkpoint's run already evaluated
resumed_at = iter_num if init_from == 'resume' and evaluated else None

if compile:
    print0("compiling each block's branches and the scheme's regions on first use (seconds to a minute)...")
    raw_model.compile_regions()
if ddp and not fsdp:
    model = DDP(model, device_ids=[local_rank] if device_type == 'cuda' else None)

# -----------------------------------------------------------------------------
# helpers


def get_lr(it):
    """Linear warmup over warmup_iters, then cosine decay to min_lr_frac x peak at max_iters (paper Sec. 2.3)."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    progress = min(1.0, (it - warmup_iters) / max(1, max_iters - warmup_iters))
    return learning_rate * (min_lr_frac + (1 - min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def eval_batches():
    """(B, n, chunks): evaluation scores n batches of B chunks of block_size+1 tokens from the
    start of val.bin, which holds `chunks`: B = batch_size and n = eval_iters, or, when val.bin
    holds fewer chunks than that (the embedded sample's split: 12 of 2,049 tokens), as many
    whole batches of min(batch_size, chunks) as it holds."""
    chunks = len(open_tokens(val_path)) // (block_size + 1)
    B = min(batch_size, chunks)
    return B, min(eval_iters, chunks // B), chunks


_eval_said = []  # the line about a small validation split is said once


@torch.no_grad()
def estimate_val_loss(progress=False):
    """Mean next-token cross-entropy (nats) over the first eval_iters x batch_size chunks
    of val.bin (the same chunks every time, whatever the number of processes; all of them, in
    smaller batches if need be, if val.bin is smaller: `eval_batches`, said in one line).
    Batch k (chunks [k B, (k+1) B)) is scored by rank k mod world.
    progress: a progress bar on rank 0 if the evaluation takes more than 2 s and stderr is a
    terminal (a log file gets the result lines only)."""
    from tqdm import tqdm
    B, n, chunks = eval_batches()
    if chunks < eval_iters * batch_size and not _eval_said:
        _eval_said.append(True)
        print0(f"evaluation: {val_path} holds {chunks:,} sequences of {block_size + 1:,} tokens, fewer than "
               f"eval_iters x batch_size = {eval_iters} x {batch_size}: each evaluation scores {n} batch"
               f"{'es' if n > 1 else ''} of {B} ({B * n * block_size:,} tokens); a real run prepares FineWeb-Edu "
               f"first (docs/training.md)")
    model.eval()
    loader = TokenLoader(val_path, B, block_size, shuffle=False, device=device)  # one stream: step k = batch k
    total = torch.zeros(2, device=device)
    # every rank runs as many forwards (FSDP gathers in each); disable=None: a bar on a terminal only
    for i in tqdm(range(math.ceil(n / world_size)), desc='evaluating', unit='batch', leave=False, delay=2,
                  disable=None if progress and master else True):
        k = i * world_size + rank
        loader.pos = (k if k < n else 0) * B  # past the end: a forward that counts for nothing
        x, y = loader.next_batch()
        with autocast:
            _, loss = model(x, y)
        weight = float(k < n)
        total += torch.stack([loss.float() * y.numel() * weight, torch.tensor(y.numel() * weight, device=device)])
    if ddp:
        dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def save(path, evaluated=True, best=False):
    """Everything needed to continue exactly: weights (of the uncompiled module, so no
    `_orig_mod.` prefixes), optimizer, model and run config, iteration, data-loader
    position and RNG states, whether the state at this iteration has been evaluated
    (a resume then skips that evaluation) and its losses; written sealed and atomically by
    checkpoint.save_checkpoint (best: also as ckpt_best.pt)."""
    model_state, opt_state = full_state(raw_model, optimizer, fsdp)  # collective under FSDP
    if not master:
        return
    rng = {'torch': torch.get_rng_state()}
    if device_type == 'cuda':
        rng['cuda'] = torch.cuda.get_rng_state()
    save_checkpoint(path, {
        'model': model_state, 'optimizer': opt_state, 'model_args': asdict(raw_model.config), 'config': config,
        'iter_num': iter_num, 'tokens': tokens_trained, 'best_val_loss': best_val_loss, 'best_iter': best_iter,
        'loader': train_loader.state_dict(), 'rng': rng, 'scaler': scaler.state_dict(), 'evaluated': evaluated,
        'val_loss': val_loss, 'train_loss': lossf, 'fast_paths': [p.name for p in fast_paths],
        'tokenizer': meta.get('tokenizer')}, best=best)  # sample.py decodes with it (None: data without meta.json)


def block_stats(x):
    """Per-block depth health (practitioners' signals beside the paper's Sec. 4 diagnostics): the gradient norm of each
    block's parameters (branches + the scheme's block parameters) and the RMS of each
    block's probe state on micro-batch x."""
    if fsdp:  # sharded gradients: a global view would need collectives; skip
        return {}
    grads = []
    for b in range(raw_model.config.n_layer):
        params = list(raw_model.blocks[b].parameters())
        if hasattr(raw_model.residual, 'layers'):
            params += list(raw_model.residual.layers[b].parameters())
        g = [p.grad.float().norm() for p in params if p.grad is not None]
        grads.append(torch.stack(g).norm().item() if g else 0.0)
    record = []
    with torch.no_grad(), autocast:
        raw_model.hidden(x[:2], record=record)
    rms = [z.float().pow(2).mean().sqrt().item() for z, _ in record[1:]]
    return {'block_grad_norm': grads, 'block_act_rms': rms}


# metrics.jsonl: a resume drops the rows it repeats; a new run moves an older run's aside
metrics_log = MetricsLog(out_dir, init_from, iter_num) if master and not eval_only else None
wandb_run = None
if wandb_log and master and not eval_only:
    try:
        import wandb
    except ImportError:
        fail("wandb_log=True needs the wandb package: pip install wandb (or drop --wandb_log=True)")
    wandb_run = wandb.init(project=wandb_project, name=wandb_run_name or os.path.basename(os.path.abspath(out_dir)),
                           config=config, dir=out_dir)


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


def log_metrics(row):
    """One row to metrics.jsonl (and W&B), from rank 0."""
    if metrics_log is not None:
        metrics_log.write(row)
    if wandb_run is not None:
        wandb_run.log(wandb_row(row), step=row['iter'])


# -----------------------------------------------------------------------------
# training loop

def shutdown():
    """Under torchrun: every rank waits (rank 0 may still be writing) before the process
    group is torn down; a rank tearing down early can abort its peers."""
    if ddp:
        dist.barrier()
        dist.destroy_process_group()


if eval_only:
    print0(f"val loss {estimate_val_loss():.4f}" + (" (untrained weights: init_from='scratch')"
                                                    if init_from == 'scratch' else ''))
    shutdown()
    sys.exit(0)


def stop_nonfinite(what):
    """A non-finite loss or gradient: keep the state for a diagnosis in ckpt_nonfinite.pt,
    never in ckpt.pt (the last good checkpoint stays), and stop with one line."""
    save(os.path.join(out_dir, 'ckpt_nonfinite.pt'))
    fail(f"{what} at iteration {iter_num}; state saved to {out_dir}/ckpt_nonfinite.pt. Lower --learning_rate "
         f"(now {learning_rate:g}) and "
         + (f"resume from the last good {ckpt_path} with --init_from=resume" if os.path.exists(ckpt_path)
            else "start again (no checkpoint was written before this)"))


SPIKE_RATIO = 1.5  # warn when the validation loss exceeds this x its best so far (a divergence)


training = True  # a signal from here on names the iteration a resume starts from
model.train()
t0 = time.time()
val_loss = lossf = None
if init_from == 'resume':
    val_loss, lossf = resumed_losses
recent_dt = deque(maxlen=20)  # seconds of the last iterations: the ETA is their mean (one step alone jumps)
first_iter, n_evals = iter_num, 0
while True:
    lr = get_lr(iter_num)
    for group in optimizer.param_groups:
        group['lr'] = lr

    # evaluate and checkpoint (state *before* iteration iter_num; a resume starts here)
    if (iter_num % eval_interval == 0 or iter_num == max_iters) and iter_num != resumed_at:
        val_loss = estimate_val_loss(progress=n_evals == 0)  # the first one may be slow: show its progress
        n_evals += 1
        print0(f"iter {iter_num}: val loss {val_loss:.4f}")
        if not math.isfinite(val_loss):  # non-finite weights: never over the last good checkpoint
            stop_nonfinite(f"non-finite validation loss {val_loss}")
        is_best = val_loss < best_val_loss
        if is_best:
            best_val_loss, best_iter = val_loss, iter_num
        log_metrics({'iter': iter_num, 'tokens': tokens_trained, 'val_loss': val_loss, 'lr': lr})
        if iter_num > 0:
            save(ckpt_path, best=is_best)
        elif is_best:  # the initial state: kept as ckpt_best.pt only (a run that gets worse keeps it)
            save(os.path.join(out_dir, 'ckpt_best.pt'))
        if val_loss > SPIKE_RATIO * best_val_loss:
            print0(f"warning: val loss {val_loss:.4f} is {val_loss / best_val_loss:.1f}x its best "
                   f"({best_val_loss:.4f}): the run may be diverging; {best_state(out_dir, best_iter)[1]}")
        t0 = time.time()  # evaluation time is not training time
    if iter_num == max_iters:
        break

    # forward, backward, update, with gradient accumulation
    loss_sum = torch.zeros((), device=device)
    for micro_step in range(gradient_accumulation_steps):
        x, y = train_loader.next_batch()
        if ddp and not fsdp:  # all-reduce the gradients only on the last micro-step
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        with autocast:
            _, loss = model(x, y)
            loss = loss / gradient_accumulation_steps
        scaler.scale(loss).backward()
        loss_sum += loss.detach()
    scaler.unscale_(optimizer)  # clip the true gradients
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float('inf'))
    if hasattr(grad_norm, 'full_tensor'):  # a DTensor under FSDP
        grad_norm = grad_norm.full_tensor()
    if ddp:
        dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
    # checked before the update (one CPU-GPU sync per optimizer step): a NaN/Inf gradient
    # with a finite loss would otherwise write NaN weights. Under fp16 the scaler skips
    # such a step itself (an overflow), so only the loss is checked there.
    lossf, gnorm = torch.stack([loss_sum.float(), grad_norm.float()]).tolist()
    if not math.isfinite(lossf):
        stop_nonfinite(f"non-finite training loss {lossf}")
    if not math.isfinite(gnorm) and dtype != 'float16':
        stop_nonfinite(f"non-finite gradient norm {gnorm} (training loss {lossf:.4f}); the update was not applied")
    log_step = (iter_num + 1) % log_interval == 0 or iter_num + 1 == max_iters
    stats = block_stats(x) if log_step and master else {}
    scaler.step(optimizer)  # skipped by the fp16 scaler if a gradient overflowed
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    iter_num += 1
    tokens_trained += tokens_per_iter
    t1 = time.time()
    dt, t0 = t1 - t0, t1
    if iter_num > first_iter + 1 or max_iters - first_iter == 1:  # the first step (warm-up, compile) is no guide
        recent_dt.append(dt)
    if log_step:
        tokens_per_s = tokens_per_iter / dt
        mfu = estimate_mfu(raw_model, tokens_per_s, block_size, device, world_size)
        row = {'iter': iter_num, 'tokens': tokens_trained, 'train_loss': lossf, 'lr': lr,
               'grad_norm': gnorm, 'dt_ms': dt * 1000, 'tokens_per_s': tokens_per_s, 'mfu': mfu, **stats}
        eta = (sum(recent_dt) / len(recent_dt) if recent_dt else dt) * (max_iters - iter_num)
        depth = ''
        if stats:
            g = stats['block_grad_norm']
            depth = f" | grad first/last {g[0] / max(g[-1], 1e-12):.2f}"
        print0(f"iter {iter_num}/{max_iters} | loss {lossf:.4f} | lr {lr:.2e} | gnorm {row['grad_norm']:.2f} | "
               f"{dt * 1000:.0f}ms | {tokens_per_s:,.0f} tok/s" + (f" | mfu {mfu * 100:.1f}%" if mfu else '')
               + depth + f" | eta {eta / 60:.1f}m")
        log_metrics(row)
    if stop_iter is not None and iter_num >= stop_iter and iter_num < max_iters:
        save(ckpt_path, evaluated=False)  # a resume evaluates this state if it is due
        print0(f"stopped at iteration {iter_num} (stop_iter); continue with --init_from=resume")
        break

if iter_num == max_iters and master:
    best_path, best_note = best_state(out_dir, best_iter)  # ckpt_best.pt read whole: a damaged one is never named
    if best_path is None and best_iter is not None:
        print0(f"warning: {best_note}")
        best_note = "the best state was lost (the warning above)"
    write_json(os.path.join(out_dir, 'summary.json'), {
        'finished': True, 'iter': iter_num, 'max_iters': max_iters, 'val_loss': val_loss,
        'best_val_loss': best_val_loss, 'best_iter': best_iter, 'train_loss': lossf, 'best_ckpt': best_path,
        'n_params': n_params, 'tokens': tokens_trained, 'config': config,
        'model_args': asdict(raw_model.config)})
    worse = val_loss is not None and val_loss > best_val_loss
    print0(f"done: val loss {val_loss:.4f} after {tokens_trained:,} tokens"
           + (f" (warning: {val_loss / best_val_loss:.1f}x the best {best_val_loss:.4f}; {best_note})"
              if worse and val_loss > SPIKE_RATIO * best_val_loss else
              f" (the best was {best_val_loss:.4f}; {best_note})" if worse else ''))
if wandb_run is not None:
    wandb_run.finish()
shutdown()
