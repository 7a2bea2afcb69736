"""
Sweep runner: train every run of an experiment family (study/families.py) one after
another, then collect the results and plot validation loss against shape.

    python study/sweep.py family=main schemes=preln,attnres,hc         # all their shapes
    python study/sweep.py family=main schemes=attnres shapes=16,32     # only L = 16 and 32
    python study/sweep.py family=mini                                  # the CPU mini-DepthBench
    python study/sweep.py family=mini seeds=3                          # ... with 3 seeds per run
    python study/sweep.py family=main extra=--batch_size=8,--gradient_accumulation_steps=64
    python study/sweep.py family=main plot_only=True                   # collect + plot only
    python study/sweep.py family=main run=print nproc_per_node=8       # print cluster commands
    python study/sweep.py family=main shapes=32 probe=True             # then probe.py --compare at L=32

(`--family=main` style works too.) For each run, in table order:
  - out_dir/summary.json says finished  -> skipped;
  - out_dir/ckpt.pt exists               -> continued with --init_from=resume;
  - otherwise                            -> started.
Each launch adds its wall time, the machine and the commit to out_dir/wall_time.json (kept
every minute while it runs: a launch killed without a word loses at most that).
A run that fails (non-zero exit, or exit 0 without a finished summary.json) does
not stop the sweep; failures are listed at the end and the exit status is 1.
Output of train.py streams to the terminal. Paths (config/, out/) are relative to
the repo root, where train.py also runs.

Results: out/<family>/results.json (one row per run and seed: shape, parameter counts,
val_loss, status finished / unfinished (last eval of metrics.jsonl) / missing; and a
summary: mean and standard error over the finished seeds), a printed table of it, and
  out/<family>/loss_vs_ratio.png  val loss vs d/L per scheme; main and fixed_backbone
                                  show a fixed-total and a fixed-backbone panel (each
                                  when it has results), Pre-LN parameter counts under
                                  the ticks; several seeds: mean ± 1 s.e. and a dot per
                                  seed; hollow markers = unfinished
  out/cross_scale/loss_vs_size.png val loss vs total parameters, one line per d/L

Single GPU, multi-GPU, multi-node:
    python study/sweep.py family=main schemes=attnres                        # 1 GPU each run
    python study/sweep.py family=main schemes=attnres nproc_per_node=8       # 8 GPUs of this node,
        # i.e. torchrun --standalone --nproc_per_node=8 train.py config/attnres_L16.py ...
    python study/sweep.py family=main run=print nnodes=4 nproc_per_node=8    # commands to paste on
        # each of 4 nodes: torchrun --nnodes=4 --node_rank=$NODE_RANK --nproc_per_node=8
        #   --master_addr=$MASTER_ADDR --master_port=29500 train.py config/attnres_L16.py
gradient_accumulation_steps in the configs is global (train.py divides it by the
number of GPUs), so the 512-sequence batch stays the same: 32 must be divisible by
the GPU count (or pass extra=--batch_size=..,--gradient_accumulation_steps=..).
run=print reads the skip/resume status from this machine's out/ directory.
seeds=N trains every run N times, seed by seed (all runs of seed 0, then of seed 1,
...): seed 0 is the run as configured (train.py's seed 1337, out_dir as in the config),
seed k > 0 adds --seed=1337+k and trains into <out_dir>_seed<k>. seed=K trains only seed
index K: three processes `seeds=3 seed=0|1|2 probe=False` side by side share the work.
extra= changes every run it touches, in place: a shortened smoke test
(extra=--max_iters=20) finishes into the real out_dir and is then skipped (with a
line saying so) and left out of the summary, so delete those out_dirs (or use a copy
of the repo) before the real sweep.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, when run as a script
if __name__ == '__main__':  # Ctrl-C or SIGTERM while the libraries load: one line (main's handler then takes over)
    from configurator import stop_while_starting
    stop_while_starting()

import contextlib  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import checkpoint  # noqa: E402
from study import families, mini, results  # noqa: E402
from study.results import (_budget, _read_json, _with_loss, format_summary, plot_loss_vs_ratio, plot_loss_vs_size,  # noqa: E402
                           read_all, read_result, run_command, run_status, seeded, summarize)

ROOT = families.ROOT
OPTIONS = {  # option -> (default, help)
    'family': (None, f"one of: {', '.join(families.FAMILIES)}"),
    'schemes': (None, "comma-separated scheme names (default: all of the family's)"),
    'shapes': (None, "comma-separated depths L (default: all)"),
    'run': ('local', "local: run train.py here, one run after another; print: print the commands"),
    'extra': ('', "comma-separated train.py overrides for every run, e.g. --device=cpu,--compile=False"),
    'nproc_per_node': (None, "GPUs per node (local default 1 = plain python; print default 8)"),
    'nnodes': (1, "nodes per run (run=print only; > 1 prints multi-node torchrun commands)"),
    'plot_only': (False, "True: only collect results and plot"),
    'seeds': (1, "training seeds per run (seed k > 0 trains into <out_dir>_seed<k> with --seed=1337+k); "
                 "the table and plot show mean ± standard error over the seeds that finished"),
    'seed': (None, "train only this seed index of every run (e.g. one process per seed, side by side)"),
    'probe': (None, "True: after training, probe the deepest shape's checkpoints side by side "
                    "(probe.py --compare); default True for the mini family"),
}
# probe.py budgets for the sweep's probe step: small enough for a CPU, per family
PROBE_ARGS = {'mini': ['--n_windows=16', '--seq_len=256', '--arc_limit=500', '--nll_limit=100', '--n_boot=1000'],
              None: []}

# -----------------------------------------------------------------------------
# what to do with each run

def seed_args(run):
    """The train.py overrides that make a config file train `run` (a seeded() copy): [] for seed 0."""
    if not run.info.get('seed'):
        return []
    return [f"--out_dir={run.out_dir}", f"--seed={run.config['seed']}"]


def train_command(run, status, extra=(), nproc_per_node=1, nnodes=1, launcher=None, python=sys.executable):
    """
    The command line (list of str) that trains or resumes `run`.

    status: 'new' or 'interrupted' (adds --init_from=resume); extra: train.py
    overrides appended last; nproc_per_node/nnodes: > 1 uses torchrun (standalone on
    one node, rendezvous at $MASTER_ADDR with rank $NODE_RANK on several);
    launcher: the torchrun program, default `python -m torch.distributed.run`
    (the same as `torchrun`); python: the interpreter of a single-process run.
    Raises ValueError for a finished run.
    """
    if status not in ('new', 'interrupted'):
        raise ValueError(f"{run.name} is {status}: nothing to run")
    args = ['train.py', run.config_path] + seed_args(run) + \
        (['--init_from=resume'] if status == 'interrupted' else []) + list(extra)
    if nproc_per_node == 1 and nnodes == 1:
        return [python] + args
    launcher = list(launcher or [python, '-m', 'torch.distributed.run'])
    if nnodes == 1:
        return launcher + ['--standalone', f'--nproc_per_node={nproc_per_node}'] + args
    return launcher + [f'--nnodes={nnodes}', '--node_rank=$NODE_RANK', f'--nproc_per_node={nproc_per_node}',
                       '--master_addr=$MASTER_ADDR', '--master_port=29500'] + args


def format_command(cmd):
    """A command list as a shell line; $VARS are left for the shell to expand."""
    return ' '.join(a if '$' in a and re.fullmatch(r'[-\w=$]+', a) else shlex.quote(a) for a in cmd)


class Stopped(Exception):
    """The sweep got Ctrl-C or SIGTERM (signum); its running child has been sent SIGTERM."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_state = {'phase': None, 'defer': False, 'pending': None}  # phase: 'training', 'probing', 'collecting'
