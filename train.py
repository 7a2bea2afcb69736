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
docs/training.md says what a run keeps and how it stops on a fault. What it refuses before its
first step (settings, out_dir, device, data, resume), each in one line: plan/checks.py.
"""

import os
import sys

from configurator import stop_while_starting  # the standard library only: it loads in milliseconds

stop_while_starting()  # Ctrl-C or SIGTERM while torch loads: one line, not a traceback or silence

import datetime  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections import deque  # noqa: E402
from contextlib import nullcontext  # noqa: E402
from dataclasses import asdict  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import fast as fastpath  # noqa: E402
from checkpoint import (MetricsLog, best_state, catch_signals, fail, full_state, load_for_resume,  # noqa: E402
                        lock_out_dir, remove_stale_temp, restore, save_checkpoint, write_json)
from configurator import ConfigError, comments_from_source, configure  # noqa: E402
from data.loader import TokenLoader, default_data_dir, eval_batches, evaluate  # noqa: E402
from model import GPT, GPTConfig, estimate_mfu  # noqa: E402
from probes.analysis import block_stats  # noqa: E402
from plan import checks  # noqa: E402
from plan import memory as memory_plan  # noqa: E402
from residuals import RESIDUALS  # noqa: E402

# -----------------------------------------------------------------------------
# default config values: a small Pre-LN model on FineWeb-Edu
# I/O
out_dir = 'out'  # checkpoint, metrics.jsonl and summary.json go here
eval_interval = 200  # evaluate on the held-out split (and checkpoint) every this many iterations
log_interval = 10  # console + metrics.jsonl line every this many iterations
eval_iters = 50  # batches per evaluation
eval_only = False  # evaluate once and exit
init_from = 'scratch'  # 'scratch' or 'resume' (from out_dir/ckpt.pt)
allow_unsealed = False  # resume from a ckpt.pt without a seal (another tool's), unverified
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
master_rank = int(os.environ.get('RANK', 0)) == 0
# Ctrl-C or SIGTERM at any moment from here on: one line naming where a resume starts (checkpoint.py)
catch_signals(out_dir, init_from, eval_only, lambda: iter_num if training else None, master_rank)
# keys that belong to this invocation, not to the run: a resume never takes them from the checkpoint
RUN_CONTROL_KEYS = ('out_dir', 'init_from', 'allow_unsealed', 'eval_only', 'stop_iter', 'device', 'compile',
                    'backend', 'fsdp', 'dist_timeout')
# the model's settings (GPTConfig fields): a resumed run keeps the checkpoint's
MODEL_KEYS = ('vocab_size', 'block_size', 'n_layer', 'n_head', 'n_kv_head', 'n_embd', 'ffn_hidden', 'residual',
              'hc_streams', 'hc_out_init_scale', 'hc_readout', 'mhc_sinkhorn_iters', 'mhc_sinkhorn', 'mhc_init',
              'attnres_blocks', 'attnres_eps')
ckpt_path = os.path.join(out_dir, 'ckpt.pt')
checks.settings(globals())  # every value in its range, before anything is written or built (plan/checks.py)
if master_rank and not eval_only:  # rank 0 writes out_dir; it alone holds the lock
    checks.out_dir(out_dir)
    _out_lock = lock_out_dir(out_dir)
    remove_stale_temp(out_dir, locked=_out_lock is not None)  # a killed run's partial files
checkpoint = load_for_resume(out_dir, allow_unsealed) if init_from == 'resume' else None  # verified, whole
if checkpoint is not None:  # the run's own settings, except those this command line (or a config file) sets
    globals().update(checks.resumed_settings(checkpoint, ckpt_path, config_keys, keys_set, RUN_CONTROL_KEYS,
                                             MODEL_KEYS))
    checks.settings(globals())
config = {k: globals()[k] for k in config_keys}  # saved in checkpoints and summary.json

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
    gradient_accumulation_steps = checks.accumulation(gradient_accumulation_steps, world_size)
else:
    rank, local_rank, world_size, master = 0, 0, 1, True
device_type, dtype = checks.device(device, dtype, ddp, fsdp)
if compile is None:
    compile = device_type == 'cuda'


def print0(*args, sep=' ', end='\n'):
    """print() on the master process, as one write: a signal's line never lands inside a line."""
    if master:
        sys.stdout.write(sep.join(map(str, args)) + end)
        sys.stdout.flush()


