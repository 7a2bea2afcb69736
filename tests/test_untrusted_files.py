"""No code runs from a file a user loads. Every loader is given a file that runs a command
when unpickled (a `__reduce__` calling os.system or exec, which creates a marker file):
train.py's resume, probe.py, sample.py, tools/convert.py in every direction (--to=hf,
--from=hf's pytorch_model.bin, --from=olmo_core's .metadata and its .distcp shards). Each
file is first shown to be live (an unsafe load creates the marker); then each command must
leave no marker, exit non-zero and say in one line, without a traceback, that the file holds
code or unknown classes, naming the global. Also: convert.py's .metadata allow-list reads
what torch's and OLMo-core's writers pickle, and nothing else.
Run: python -m pytest tests/test_untrusted_files.py -q"""

import builtins
import io
import json
import os
import pickle
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tools import convert  # noqa: E402
from tools.untrusted import RefusedGlobal, pickle_globals  # noqa: E402


class Planted:
    """Unpickles as fn(arg): os.system('touch MARKER') or exec("open('MARKER', 'w')")."""

    def __init__(self, fn, arg):
        self.fn, self.arg = fn, arg

    def __reduce__(self):
        return self.fn, (self.arg,)


def shell(marker):
    return Planted(os.system, f"touch '{marker}'")


def python(marker):
    return Planted(builtins.exec, f"open({str(marker)!r}, 'w').close()")


def torch_save(obj, path):
    """A torch.save (zip) file holding obj inside a checkpoint-like dict."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({'model': {'wte.weight': torch.zeros(2, 2)}, 'model_args': obj, 'iter_num': 0}, path)
    return path


def pickle_dump(obj, path):
    """A plain pickle (protocol 4: a file made with pickle.dump, not torch.save)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, 'wb') as f:
        pickle.dump({'model': {}, 'model_args': obj}, f)
    return path


def assert_live(marker, load):
    """The staged file really runs its command when loaded without an allow-list."""
    assert not marker.exists()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        load()
    assert marker.exists(), "the staged pickle did not run: the test would prove nothing"
    marker.unlink()


def run(*args):
    env = dict(os.environ, OMP_NUM_THREADS='1')
    return subprocess.run([sys.executable, *map(str, args)], cwd=REPO, capture_output=True, text=True, env=env,
                          timeout=300)


def assert_refused(r, marker, name):
    """Nothing ran, a non-zero exit, one error line naming the global, no traceback."""
    assert not marker.exists(), "the file's code ran"
    assert r.returncode != 0
    assert 'Traceback' not in r.stdout + r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error: '), r.stderr
    assert 'holds code or unknown classes' in lines[0] and name in lines[0], lines[0]
    assert 'truncated' not in lines[0] and 'corrupt' not in lines[0] and 'weights_only=False' not in lines[0]


# -----------------------------------------------------------------------------
# train.py, probe.py, sample.py

def test_train_resume_refuses_a_checkpoint_holding_code(tmp_path):
    marker, out = tmp_path / 'ran', tmp_path / 'run'
    ckpt = torch_save(shell(marker), out / 'ckpt.pt')
    assert_live(marker, lambda: torch.load(ckpt, weights_only=False))
    r = run('train.py', '--device=cpu', f'--out_dir={out}', '--init_from=resume')
    assert_refused(r, marker, 'posix.system')


def test_probe_refuses_a_plain_pickle_holding_code(tmp_path):
    marker = tmp_path / 'ran'
    ckpt = pickle_dump(python(marker), tmp_path / 'ckpt.pt')
    assert_live(marker, lambda: pickle.loads(ckpt.read_bytes()))
    r = run('probe.py', '--ckpt', ckpt, '--device=cpu', f'--out_dir={tmp_path / "probe"}')
    assert_refused(r, marker, 'builtins.exec')


def test_sample_refuses_a_checkpoint_holding_code(tmp_path):
    marker = tmp_path / 'ran'
    ckpt = torch_save(python(marker), tmp_path / 'ckpt.pt')
    assert_live(marker, lambda: torch.load(ckpt, weights_only=False))
    r = run('sample.py', f'--init_from={ckpt}', '--device=cpu', '--max_new_tokens=2')
    assert_refused(r, marker, 'exec')