_running = {'run': None}  # the run whose train.py is running (or ran last), for the resume line


def on_signal(signum, frame=None):
    """Ctrl-C or SIGTERM at any moment (main installs it): passed on as SIGTERM to the running child
    (train.py ends its checkpoint write and says where it resumes; probe.py ends, its finished
    results whole), which run_command waits for; then the sweep stops with one line (main). While
    results are written (`deferred`) the stop waits for the end of the writing. A later signal
    is only passed on."""
    for child in list(results.running):
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    if _state['pending'] is not None:
        return
    _state['pending'] = signum
    if not _state['defer']:
        raise Stopped(signum)


@contextlib.contextmanager
def deferred(phase):
    """A phase that writes results (JSON, figures): a signal during it stops the sweep at its end,
    so that no file is left half-written."""
    _state.update(phase=phase, defer=True)
    try:
        yield
    finally:
        _state['defer'] = False
    if _state['pending'] is not None:
        raise Stopped(_state['pending'])


def stopped_line(signum):
    """The one line of a sweep stopped by a signal: what it was doing and what the same command does next."""
    what = 'interrupted' if signum == signal.SIGINT else f'terminated ({signal.Signals(signum).name})'
    phase = _state['phase']
    if phase == 'probing':
        return f"{what} while probing: the probes that finished are kept; the same command probes the rest"
    if phase == 'collecting':
        return f"{what} while collecting: the results were written whole first; the same command does what is left"
    if phase == 'training':
        return f"{what}; {resume_line()}"
    return f"{what} while starting: nothing was written; run the same command again"


