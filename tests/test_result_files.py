"""Two result collections at once: two real processes write one results file over and over
at the same time (study/sweep.py's collect, study/mini.py's results, bench.py's write_json). Each must finish
without an error, the file must be one whole JSON document written by one of them, and no
temporary file may be left behind.
Run: python -m pytest tests/test_result_files.py -q"""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# each process: import, say it is ready, wait for the other, then write for `seconds`
WRITER = """
import json, os, sys, time
sys.path.insert(0, {repo!r})
tag, other, path, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
{setup}
open(os.path.join({ready!r}, tag), 'w').close()
deadline = time.time() + 120
while not os.path.exists(os.path.join({ready!r}, other)):
    assert time.time() < deadline, 'the other writer never started'
    time.sleep(0.01)
end, n = time.time() + seconds, 0
while time.time() < end or n < 20:
    {write}
    n += 1
print(n)
"""


def race(tmp_path, setup, write, seconds=1.5):
    """Runs two writer processes at once; returns their CompletedProcesses."""
    ready = tmp_path / 'ready'
    ready.mkdir()
    code = WRITER.format(repo=str(REPO), ready=str(ready), setup=setup, write=write)
    env = dict(os.environ, OMP_NUM_THREADS='1')
    path = tmp_path / 'out' / 'results.json'
    procs = [subprocess.Popen([sys.executable, '-c', code, tag, other, str(path), str(seconds)], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for tag, other in (('a', 'b'), ('b', 'a'))]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-3000:]
    return path


def test_two_bench_writers_at_once(tmp_path):
    path = race(tmp_path, "import bench\nobj = {'writer': tag, 'rows': [tag * 64] * 4000}",
                "bench.write_json(path, obj)")
    doc = json.loads(path.read_text())  # whole, and from one writer only
    assert doc['writer'] in ('a', 'b') and doc['rows'] == [doc['writer'] * 64] * 4000
    assert sorted(p.name for p in path.parent.iterdir()) == ['results.json']  # no temp file left


def test_two_sweep_collections_at_once(tmp_path):
    root = tmp_path / 'root'
    race(tmp_path, "from study import sweep\nimport contextlib, io", "with contextlib.redirect_stdout("
                f"io.StringIO()): sweep.collect('mini', root={str(root)!r})")
    path = root / 'out' / 'mini' / 'results.json'
    doc = json.loads(path.read_text())
    assert doc['family'] == 'mini' and len(doc['runs']) > 0
    assert sorted(p.name for p in path.parent.iterdir()) == ['results.json']


def test_two_mini_collections_at_once(tmp_path):
    # study/mini.py writes its results.json at the end of every share of the plan: processes that
    # share the plan finish at about the same time (the report's figures left out here)
    race(tmp_path, "from study import mini\nimport contextlib, io\nmini.report = lambda results, out_dir, wrote=(): None",
         "with contextlib.redirect_stdout(io.StringIO()): assert mini.main(['--probe=False', "
         "'--out=' + os.path.dirname(path)]) == 0")
    path = tmp_path / 'out' / 'results.json'
    doc = json.loads(path.read_text())
    assert doc['family'] == 'mini' and len(doc['runs']) == 72
    assert sorted(p.name for p in path.parent.iterdir()) == ['results.json']
