"""
Mutation testing of one module with mutmut (pinned 3.8.1; a developer's tool, not in
requirements.txt or CI: `pip install mutmut==3.8.1`). mutmut copies the repository into
mutants/, mutates the module's functions (one change per mutant: an operator, a constant, a
comparison, a dropped argument, ...) and, for each mutant, runs only the tests that called the
mutated function while the module's own tests ran once (its "stats"). A mutant that no test
fails on survives: a bug the suite cannot see.

    python tools/mutate.py checkpoint.py            # minutes on 2 cores
    python tools/mutate.py checkpoint.py --max-children=2
    python tools/mutate.py --list                   # the modules and the tests that cover each
    mutmut show checkpoint.x_verify__mutmut_7       # one mutant's diff (in the repository's root)
    python tools/mutate.py checkpoint.py --results  # killed / survived per module, the survivors named
    python tools/mutate.py checkpoint.py --sample   # every tenth mutant of every function (1, 11, 21, ...)

The tests of each module (MODULES) are its in-process tests: mutmut sees the functions a test
calls in its own process, not in the train.py / probe.py subprocesses that the end-to-end tests
start, so those tests would only add time. Functions only reached through a subprocess are
reported 'no tests'. docs/testing.md lists each module's kill rate and its survivors.
Runs with OMP_NUM_THREADS=1 (mutmut forks its workers from one process that has imported torch).
"""

import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# module -> the tests that cover it in-process (pytest arguments)
IN_PROCESS = ('test_checkpoint or the_seal_is or one_flipped_byte or cut_off_checkpoint or without_a_lock or '
              'pickle_holding_code_is or not_called_code or metadata or storage_records')
MODULES = {
    'checkpoint.py': ['tests/test_checkpoint.py', 'tests/test_run_directory.py', '-k', IN_PROCESS],
    'tools/untrusted.py': ['tests/test_checkpoint.py', 'tests/test_run_directory.py', '-k', IN_PROCESS],
    'plan/checks.py': ['tests/test_checks.py', '-k', 'not train_ and not cost_memory and not failed_first'],
    'plan/memory.py': ['tests/test_memory.py', '-k', 'fit_bytes or peak_is_the_most or auto_micro_batch or oom_message '
                       'or probe_shapes or fit_message or cgroup or cpu_memory or probe_depths or weights_grads'],
    'perf/step.py': ['tests/test_step.py', '-k', 'not bench_step_suite'],
    'fast/depth_read.py': ['tests/test_depth_read.py', 'tests/test_fast.py', '-k',
                           'test_depth_read or attnres_group or blockattnres_sum or blockattnres_group'],
    'fast/__init__.py': ['tests/test_fast.py', '-k', 'guard or twin or resolve or setup_enables or cuda_kernel or '
                         'tolerance or floor or autocast_factor or softmax_in_bf16 or declared'],
    # (the planted-error tests exec the module's own source, which mutmut has rewritten)
    'fast/moda.py': ['tests/test_fast.py', 'tests/test_kv_cache.py', '-k',
                     '(moda or depth_cache) and not refuses_a_depth_cache'],
    'fast/streams.py': ['tests/test_fast.py', '-k', '(streams or sinkhorn or fused_blocks) and not guard_refuses'],
}


def configure(module):
    """mutmut's configuration (setup.cfg's [mutmut]) narrowed to `module` and the tests that cover it."""
    from mutmut import configuration
    cfg = configuration.config()
    cfg.only_mutate = [module]
    cfg.pytest_add_cli_args_test_selection = MODULES[module]


def main(argv):
    if not argv or argv[0] == '--list':
        for m, tests in MODULES.items():
            print(f"{m:<20} {' '.join(tests)}")
        return 0
    module, rest = argv[0], argv[1:]
    if module not in MODULES:
        raise SystemExit(f"error: {module}: choose one of {', '.join(MODULES)}")
    os.chdir(ROOT)  # setup.cfg: mutmut's settings
    os.environ.setdefault('OMP_NUM_THREADS', '1')
    try:
        from mutmut.__main__ import cli
    except ImportError:
        raise SystemExit("error: mutmut is not installed: pip install mutmut==3.8.1") from None
    configure(module)
    name = module.removesuffix('.py').replace('/', '.').removesuffix('.__init__')
    if rest and rest[0] == '--results':
        return results(name)
    # mutants/ holds one module's mutants and results: another module's are cleared first
    stamp = ROOT / 'mutants' / 'MODULE'
    if (ROOT / 'mutants').exists() and (not stamp.exists() or stamp.read_text() != module):
        shutil.rmtree(ROOT / 'mutants')
    stamp.parent.mkdir(exist_ok=True)
    stamp.write_text(module)
    if rest and rest[0] == '--sample':  # every tenth mutant of every function: mutants 1, 11, 21, ...
        patterns, rest = [f"{name}.*__mutmut_{'?' * k}1" for k in range(3)], rest[1:]
    else:
        patterns = [f"{name}.*"]
    return cli(['run', *patterns, *rest], standalone_mode=False) or 0


def results(name):
    """Prints killed / survived / no tests / timeout counts of `name`'s mutants and each survivor."""
    import contextlib
    import io
    from mutmut.__main__ import cli
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli(['results', '--all', 'true'], standalone_mode=False)
    rows = [line.strip().rsplit(': ', 1) for line in out.getvalue().splitlines() if line.strip().startswith(name + '.')]
    counts = {}
    for _, status in rows:
        counts[status] = counts.get(status, 0) + 1
    print(name, counts)
    for mutant, status in rows:
        if status in ("survived", "timeout", "suspicious"):
            print(f"  {status}: {mutant}")
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