def machine():
    """Where a run trains: {'platform', 'cpu' (model name), 'cpus' (logical), 'threads' (OMP_NUM_THREADS)}."""
    cpu = platform.processor() or platform.machine()
    try:
        with open('/proc/cpuinfo') as f:
            cpu = next((line.split(':', 1)[1].strip() for line in f if line.startswith('model name')), cpu)
    except OSError:
        pass
    return {'platform': platform.platform(), 'cpu': cpu, 'cpus': os.cpu_count(),
            'threads': os.environ.get('OMP_NUM_THREADS')}


def code_version(root):
    """The commit checked out at root (12 hex digits); where tracked files outside docs/ and
    *.md differ from it, '-dirty.' and 8 hex digits of a SHA-256 over those files' paths and
    contents, so two different edits are two versions (whatever the user's diff settings).
    None where root is not the top of a git checkout or git is missing; one line where git
    refuses a checkout it finds (e.g. "dubious ownership")."""
    def git(*args):
        return subprocess.run(['git', *args], cwd=root, capture_output=True, timeout=60)
    try:
        top = git('rev-parse', '--show-toplevel')
        if top.returncode != 0 and os.path.exists(os.path.join(root, '.git')):
            why = top.stderr.decode(errors='replace').strip().splitlines()
            print(f"warning: git cannot read the commit of {root} ({why[0] if why else 'no reason given'}): "
                  f"wall_time.json records none", file=sys.stderr)
        if top.returncode != 0 or not os.path.samefile(top.stdout.decode().strip(), root):
            return None  # not a checkout, or a copy of the tree inside another repository
        head = git('rev-parse', 'HEAD')
        changed = git('diff', '--name-only', '-z', '--no-renames', 'HEAD', '--', '.', ':(exclude)docs', ':(exclude)*.md')
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0 or changed.returncode != 0:
        return None
    commit = head.stdout.decode().strip()[:12]
    names = sorted(n for n in changed.stdout.split(b'\0') if n)  # results and docs are not code
    if not names:
        return commit
    h = hashlib.sha256()
    for name in names:
        try:
            with open(os.path.join(root, os.fsdecode(name)), 'rb') as f:
                data = f.read()
        except OSError:
            data = b'(deleted)'
        h.update(name + b'\0' + data + b'\0')
    return f"{commit}-dirty.{h.hexdigest()[:8]}"


HEARTBEAT_S = 60  # a launch's time so far is on disk every minute: a kill -9 or a restart loses at most this