# an out-of-memory error at any point (building, planning, compiling, training, evaluating): one line
# naming the config (a resume: the checkpoint's shape), the micro-batch and the fix, on every rank that ran out
sys.excepthook = memory_plan.oom_hook(lambda: (SimpleNamespace(residual=residual, n_layer=n_layer, n_embd=n_embd),
                                               batch_size, block_size, gradient_accumulation_steps * world_size))
_tokens = gradient_accumulation_steps * world_size * batch_size * block_size
if device_type == 'cpu' and (_note := checks.gpu_sized(n_embd, n_layer, vocab_size, ffn_hidden, _tokens)):
    print0(_note)  # say so up front: a GPU-sized model takes minutes to build here, and more to evaluate
torch.manual_seed(seed)  # the same initial weights on every rank
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
autocast = nullcontext() if dtype == 'float32' else torch.autocast(device_type=device_type, dtype=ptdtype)

# -----------------------------------------------------------------------------
# data: uint16 token files of data/<dataset>/prepare.py

if data_dir is None:  # data/<dataset>; a fresh clone's prepared from the embedded sample (rank 0; the others wait)
    data_dir = default_data_dir(dataset, prepare=master, say=print0)
    if ddp:
        dist.barrier()
meta, vocab_size = checks.data(data_dir, block_size, vocab_size, named=config['data_dir'] is not None)
meta_path, train_path, val_path = (os.path.join(data_dir, f) for f in ('meta.json', 'train.bin', 'val.bin'))
train_loader = TokenLoader(train_path, batch_size, block_size, rank, world_size, seed, device=device)

# -----------------------------------------------------------------------------
# model, memory plan, optimizer, resume

_effective = checks.model_args(globals(), MODEL_KEYS)  # bad settings first: a resume would not mend them
if init_from == 'resume':
    model_args = checkpoint['model_args']
    for _line in checks.resume(checkpoint, config, keys_set, _effective, MODEL_KEYS):
        print0(_line)
else:
    model_args = _effective
    checks.scratch(out_dir, ckpt_path)
checks.token_ids((val_path, train_path), model_args['vocab_size'], meta, meta_path)
if not fsdp and not eval_only:  # the run's static bytes (weights, gradients, AdamW) held against the memory first
    try:
        device_bytes, _what = memory_plan.hold_static(GPTConfig.from_dict(model_args), device, memory_gib)
    except ValueError as e:
        fail(str(e))
try:
    model = GPT(GPTConfig.from_dict(model_args))  # from_dict: older checkpoints keep their readout
except ValueError as e:
    fail(str(e))
if checkpoint is not None:
    checks.weights(model, checkpoint, ckpt_path)
model.to(device)
raw_model = model  # the unwrapped module: what checkpoints and probes see
n_params = model.num_params()
try:  # the fast paths that apply (fast/), each checked against residuals.py on a tiny twin first
    fast_paths = fastpath.setup(raw_model, fast, device, dtype=ptdtype)
except (ValueError, fastpath.FastPathMismatch) as e:
    fail(str(e))
print0(fastpath.describe(fast_paths))
if checkpoint is not None and (_note := checks.fast_paths(checkpoint.get('fast_paths'), [p.name for p in fast_paths])):
    print0(_note)  # another rounding: allowed, but said
if not fsdp and not eval_only:  # the predicted peak memory held against the device's, and the micro-batch that fits
    try:  # the model as it will run: its fast paths, and (compile on CUDA) inductor's partition of the regions
        batch_size, gradient_accumulation_steps = memory_plan.plan_run(
            raw_model, fast_paths, batch_size, block_size, gradient_accumulation_steps, world_size, dtype,
            compile and device_type == 'cuda', device_bytes, _what, auto_batch, say=print0)
    except ValueError as e:
        fail(str(e))
    train_loader.B = batch_size

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
    # FSDP2 warns that F.linear's view could be edited in place; no scheme does (x = x + f): noise
    warnings.filterwarnings('ignore', message='FSDP2-wrapped module')
    mp = MixedPrecisionPolicy(param_dtype=ptdtype, reduce_dtype=torch.float32)
    # one unit per branch: each weight gathered once per forward and backward. The schemes call the
    # branches, not Block.forward, and MoDA calls attn.qkv and attn.out apart (its depth keys between):
    # the attention's unit is its four projections as one group, however the scheme calls them.
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
    checks.optimizer_state(optimizer, checkpoint['optimizer'], ckpt_path, raw_model if fsdp else None)
    iter_num, best_val_loss, best_iter, tokens_trained = restore(checkpoint, scaler, train_loader, tokens_per_iter)
    print0(f"resumed from {ckpt_path} at iteration {iter_num}")
    if not eval_only:
        checks.finished(iter_num, max_iters, out_dir)
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