@pytest.mark.parametrize('damage', ['junk', 'random', 'half'])
def test_damaged_checkpoints_are_not_called_code(tmp_path, damage):
    """torch reports bytes that are no pickle as a weights-only refusal too: those stay
    'truncated', not 'holds code'."""
    from probe import load_model
    path = tmp_path / 'ckpt.pt'
    good = torch_save({'n_layer': 1}, tmp_path / 'good.pt').read_bytes()
    path.write_bytes({'junk': b'not a checkpoint', 'random': bytes(range(256)) * 8,
                      'half': good[:len(good) // 2]}[damage])
    with pytest.raises(ValueError) as e:
        load_model(path)
    assert 'truncated' in str(e.value) and 'holds code' not in str(e.value), str(e.value)


# -----------------------------------------------------------------------------
# tools/convert.py: --to=hf, --from=hf

def test_convert_to_hf_refuses_a_checkpoint_holding_code(tmp_path):
    marker = tmp_path / 'ran'
    ckpt = pickle_dump(shell(marker), tmp_path / 'ckpt.pt')
    assert_live(marker, lambda: pickle.loads(ckpt.read_bytes()))
    r = run('tools/convert.py', '--to=hf', ckpt, f'--out={tmp_path / "hf"}')
    assert_refused(r, marker, 'posix.system')
    assert not (tmp_path / 'hf').exists()


LLAMA = {'model_type': 'llama', 'architectures': ['LlamaForCausalLM'], 'hidden_size': 8, 'num_attention_heads': 2,
         'num_hidden_layers': 1, 'intermediate_size': 16, 'vocab_size': 10}


def test_convert_from_hf_refuses_a_bin_holding_code(tmp_path):
    marker, d = tmp_path / 'ran', tmp_path / 'llama'
    d.mkdir()
    (d / 'config.json').write_text(json.dumps(LLAMA))
    torch.save({'model.embed_tokens.weight': torch.zeros(10, 8), 'lm_head.weight': shell(marker)},
               d / 'pytorch_model.bin')
    assert_live(marker, lambda: torch.load(d / 'pytorch_model.bin', weights_only=False))
    r = run('tools/convert.py', '--from=hf', d, f'--out={tmp_path / "out" / "ckpt.pt"}')
    assert_refused(r, marker, 'posix.system')
    assert not (tmp_path / 'out').exists()


def test_convert_from_hf_damaged_bin_is_one_line(tmp_path):
    """A truncated pytorch_model.bin: one line naming the file, no advice to load unsafely."""
    d = tmp_path / 'llama'
    d.mkdir()
    (d / 'config.json').write_text(json.dumps(LLAMA))
    buf = io.BytesIO()
    torch.save({'model.embed_tokens.weight': torch.randn(10, 8)}, buf)
    (d / 'pytorch_model.bin').write_bytes(buf.getvalue()[:len(buf.getvalue()) // 2])
    r = run('tools/convert.py', '--from=hf', d, f'--out={tmp_path / "out" / "ckpt.pt"}')
    assert r.returncode != 0 and 'Traceback' not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('error: ') and 'pytorch_model.bin' in lines[0], r.stderr
    assert 'truncated' in lines[0] and 'weights_only' not in lines[0]


# -----------------------------------------------------------------------------
# tools/convert.py --from=olmo_core: the study's .metadata and shards

def write_study_dir(tmp_path):
    """A study step dir: config.json + model_and_optim/ written by torch.distributed.checkpoint,
    with tensors of several dtypes, an AdamW state and non-tensor entries (as OLMo-core's)."""
    import torch.distributed.checkpoint as dcp
    step = tmp_path / 'run' / 'step10'
    step.mkdir(parents=True)
    (step / 'config.json').write_text('{}')
    lin = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(lin.parameters())
    lin(torch.randn(2, 4)).sum().backward()
    opt.step()
    model = {'embeddings.weight': torch.randn(5, 4), 'lm_head.w_out.weight': torch.randn(5, 4).bfloat16(),
             'counts': torch.arange(3), 'half': torch.ones(2, dtype=torch.float16)}
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        dcp.save({'model': model, 'optim': opt.state_dict(), 'extra': {'note': 'x', 'n': 3}},
                 storage_writer=dcp.FileSystemWriter(str(step / 'model_and_optim')), no_dist=True)
    return step, model


def read_own_metadata(step):
    with open(step / 'model_and_optim' / '.metadata', 'rb') as f:
        return pickle.load(f)  # written by this test: trusted


def write_metadata(step, md):
    with open(step / 'model_and_optim' / '.metadata', 'wb') as f:
        pickle.dump(md, f)


def test_convert_from_olmo_core_refuses_code_in_the_metadata(tmp_path):
    marker = tmp_path / 'ran'
    step, _ = write_study_dir(tmp_path)
    md = read_own_metadata(step)
    md.storage_meta.checkpoint_id = shell(marker)  # a real Metadata with one field that runs a command
    write_metadata(step, md)
    meta = step / 'model_and_optim' / '.metadata'
    assert_live(marker, lambda: pickle.loads(meta.read_bytes()))
    r = run('tools/convert.py', '--from=olmo_core', step.parent, f'--out={tmp_path / "out" / "ckpt.pt"}')
    assert_refused(r, marker, 'posix.system')
    assert '.metadata' in r.stderr


def test_convert_from_olmo_core_refuses_code_in_a_shard(tmp_path):
    marker = tmp_path / 'ran'
    step, _ = write_study_dir(tmp_path)
    buf = io.BytesIO()
    torch.save(shell(marker), buf)  # where a tensor should be
    (step / 'model_and_optim' / '__9_0.distcp').write_bytes(buf.getvalue())
    md = read_own_metadata(step)
    for index, info in md.storage_data.items():
        if index.fqn == 'model.embeddings.weight':
            info.relative_path, info.offset, info.length = '__9_0.distcp', 0, len(buf.getvalue())
    write_metadata(step, md)
    assert_live(marker, lambda: torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
    r = run('tools/convert.py', '--from=olmo_core', step.parent, f'--out={tmp_path / "out" / "ckpt.pt"}')
    assert_refused(r, marker, 'posix.system')


def test_metadata_allow_list_reads_what_torch_writes(tmp_path):
    """Every global of a real torch.distributed.checkpoint .metadata is allowed, and the
    tensors read back exactly."""
    step, model = write_study_dir(tmp_path)
    names = pickle_globals(step / 'model_and_optim' / '.metadata')
    assert 'torch.distributed.checkpoint.metadata.Metadata' in names and 'torch.Size' in names
    for name in names:
        module, _, attr = name.rpartition('.')
        convert._StudyUnpickler(io.BytesIO()).find_class(module, attr)  # raises RefusedGlobal if not allowed
    state, _ = convert.read_distcp(step / 'model_and_optim')
    assert set(state) == set(model)
    assert all(state[k].dtype == v.dtype and torch.equal(state[k], v) for k, v in model.items())


@dataclass
class _StorageInfo:
    """OLMo-core's storage record (olmo_core/distributed/checkpoint/filesystem.py): torch's
    fields without transform_descriptors, under OLMo-core's module name."""
    relative_path: str
    offset: int
    length: int


def test_olmo_core_storage_records_are_read_without_olmo_core(tmp_path, monkeypatch):
    step, model = write_study_dir(tmp_path)
    md = read_own_metadata(step)
    module = type(sys)('olmo_core.distributed.checkpoint.filesystem')
    _StorageInfo.__module__ = module.__name__
    module._StorageInfo = _StorageInfo
    md.storage_data = {k: _StorageInfo(v.relative_path, v.offset, v.length) for k, v in md.storage_data.items()}
    md.storage_meta.checkpoint_id = str(md.storage_meta.checkpoint_id)  # OLMo-core writes a str
    with monkeypatch.context() as m:  # importable while pickling, gone when reading
        for parent in ('olmo_core', 'olmo_core.distributed', 'olmo_core.distributed.checkpoint'):
            m.setitem(sys.modules, parent, type(sys)(parent))
        m.setitem(sys.modules, module.__name__, module)
        write_metadata(step, md)
    assert 'olmo_core' not in sys.modules
    assert 'olmo_core.distributed.checkpoint.filesystem._StorageInfo' in pickle_globals(
        step / 'model_and_optim' / '.metadata')
    state, _ = convert.read_distcp(step / 'model_and_optim')
    assert all(torch.equal(state[k], v) for k, v in model.items())


@pytest.mark.parametrize('module,name', [
    ('posix', 'system'), ('os', 'system'), ('builtins', 'exec'), ('builtins', 'getattr'), ('torch', 'load'),
    ('torch', 'tensor'), ('torch.serialization', 'load'), ('torch.distributed.checkpoint.metadata', 'field'),
    ('collections', 'namedtuple'), ('pathlib', 'Path'), ('olmo_core.train', 'Trainer'), ('subprocess', 'run')])
def test_metadata_unpickler_refuses_every_other_global(module, name):
    with pytest.raises(RefusedGlobal) as e:
        convert._StudyUnpickler(io.BytesIO()).find_class(module, name)
    assert e.value.name == f"{module}.{name}"


def test_metadata_shards_outside_the_directory_are_refused(tmp_path):
    step, _ = write_study_dir(tmp_path)
    md = read_own_metadata(step)
    next(iter(md.storage_data.values())).relative_path = '../../secret.distcp'
    write_metadata(step, md)
    with pytest.raises(ValueError, match="names the shard '../../secret.distcp', not a file of its directory"):
        convert.read_distcp(step / 'model_and_optim')