def record_wall_time(run, root, seconds, commit=None, launch=None, ongoing=False):
    """Adds `seconds` of this launch of a run to out_dir/wall_time.json ({'wall_s', 'launches',
    'machine', 'commits'}): a resumed run sums its launches, and 'commits' lists each code
    version (code_version at launch) that trained it, so a run resumed on other code says so.
    ongoing: the launch `launch` (its start time) still runs: its time so far is kept as 'open'
    instead (the heartbeat). An 'open' of another launch never closed (the sweep killed without
    a word) is added to the totals and counted in 'killed_launches': their wall time is short
    by at most HEARTBEAT_S each."""
    path = os.path.join(root, run.out_dir, 'wall_time.json')
    if not os.path.isdir(os.path.dirname(path)):
        return
    had = _read_json(path) or {}
    commits = [c for c in had.get('commits') or [] if isinstance(c, str)]
    wall, launches = float(had.get('wall_s') or 0), int(had.get('launches') or 0)
    killed = int(had.get('killed_launches') or 0)
    stale = had.get('open')
    if isinstance(stale, dict) and stale.get('launch') != launch:  # a launch that ended unrecorded
        wall, launches, killed = wall + float(stale.get('wall_s') or 0), launches + 1, killed + 1
    if commit and commit not in commits:
        commits.append(commit)
    rec = {'wall_s': round(wall + (0 if ongoing else seconds), 1), 'launches': launches + (0 if ongoing else 1),
           'machine': machine(), 'commits': commits}
    if killed:
        rec['killed_launches'] = killed
    if ongoing:
        rec['open'] = {'launch': launch, 'wall_s': round(seconds, 1)}
    checkpoint.write_json(path, rec)


def timed(run, root, cmd, commit):
    """run_command(cmd, root) with its wall time recorded: at the start, every HEARTBEAT_S while
    train.py runs, and at the end however it ends (record_wall_time). Returns the exit status."""
    t0, stop = time.time(), threading.Event()

    def beat():
        while True:
            record_wall_time(run, root, time.time() - t0, commit, launch=t0, ongoing=True)
            if stop.wait(HEARTBEAT_S):
                return
    heart = threading.Thread(target=beat, daemon=True)
    heart.start()
    try:
        return run_command(cmd, root)
    finally:
        stop.set()
        heart.join()
        record_wall_time(run, root, time.time() - t0, commit, launch=t0)


def sweep(family, schemes=None, shapes=None, extra=(), run='local', nproc_per_node=None, nnodes=1, root=None,
          seeds=1, seed=None):
    """
    Train (run='local') or print the commands for (run='print') every run of a family,
    `seeds` times (seed by seed: every run of seed 0, then of seed 1, ...; see seeded()), or
    only seed index `seed` when given.

    Finished runs are skipped, interrupted ones resumed, the rest started, one after
    another; a failure does not stop the sweep. Returns the list of (run name,
    reason) that failed (always [] for run='print'). Raises ValueError for bad options
    (unknown family/scheme/depth, --out_dir or --init_from in extra, ...).
    """
    if run not in ('local', 'print'):
        raise ValueError(f"run={run!r}: use run=local or run=print")
    for arg in extra:
        if not (arg.startswith('--') and '=' in arg):
            raise ValueError(f"extra override {arg!r}: write it as --key=value")
        if arg.split('=', 1)[0] in ('--out_dir', '--init_from'):
            raise ValueError(f"extra override {arg!r}: the sweep sets out_dir and init_from per run; drop it")
    if nproc_per_node is None:
        nproc_per_node = 8 if run == 'print' else 1
    if nproc_per_node < 1 or nnodes < 1:
        raise ValueError("nproc_per_node and nnodes must be >= 1")
    if nnodes > 1 and run == 'local':
        raise ValueError("nnodes > 1 needs one launch per node: use run=print and start the commands on each node")
    if seeds < 1:
        raise ValueError(f"seeds={seeds}: give a positive integer")
    root = root or ROOT
    if seed is not None and seed < 0:
        raise ValueError(f"seed={seed}: give a seed index >= 0")
    todo = [seeded(r, k) for k in (range(seeds) if seed is None else [seed])
            for r in families.runs(family, schemes, shapes)]
    if run == 'local' and not os.path.exists(os.path.join(root, 'train.py')):
        raise FileNotFoundError(f"{os.path.join(root, 'train.py')} not found: run the sweep from a DepthBench checkout")
    if run == 'local':  # one clear error instead of one failed run per config
        for dataset in dict.fromkeys(r.config['dataset'] for r in todo):
            if not os.path.exists(os.path.join(root, 'data', dataset, 'train.bin')):
                # the byte-level data of the mini family is the sample that ships in data/sample/
                how = '--sample --tokenizer byte' if dataset.endswith('_byte') else '--input YOUR_SHARDS'
                raise FileNotFoundError(f"data/{dataset}/train.bin not found: prepare it first, e.g. "
                                        f"python data/fineweb_edu/prepare.py {how} (see README)")
    launcher, python = (['torchrun'], 'python') if run == 'print' else (None, sys.executable)
    failures = []
    for i, r in enumerate(todo, 1):
        status = run_status(r, root)
        head = f"[{i}/{len(todo)}] {r.name} ({r.out_dir})"
        if not os.path.exists(os.path.join(root, r.config_path)):
            raise FileNotFoundError(f"{r.config_path} not found: run `python study/families.py` to generate the configs")
        if status == 'finished':
            other = read_result(r, root).get('other_length')  # e.g. a shortened smoke test in the real out_dir
            print(f"# {head}: finished, skipped" + (f" -- but it {other}: delete {r.out_dir} to train the planned run"
                                                     if other else ''), flush=True)
            continue
        cmd = train_command(r, status, extra, nproc_per_node, nnodes, launcher, python)
        if run == 'print':
            print(f"# {head}: {'resume' if status == 'interrupted' else 'new'}")
            print(format_command(cmd), flush=True)
            continue
        print(f"=== {head}: {'resuming' if status == 'interrupted' else 'starting'}\n$ {format_command(cmd)}", flush=True)
        _running['run'] = (r, root)
        _state['phase'] = 'training'
        rc = timed(r, root, cmd, code_version(root))
        if rc != 0:
            failures.append((r.name, f"exit status {rc}"))
        elif run_status(r, root) != 'finished':
            failures.append((r.name, "exited 0 but out_dir has no finished summary.json"))
    return failures