_eval_said = []  # the line about a small validation split is said once


def estimate_val_loss(progress=False):
    """Mean next-token cross-entropy (nats) over the first eval_iters x batch_size chunks of val.bin
    (data.loader.evaluate: the same chunks whatever the number of processes; a smaller val.bin
    whole, in smaller batches, said in one line). progress: a bar on a terminal (rank 0)."""
    B, n, chunks = eval_batches(val_path, batch_size, block_size, eval_iters)
    if chunks < eval_iters * batch_size and not _eval_said:
        _eval_said.append(True)
        print0(f"evaluation: {val_path} holds {chunks:,} sequences of {block_size + 1:,} tokens, fewer than "
               f"eval_iters x batch_size = {eval_iters} x {batch_size}: each evaluation scores {n} batch"
               f"{'es' if n > 1 else ''} of {B} ({B * n * block_size:,} tokens); a real run prepares FineWeb-Edu "
               f"first (docs/training.md)")
    return evaluate(model, val_path, B, n, block_size, device, autocast, rank, world_size, progress and master)


def save(path, evaluated=True, best=False):
    """Everything needed to continue exactly: weights (of the uncompiled module: no `_orig_mod.`),
    optimizer, model and run config, iteration, data-loader position, RNG states, whether this
    state has been evaluated (a resume then skips it) and its losses; sealed and atomic
    (checkpoint.save_checkpoint; best: also as ckpt_best.pt)."""
    model_state, opt_state = full_state(raw_model, optimizer, fsdp)  # collective under FSDP
    if not master:
        return
    rng = {'torch': torch.get_rng_state(), **({'cuda': torch.cuda.get_rng_state()} if device_type == 'cuda' else {})}
    save_checkpoint(path, {
        'model': model_state, 'optimizer': opt_state, 'model_args': asdict(raw_model.config), 'config': config,
        'iter_num': iter_num, 'tokens': tokens_trained, 'best_val_loss': best_val_loss, 'best_iter': best_iter,
        'loader': train_loader.state_dict(), 'rng': rng, 'scaler': scaler.state_dict(), 'evaluated': evaluated,
        'val_loss': val_loss, 'train_loss': lossf, 'fast_paths': [p.name for p in fast_paths],
        'tokenizer': meta.get('tokenizer')}, best=best)  # sample.py decodes with it (None: data without meta.json)


wandb_run = None
if wandb_log and master and not eval_only:  # (checks.settings has found the package)
    import wandb
    wandb_run = wandb.init(project=wandb_project, name=wandb_run_name or os.path.basename(os.path.abspath(out_dir)),
                           config=config, dir=out_dir)
# metrics.jsonl (and W&B): a resume drops the rows it repeats; a new run moves an older run's aside
log_row = MetricsLog(out_dir, init_from, iter_num, wandb=wandb_run).write if master and not eval_only else \
    (lambda row: None)
_lost = []  # a lost best state is said in one warning line, once


def best_note():
    """(path of ckpt_best.pt or None, a phrase saying where the best state is); a lost best state
    is said once, in a warning line naming what is usable instead (checkpoint.best_state)."""
    path, note = best_state(out_dir, best_iter, best_val_loss)
    if path is None and best_iter is not None:
        if not _lost:
            print0(f"warning: {note}")
            _lost.append(note)
        note = "the best state is lost (the warning above)"
    return path, note


# -----------------------------------------------------------------------------
# training loop

def shutdown():
    """Under torchrun: every rank waits (rank 0 may still be writing) before the group is torn down."""
    if ddp:
        dist.barrier()
        dist.destroy_process_group()


if eval_only:
    print0(f"val loss {estimate_val_loss():.4f}" + " (untrained weights: init_from='scratch')" * (init_from != 'resume'))
    shutdown()
    sys.exit(0)