# -----------------------------------------------------------------------------
# results


def collect(family, root=None, seeds=1, warn=True):
    """
    Read every run of a family (read_result), with seeds 0..seeds-1 and any other seed on
    disk (seed_runs),
    into root/out/<family>/results.json = {"family": ..., "runs": [row, ...] (one per seed,
    'seed' = its index), "summary": summarize(runs)}. Returns the list of rows.
    """
    root = root or ROOT
    rows = read_all(family, root, seeds)
    path = os.path.join(root, 'out', family, 'results.json')
    os.makedirs(os.path.dirname(path), exist_ok=True)
    text = json.dumps(dict(family=family, runs=rows, summary=summarize(rows)), indent=1)
    checkpoint.atomic_write(path, lambda tmp: checkpoint.write_bytes(tmp, text.encode()))  # a temp name per process
    for r in rows if warn else ():  # the mini study's own collect has said it already
        if r['status'] == 'other_length':
            print(f"warning: {r['out_dir']} {r['other_length']}: left out of the summary", file=sys.stderr)
    n = {s: sum(r['status'] == s for r in rows) for s in ('finished', 'other_length', 'unfinished', 'missing')}
    n_seeds = max((sum(1 for x in rows if x['name'].split('_seed')[0] == r.name) for r in families.runs(family)),
                  default=1)
    print(f"{family}: {n['finished']} finished, " + (f"{n['other_length']} at another length, " if n['other_length'] else '')
          + f"{n['unfinished']} unfinished, {n['missing']} missing "
          f"(up to {n_seeds} seed{'s' if n_seeds > 1 else ''} per run) -> {os.path.relpath(path, root)}")
    return rows


def probe_deepest(family, schemes=None, shapes=None, root=None):
    """Runs every diagnostic of probe.py on the finished checkpoints of the deepest shape of
    the family (one per scheme), side by side: `probe.py --compare ... --out_dir
    out/<family>/probe_L<L>`, with the family's budgets (PROBE_ARGS). Returns failures."""
    root = root or ROOT
    runs = [r for r in families.runs(family, schemes, shapes) if read_result(r, root)['status'] == 'finished']
    if not runs:
        print(f"probe: no finished run of {family} to probe")
        return []
    deepest = max(r.config['n_layer'] for r in runs)
    ckpts = [os.path.join(r.out_dir, 'ckpt.pt') for r in runs if r.config['n_layer'] == deepest]
    out_dir = os.path.join('out', family, f'probe_L{deepest}')
    cmd = [sys.executable, 'probe.py', '--compare', *ckpts, f'--out_dir={out_dir}',
           *PROBE_ARGS.get(family, PROBE_ARGS[None])]
    print(f"probe: {format_command(cmd)}", flush=True)
    if run_command(cmd, root) != 0:
        return [(f'probe_L{deepest}', 'probe.py failed')]
    return []

# -----------------------------------------------------------------------------
# plots (docs/families.md: loss vs d/L at fixed total and at fixed backbone; loss vs size across scales)


def plot(family, rows=None, root=None):
    """
    Plot a family's results into root/out/<family>/ (rows: collect()'s, read if None).
    main and fixed_backbone both get the two-panel loss_vs_ratio.png (fixed total,
    fixed backbone; a panel only when that family has results); cross_scale gets
    loss_vs_size.png; the other families a one-panel loss_vs_ratio.png.
    Returns the list of PNG paths written.
    """
    root = root or ROOT
    rows = rows if rows is not None else read_all(family, root)
    out = os.path.join(root, 'out', family)
    os.makedirs(out, exist_ok=True)
    written = []
    if family in ('main', 'fixed_backbone'):
        other = 'fixed_backbone' if family == 'main' else 'main'
        by_family = {family: rows, other: read_all(other, root)}
        titles = {'main': 'fixed total ≈400M', 'fixed_backbone': 'fixed backbone ≈300M'}
        panels = [(titles[f], _with_loss(by_family[f])) for f in ('main', 'fixed_backbone')]
    elif family == 'cross_scale':
        pts = _with_loss(rows)
        if pts:
            written.append(os.path.join(out, 'loss_vs_size.png'))
            plot_loss_vs_size(pts, written[-1])
        panels = [(f"{t / 1e6:.0f}M total", _with_loss([r for r in rows if r['target_total'] == t]))
                  for t in dict.fromkeys(r['target_total'] for r in rows)]
    else:
        # the family title without the budget it was written for: the runs say what they used
        title = re.sub(r',\s*[\d.]+ tokens per backbone parameter', '', families.FAMILIES[family].title.split(':')[-1])
        panels = [(title.strip() + _budget(rows), _with_loss(rows))]
    panels = [p for p in panels if p[1]]
    if panels:
        written.append(os.path.join(out, 'loss_vs_ratio.png'))
        plot_loss_vs_ratio(panels, written[-1])
    for p in written:
        print(f"wrote {os.path.relpath(p, root)}")
    if not written:
        print(f"{family}: no run has a validation loss yet, nothing to plot")
    return written

# -----------------------------------------------------------------------------
# command line


def parse_args(argv):
    """
    key=value or --key=value arguments (see OPTIONS) -> dict of typed options.
    Raises ValueError naming the fix for unknown keys, bad values or a missing family.
    """
    opts = {k: default for k, (default, _) in OPTIONS.items()}
    extra = []
    for arg in argv:
        key, sep, value = arg.lstrip('-').partition('=')
        if not sep:
            raise ValueError(f"argument {arg!r}: write key=value, e.g. family=main")
        if key not in OPTIONS:
            raise ValueError(f"unknown option {key!r}; options: {', '.join(OPTIONS)}")
        if key == 'extra':
            extra += [a for a in re.split(r',(?=--)', value) if a]  # commas inside a value are kept
        elif key in ('nproc_per_node', 'nnodes', 'seeds', 'seed'):
            if not value.isdigit() or int(value) < (0 if key == 'seed' else 1):
                raise ValueError(f"{key}={value!r}: give a {'seed index >= 0' if key == 'seed' else 'positive integer'}")
            opts[key] = int(value)
        elif key in ('plot_only', 'probe'):
            if value.lower() not in ('true', 'false'):
                raise ValueError(f"{key}={value!r}: write {key}=True or {key}=False")
            opts[key] = value.lower() == 'true'
        elif key in ('schemes', 'shapes'):
            items = [s.strip() for s in value.split(',') if s.strip()]
            if key == 'shapes' and not all(s.isdigit() for s in items):
                raise ValueError(f"shapes={value!r}: give depths L, e.g. shapes=16,32")
            opts[key] = [int(s) for s in items] if key == 'shapes' else items
        else:
            opts[key] = value
    opts['extra'] = extra
    if opts['probe'] is None:  # the mini family probes after training; plot_only=True just plots
        opts['probe'] = opts['family'] == 'mini' and not opts['plot_only']
    if opts['family'] is None:
        raise ValueError(f"give a family, e.g. family=main (one of: {', '.join(families.FAMILIES)})")
    if opts['family'] not in families.FAMILIES:
        raise ValueError(f"unknown family {opts['family']!r}; choose one of: {', '.join(families.FAMILIES)}")
    return opts