def stop_nonfinite(what):
    """A non-finite loss or gradient: the state kept for a diagnosis in ckpt_nonfinite.pt, never in
    ckpt.pt (the last good checkpoint stays), and one line."""
    save(os.path.join(out_dir, 'ckpt_nonfinite.pt'))
    fail(f"{what} at iteration {iter_num}; state saved to {out_dir}/ckpt_nonfinite.pt. Lower --learning_rate "
         f"(now {learning_rate:g}) and "
         + (f"resume from the last good {ckpt_path} with --init_from=resume" if os.path.exists(ckpt_path)
            else "start again (no checkpoint was written before this)"))


SPIKE_RATIO = 1.5  # warn when the validation loss exceeds this x its best so far (a divergence)


training = True  # a signal from here on names the iteration a resume starts from
model.train()
t0 = time.time()
val_loss, lossf = resumed_losses if init_from == 'resume' else (None, None)
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
        log_row({'iter': iter_num, 'tokens': tokens_trained, 'val_loss': val_loss, 'lr': lr})
        if iter_num > 0:
            save(ckpt_path, best=is_best)
        elif is_best:  # the initial state: kept as ckpt_best.pt only (a run that gets worse keeps it)
            save(os.path.join(out_dir, 'ckpt_best.pt'))
        if val_loss > SPIKE_RATIO * best_val_loss:
            print0(f"warning: val loss {val_loss:.4f} is {val_loss / best_val_loss:.1f}x its best "
                   f"({best_val_loss:.4f}): the run may be diverging; {best_note()[1]}")
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
    # checked before the update (one CPU-GPU sync per step): a NaN/Inf gradient with a finite loss would
    # write NaN weights. Under fp16 the scaler skips such a step itself (an overflow): only the loss counts
    lossf, gnorm = torch.stack([loss_sum.float(), grad_norm.float()]).tolist()
    if not math.isfinite(lossf):
        stop_nonfinite(f"non-finite training loss {lossf}")
    if not math.isfinite(gnorm) and dtype != 'float16':
        stop_nonfinite(f"non-finite gradient norm {gnorm} (training loss {lossf:.4f}); the update was not applied")
    log_step = (iter_num + 1) % log_interval == 0 or iter_num + 1 == max_iters
    stats = block_stats(raw_model, x, autocast) if log_step and master and not fsdp else {}  # sharded: no global view
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
        g = stats.get('block_grad_norm')
        depth = f" | grad first/last {g[0] / max(g[-1], 1e-12):.2f}" if g else ''
        print0(f"iter {iter_num}/{max_iters} | loss {lossf:.4f} | lr {lr:.2e} | gnorm {row['grad_norm']:.2f} | "
               f"{dt * 1000:.0f}ms | {tokens_per_s:,.0f} tok/s" + (f" | mfu {mfu * 100:.1f}%" if mfu else '')
               + depth + f" | eta {eta / 60:.1f}m")
        log_row(row)
    if stop_iter is not None and iter_num >= stop_iter and iter_num < max_iters:
        save(ckpt_path, evaluated=False)  # a resume evaluates this state if it is due
        print0(f"stopped at iteration {iter_num} (stop_iter); continue with --init_from=resume")
        break

if iter_num == max_iters and master:
    best_path, best = best_note()  # ckpt_best.pt proven readable: a damaged one is never named
    write_json(os.path.join(out_dir, 'summary.json'), {
        'finished': True, 'iter': iter_num, 'max_iters': max_iters, 'val_loss': val_loss,
        'best_val_loss': best_val_loss, 'best_iter': best_iter, 'train_loss': lossf, 'best_ckpt': best_path,
        'n_params': n_params, 'tokens': tokens_trained, 'config': config, 'model_args': asdict(raw_model.config)})
    worse = val_loss is not None and val_loss > best_val_loss
    print0(f"done: val loss {val_loss:.4f} after {tokens_trained:,} tokens"
           + (f" (warning: {val_loss / best_val_loss:.1f}x the best {best_val_loss:.4f}; {best})"
              if worse and val_loss > SPIKE_RATIO * best_val_loss else
              f" (the best was {best_val_loss:.4f}; {best})" if worse else ''))
if wandb_run is not None:
    wandb_run.finish()
shutdown()