def main(argv):
    if not argv or argv[0] in ('-h', '--help'):
        print(__doc__.strip() + "\n\noptions:")
        for k, (default, text) in OPTIONS.items():
            print(f"  {k:<15} {text}" + (f" (default {default!r})" if default not in (None, '') else ""))
        return 0 if argv else 2
    try:
        return _main(argv)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # main called without on_signal installed (from Python)
        print(stopped_line(signal.SIGINT), file=sys.stderr, flush=True)
        return 128 + signal.SIGINT
    except Stopped as e:
        print(stopped_line(e.signum), file=sys.stderr, flush=True)
        return 128 + e.signum


def _main(argv):
    """main's work: train (sweep), probe, collect and plot; its errors and signals are main's lines."""
    opts = parse_args(argv)
    failures = []
    if not opts['plot_only']:
        failures = sweep(opts['family'], opts['schemes'], opts['shapes'], opts['extra'], opts['run'],
                         opts['nproc_per_node'], opts['nnodes'], seeds=opts['seeds'], seed=opts['seed'])
    if opts['run'] == 'print' and not opts['plot_only']:
        return 0
    n_seeds = max(opts['seeds'], (opts['seed'] or 0) + 1)
    if opts['family'] == 'mini':  # the mini study: probes of every seed's deepest models, the paper's table
        if opts['probe'] and opts['run'] == 'local':
            _state['phase'] = 'probing'
            failures += mini.probe_missing(ROOT, n_seeds)
        with deferred('collecting'):
            rows = read_all('mini', ROOT, n_seeds)
            if opts['plot_only'] and not any(r['status'] == 'finished' for r in rows) \
                    and os.path.exists(os.path.join(ROOT, mini.RESULTS)):
                print(f"no finished run in out/mini: reading the committed {mini.RESULTS}")
                mini.report(mini._read(os.path.join(ROOT, mini.RESULTS)), os.path.join(ROOT, 'out', 'mini'))
            else:
                study = mini.collect(ROOT, n_seeds)
                collect('mini', ROOT, n_seeds, warn=False)
                os.makedirs(os.path.join(ROOT, 'out', 'mini'), exist_ok=True)
                checkpoint.write_json(os.path.join(ROOT, 'out', 'mini', 'study.json'), study)
                mini.report(study, os.path.join(ROOT, 'out', 'mini'))
    else:
        with deferred('collecting'):
            rows = collect(opts['family'], seeds=n_seeds)
            print(format_summary(rows))
            plot(opts['family'], rows)
        if opts['probe'] and opts['run'] == 'local':
            _state['phase'] = 'probing'
            failures += probe_deepest(opts['family'], opts['schemes'], opts['shapes'])
    if failures:
        print(f"{len(failures)} run(s) failed:", file=sys.stderr)
        for name, why in failures:
            print(f"  {name}: {why}", file=sys.stderr)
        return 1
    return 0


def resume_line():
    """Where the same sweep command resumes the run it was training."""
    if _running['run'] is None:
        return "no run had started: run the same command again"
    run, root = _running['run']
    path = os.path.join(root, run.out_dir, 'ckpt.pt')
    it = checkpoint.iteration_of(path)
    if it is None:
        return f"{run.name} left no checkpoint: the same command starts it again"
    return f"the same command resumes {run.name} from iteration {it} ({os.path.join(run.out_dir, 'ckpt.pt')})"


if __name__ == '__main__':
    signal.signal(signal.SIGINT, on_signal)  # Ctrl-C and SIGTERM at any moment: one line (main)
    signal.signal(signal.SIGTERM, on_signal)
    sys.exit(main(sys.argv[1:]))
