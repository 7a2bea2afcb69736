"""
Checkpoints in and out of DepthBench's format (a train.py ckpt.pt: {'model': state dict,
'model_args': GPTConfig fields, 'config': {'tokenizer': ...}, ...}).

    # the study's released OLMo-core checkpoints (any of the ten schemes), a run dir or one step<N>/
    $ python tools/convert.py --from=olmo_core path/to/attnres-lr2e-3-llama-400M-L32-pretrain --out=out/attnres_L32/ckpt.pt
    # any local HuggingFace LlamaForCausalLM directory (MHA or GQA, tied or untied) -> Pre-LN
    $ python tools/convert.py --from=hf path/to/TinyLlama --out=out/tinyllama/ckpt.pt
    # a Pre-LN checkpoint -> transformers directory (config.json + model.safetensors)
    $ python tools/convert.py --to=hf out/preln/ckpt.pt --out=out/preln_hf

The study's checkpoints (OLMo-core, keyu-wang-2002/DepthBench) are torch.distributed
checkpoints: <dir>/config.json (the experiment config: 'model', 'dataset', ...) and
<dir>/model_and_optim/ (*.distcp shards + .metadata, top-level keys 'model' and 'optim').
The scheme and shape come from config.json's model.block (name, attnres_block_size,
hyper_connections); every tensor is then mapped by name (`study_layout`) and checked
for shape, and the result must hold exactly the parameters of our model. Reading uses
torch.distributed.checkpoint's reader with OLMo-core's storage records mapped onto
torch's (torch's plain reader fails on them: `_StorageInfo ... transform_descriptors`).
Nothing in a checkpoint runs: .metadata is read by an allow-list unpickler (the metadata
classes only), every tensor with torch.load(weights_only=True); a file that names any other
function or class is refused in one line that names it (tools/untrusted.py).

Pre-LN is exactly LlamaForCausalLM (RMSNorm, RoPE on half-split pairs, SwiGLU, no
biases), so that bridge is one rename per tensor; tied embeddings are imported as two
equal matrices (the logits are the same; a further training run would untie them).

Every failure is one line (SystemExit from main, ValueError from the functions) naming
the key and the fix; outputs are written to a temporary name, fsynced and renamed, so
nothing half-written is ever left behind. An imported checkpoint is written by
checkpoint.save_checkpoint, sealed with its sha256 like train.py's; an exported one is read
verified (--allow_unsealed=True reads one without a seal).
"""

import argparse
import json
import math
import os
import pickle
import tempfile
import warnings
from dataclasses import asdict, fields
from pathlib import Path

import torch

import sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, when run as a script
import checkpoint  # noqa: E402
from model import GPT, GPTConfig
from tools.untrusted import RefusedGlobal, describe_load_error

# -----------------------------------------------------------------------------
# the study's layout: block kinds and key names (OLMo-core nn/transformer/{block,model,config}.py,
# nn/hyper_connections.py, nn/moda.py of keyu-wang-2002/DepthBench)

# config.json model.block.name (after the study's own normalisation) -> our residual scheme
BLOCK_KINDS = {
    'default': 'preln', 'default_scaled': 'lns', 'peri_norm': 'sandwich', 'deepnorm': 'deepnorm',
    'keel': 'keel', 'attnres': 'attnres', 'hc': 'hc', 'mhc': 'mhc', 'moda': 'moda',
}
BLOCK_ALIASES = {'attn_res': 'attnres', 'liger_mhc': 'mhc', 'sandwich': 'peri_norm'}
MHC_BACKENDS = ('mhc', 'liger_mhc')  # hyper_connections.kind of an mHC block we can read

ATTN = {'w_q': 'wq', 'w_k': 'wk', 'w_v': 'wv', 'w_out': 'wo'}
MLP = {'w1': 'w_gate', 'w3': 'w_up', 'w2': 'w_down'}  # SwiGLU: w2(silu(w1 x) * w3 x)
HC_NAMES = {'static_alpha': 'static_alpha', 'dynamic_alpha_proj': 'dynamic_alpha',
            'dynamic_alpha_scale': 'alpha_scale', 'static_beta': 'static_beta',
            'dynamic_beta_proj': 'dynamic_beta', 'dynamic_beta_scale': 'beta_scale'}
SIDE = {'attention': 'attn', 'feed_forward': 'mlp'}  # the study's sublayer names -> ours


def same(x):
    return x


class Entry:
    """One parameter of ours and the study tensors it is made of:
    ours = to_ours(*study tensors), study tensors = to_study(ours)."""

    def __init__(self, ours, study, to_ours=same, to_study=None):
        self.ours, self.study = ours, list(study) if isinstance(study, (list, tuple)) else [study]
        self.to_ours = to_ours
        self.to_study = to_study or (lambda t: [t])


def res_perm(m):
    """Index permutation between H_res stored (out, in) (Liger) and (in, out) (ours), row-major
    m x m: perm[s*m + t] = t*m + s (its own inverse)."""
    return torch.arange(m * m).view(m, m).t().reshape(-1)


def mhc_entries(p, q, m, backend):
    """mHC routing of one sublayer: study prefix p (…_hyper_connection), our prefix q (…_route).
    Ours: phi (m d, m^2 + 2m) and bias, columns [pre | post | res (in, out) row-major]."""
    gates = [Entry(f'{q}.alpha_{n}', f'{p}.{g}') for n, g in
             (('pre', 'pre_gate'), ('post', 'post_gate'), ('res', 'residual_gate'))]
    if backend == 'liger_mhc':  # phi, b with H_res (out, in); gates alpha_*
        cols = torch.cat([torch.arange(2 * m), 2 * m + res_perm(m)])
        return [Entry(f'{q}.phi', f'{p}.phi', lambda t: t[:, cols], lambda t: [t[:, cols]]),
                Entry(f'{q}.bias', f'{p}.b', lambda t: t[cols], lambda t: [t[cols]])] + \
               [Entry(f'{q}.alpha_{n}', f'{p}.alpha_{n}') for n in ('pre', 'post', 'res')]
    # plain backend: separate projections (in, out) and biases, as ours but not fused
    return [Entry(f'{q}.phi', [f'{p}.pre_dynamic_proj', f'{p}.post_dynamic_proj', f'{p}.residual_dynamic_proj'],
                  lambda a, b, c: torch.cat([a, b, c], dim=1), lambda t: list(t.split([m, m, m * m], dim=1))),
            Entry(f'{q}.bias', [f'{p}.pre_bias', f'{p}.post_bias', f'{p}.residual_bias'],
                  lambda a, b, c: torch.cat([a, b, c.reshape(-1)]),
                  lambda t: [t[:m], t[m:2 * m], t[2 * m:].view(m, m)])] + gates


def study_layout(cfg, kind, hc_backend='hc'):
    """The study's parameters of a model `cfg` with block kind `kind` (a BLOCK_KINDS key):
    (entries, aliases). entries: the Entry list covering every parameter of ours; aliases:
    {study key: the study key it duplicates} (the HC/mHC connectors hold their branch's norm,
    attention and feed-forward as submodules, so a state dict may list them twice), plus
    study keys that are never read (value None: MoDA's last W_kv, whose slot is never read)."""
    L, m = cfg.n_layer, cfg.hc_streams
    entries = [Entry('wte.weight', 'embeddings.weight'), Entry('lm_head.weight', 'lm_head.w_out.weight'),
               Entry('norm_f.weight', 'lm_head.norm.weight')]
    aliases = {}
    moda = kind == 'moda'
    for i in range(L):
        blk, res = f'blocks.{i}', f'residual.layers.{i}'
        attn = f'{blk}.attention.attention' if moda else f'{blk}.attention'     # MoDA wraps the modules
        ffn = f'{blk}.feed_forward.feed_forward' if moda else f'{blk}.feed_forward'
        entries += [Entry(f'blocks.{i}.attn.{o}.weight', f'{attn}.{s}.weight') for s, o in ATTN.items()]
        entries += [Entry(f'blocks.{i}.mlp.{o}.weight', f'{ffn}.{s}.weight') for s, o in MLP.items()]
        pre = {'attn': f'{blk}.attention_norm.weight', 'mlp': f'{blk}.feed_forward_norm.weight'}
        post = {'attn': f'{blk}.post_attention_norm.weight', 'mlp': f'{blk}.post_feed_forward_norm.weight'}
        if kind == 'deepnorm':  # Post-LN: the block's two norms follow the residual adds
            entries += [Entry(f'{res}.{s}_post_norm.weight', pre[s]) for s in ('attn', 'mlp')]
            continue
        entries += [Entry(f'{res}.{s}_norm.weight', pre[s]) for s in ('attn', 'mlp')]
        if kind in ('peri_norm', 'keel'):
            entries += [Entry(f'{res}.{s}_out_norm.weight', post[s]) for s in ('attn', 'mlp')
                        if not (kind == 'keel' and i == 0 and s == 'attn')]  # KEEL block 0: plain Pre-LN attention
        if kind == 'attnres':
            # the study's block i+1 attn_res_* read block i's output (ours: layers[i].out_mix);
            # the last block's output is read by the model-level res_proj / res_norm
            nxt = f'blocks.{i + 1}.attn_res' if i < L - 1 else 'res'
            q = lambda t: t.reshape(-1)                       # Linear(d, 1).weight (1, d) -> (d,)
            qs = lambda t: [t.reshape(1, -1)]
            entries += [Entry(f'{res}.mlp_mix.query', f'{blk}.mlp_res_proj.weight', q, qs),
                        Entry(f'{res}.mlp_mix.key_norm.weight', f'{blk}.mlp_res_norm.weight'),
                        Entry(f'{res}.out_mix.query', f'{nxt}_proj.weight', q, qs),
                        Entry(f'{res}.out_mix.key_norm.weight', f'{nxt}_norm.weight')]
        if kind in ('hc', 'mhc'):
            for side, s in SIDE.items():
                p, q = f'{blk}.{side}_hyper_connection', f'{res}.{s}_route'
                if kind == 'hc':
                    entries += [Entry(f'{q}.{o}', f'{p}.{n}') for n, o in HC_NAMES.items()]
                else:
                    entries += mhc_entries(p, q, m, hc_backend)
                aliases[f'{p}.branch.norm.weight'] = pre[s]
                names = ATTN if side == 'attention' else MLP
                aliases.update({f'{p}.branch.{side}.{n}.weight': f'{blk}.{side}.{n}.weight' for n in names})
        if moda:
            if i < L - 1:  # (2 H_kv hd, d): rows [K heads | V heads], as ours
                entries.append(Entry(f'{res}.depth_kv.weight', f'{blk}.feed_forward.kv_proj.weight'))
            else:
                aliases[f'{blk}.feed_forward.kv_proj.weight'] = None
    return entries, aliases


# -----------------------------------------------------------------------------
# the study's config.json -> GPTConfig

def get(d, *path, default=KeyError):
    """d[path[0]][path[1]]..., or `default` (KeyError: raise a one-line ValueError)."""
    for k in path:
        if not isinstance(d, dict) or d.get(k) is None:
            if default is KeyError:
                raise ValueError(f"config.json has no {'.'.join(path)}: is it an OLMo-core experiment config?")
            return default
        d = d[k]
    return d


def study_block(config):
    """config.json's model.block after the study's own normalisation (its analysis loader):
    returns (block dict, block kind, hc backend). Raises ValueError for a kind we do not have."""
    block = dict(get(config, 'model', 'block'))
    raw = str(block.get('name', 'default'))
    name = BLOCK_ALIASES.get(raw, raw)
    hyper = block.get('hyper_connections') or {}
    if name == 'default' and hyper:  # HC/mHC checkpoints written before the block kinds existed
        name = 'hc' if hyper.get('kind', 'hc') == 'hc' else 'mhc'
    if name == 'default' and block.get('attnres_block_size') is not None:
        name = 'attnres'
    if name not in BLOCK_KINDS:
        raise ValueError(f"config.json model.block.name = {block.get('name')!r} is not one of the study's ten "
                         f"schemes we read ({', '.join(BLOCK_KINDS)}); convert a checkpoint of one of those")
    backend = str(hyper.get('kind', raw if raw in ('hc', 'mhc', 'liger_mhc') else 'hc'))
    if name == 'mhc' and backend not in MHC_BACKENDS:
        raise ValueError(f"mHC backend hyper_connections.kind = {backend!r} is not supported "
                         f"(only {' / '.join(MHC_BACKENDS)}: mhc_static has no dynamic routing)")
    if name == 'hc' and backend != 'hc':
        raise ValueError(f"an 'hc' block needs hyper_connections.kind = 'hc', got {backend!r}")
    # HyperConnectionsConfig options whose other values our HC / mHC do not have
    for key, ours in (('sinkhorn_tau', 1.0), ('liger_pre_eps', 0.0), ('liger_post_mult', 2.0)):
        if key in hyper and float(hyper[key]) != ours:
            raise ValueError(f"hyper_connections.{key} = {hyper[key]} is not supported (ours: {ours})")
    tanh = hyper.get('tanh')
    if tanh is not None and bool(tanh) != (name == 'hc'):
        raise ValueError(f"hyper_connections.tanh = {tanh} is not our {name}'s form "
                         f"({'with' if name == 'hc' else 'without'} tanh on the dynamic projection)")
    return block, name, backend


def config_from_study(config, state):
    """GPTConfig of a study checkpoint: scheme and heads, RoPE theta, norm eps from config.json,
    widths from the tensors (cross-checked). Raises ValueError on a mismatch."""
    block, kind, backend = study_block(config)
    mixer = block.get('sequence_mixer') or block.get('attention') or {}
    if 'embeddings.weight' not in state:
        raise ValueError("the checkpoint has no model.embeddings.weight: is it an OLMo-core model checkpoint?")
    V, d = state['embeddings.weight'].shape
    L = int(get(config, 'model', 'n_layers'))
    for what, want in (('d_model', d), ('vocab_size', V)):
        have = get(config, 'model', what, default=want)
        if int(have) != want:
            raise ValueError(f"config.json model.{what} = {have} but embeddings.weight is {tuple(state['embeddings.weight'].shape)}: "
                             f"config.json belongs to another checkpoint")
    # options that change the forward without leaving a tensor behind: refused by name
    for where, key in ((config['model'], 'embed_scale'), (mixer, 'clip_qkv'), (mixer, 'window_size'),
                       (mixer, 'sliding_window'), (mixer, 'softmax_scale')):
        if where.get(key) is not None:
            raise ValueError(f"config.json sets {key} = {where[key]!r}: not in our backbone, so this checkpoint "
                             f"cannot be converted exactly")
    for i, over in (get(config, 'model', 'block_overrides', default={}) or {}).items():
        name = BLOCK_ALIASES.get(str(over.get('name', block.get('name'))), str(over.get('name', block.get('name'))))
        if name != kind and not (kind in ('hc', 'mhc', 'attnres') and name == 'default'):
            raise ValueError(f"model.block_overrides makes block {i} a {name!r} block in a {kind!r} model: "
                             f"mixed block kinds are not supported")
    n_head = int(get(mixer, 'n_heads'))
    n_kv = int(mixer.get('n_kv_heads') or n_head)
    eps = float(get(block, 'layer_norm', 'eps', default=1e-5))       # OLMo-core LayerNormConfig default
    head_eps = float(get(config, 'model', 'lm_head', 'layer_norm', 'eps', default=eps))
    if head_eps != eps:
        raise ValueError(f"the final norm's eps {head_eps} differs from the blocks' {eps}: our models use one norm_eps")
    # LayerNormType: 'default' is LayerNorm (the study's DeepNorm, examples/pretrain_deepnorm.py), 'rms' RMSNorm
    norm = str(get(block, 'layer_norm', 'name', default='default' if kind == 'deepnorm' else 'rms'))
    if norm not in (('default',) if kind == 'deepnorm' else ('rms', 'fused_rms')):
        raise ValueError(f"model.block.layer_norm.name = {norm!r}: our {BLOCK_KINDS[kind]} uses "
                         f"{'LayerNorm' if kind == 'deepnorm' else 'RMSNorm'} (gain only)")
    rope = mixer.get('rope') or {}
    if rope.get('scaling') is not None:
        raise ValueError("RoPE scaling (sequence_mixer.rope.scaling) is not supported: our RoPE is the plain one")
    ffn = state.get('blocks.0.feed_forward.w1.weight', state.get('blocks.0.feed_forward.feed_forward.w1.weight'))
    kw = dict(vocab_size=V, n_embd=d, n_layer=L, n_head=n_head, n_kv_head=n_kv,
              ffn_hidden=ffn.shape[0] if ffn is not None else None, norm_eps=eps,
              rope_theta=float(rope.get('theta', 500000.0)),                  # OLMo-core RoPEConfig default
              block_size=int(get(config, 'dataset', 'sequence_length', default=4096)),
              residual=BLOCK_KINDS[kind])
    if kind == 'attnres':  # block size S sublayers per AttnRes block; S = 1 is Full AttnRes
        S = int(block.get('attnres_block_size') or 1)
        if S > 1:
            if (2 * L) % S:
                raise ValueError(f"attnres_block_size = {S} does not divide the 2L = {2 * L} sublayers; "
                                 f"our Block AttnRes needs whole blocks")
            kw.update(residual='blockattnres', attnres_blocks=2 * L // S)
    if kind in ('hc', 'mhc'):
        hyper = block.get('hyper_connections') or {}
        kw.update(hc_streams=int(hyper.get('num_residual_streams', 4)),
                  mhc_sinkhorn_iters=int(hyper.get('sinkhorn_iters', 20)))
        collapse = hyper.get('collapse', 'auto')  # the study's reduce_mode: 'mean' for Liger mHC, else 'sum'
        reduce = ('mean' if backend == 'liger_mhc' else 'sum') if collapse == 'auto' else collapse
        # the study's 'sum' collapse puts lm_head.norm on each stream and sums; 'mean' norms the mean
        kw['hc_readout'] = {'sum': 'norm_sum', 'mean': 'mean'}[reduce]
    if kind == 'moda':
        moda = block.get('moda') or {}
        if moda.get('attention_scale') not in (None, 1.0 / math.sqrt(d // n_head)):
            raise ValueError(f"moda.attention_scale = {moda['attention_scale']} is not 1/sqrt(head_dim): not supported")
    names = {f.name for f in fields(GPTConfig)}
    if 'hc_readout' in kw and 'hc_readout' not in names:
        kw.pop('hc_readout')  # a model.py without a choice of readout: its own
    if 'attnres_eps' in names and kind == 'attnres':
        kw['attnres_eps'] = 1e-5  # the study's AttnRes norms are LayerNormConfig(rms) defaults
    return GPTConfig(**kw), kind, backend


# -----------------------------------------------------------------------------
# mapping state dicts

def moda_name(k):
    """blocks.i.attention.w_q.weight -> blocks.i.attention.attention.w_q.weight (MoDAAttention's inner
    module), blocks.i.feed_forward.w1.weight -> blocks.i.feed_forward.feed_forward.w1.weight."""
    parts = k.split('.')
    if len(parts) == 5 and parts[0] == 'blocks' and (parts[2], parts[3]) in \
            [('attention', n) for n in ATTN] + [('feed_forward', n) for n in MLP]:
        return '.'.join(parts[:3] + parts[2:])
    return k


def from_study(state, cfg, kind, backend='hc'):
    """The study's tensors {key: tensor} (without the 'model.' prefix) -> our state dict, fp32.
    Raises ValueError naming the first missing, unknown or mis-shaped key."""
    entries, aliases = study_layout(cfg, kind, backend)
    known = {k for e in entries for k in e.study}
    # wrapper segments (torch.compile, activation checkpointing) are not part of a name
    state = {k.replace('_orig_mod.', '').replace('_checkpoint_wrapped_module.', ''): v for k, v in state.items()}
    if kind == 'moda':  # MoDA wraps the block's attention and feed-forward: accept the unwrapped names too
        state = {moda_name(k) if moda_name(k) in known and moda_name(k) not in state else k: v
                 for k, v in state.items()}
    for k in sorted(state):
        if k not in known and k not in aliases:
            raise ValueError(f"unknown key {k} in the study's checkpoint: our {cfg.residual} has no such "
                             f"parameter (biases, qk-norm, embedding norm and other options are not supported); "
                             f"check config.json's model.block matches the weights")
    for k in sorted(known):
        if k not in state:
            raise ValueError(f"missing key {k} in the study's checkpoint (block kind {kind!r}): "
                             f"the checkpoint is incomplete or config.json names another block kind")
    for k, src in aliases.items():  # duplicated submodules must be the same tensor
        if k in state and src is not None and not torch.equal(state[k], state[src]):
            raise ValueError(f"key {k} differs from {src}, which it duplicates: the checkpoint is inconsistent")
    with torch.device('meta'):
        want = GPT(cfg).state_dict()
    out = {}
    for e in entries:
        t = e.to_ours(*[state[k].float() for k in e.study])
        if e.ours not in want:
            raise ValueError(f"our {cfg.residual} has no parameter {e.ours}: model.py / residuals.py changed; update convert.py")
        if tuple(t.shape) != tuple(want[e.ours].shape):
            raise ValueError(f"shape mismatch at {' + '.join(e.study)}: {tuple(state[e.study[0]].shape)} gives "
                             f"{tuple(t.shape)}, our {e.ours} is {tuple(want[e.ours].shape)}; "
                             f"check config.json (n_heads, n_kv_heads, num_residual_streams) against the weights")
        out[e.ours] = t.contiguous().clone()
    missing = set(want) - set(out)
    if missing:
        raise ValueError(f"convert.py maps no study key onto our {sorted(missing)[0]}: update study_layout")
    return out


def to_study(state, cfg, kind, backend='hc', with_aliases=False):
    """Our state dict -> the study's tensors under its key names (the inverse of from_study;
    used to write the study's layout in tests). with_aliases also writes the duplicated
    HC/mHC branch keys a study state dict carries."""
    entries, aliases = study_layout(cfg, kind, backend)
    out = {}
    for e in entries:
        for k, t in zip(e.study, e.to_study(state[e.ours])):
            out[k] = t.contiguous().clone()
    if with_aliases:
        out.update({k: out[src].clone() for k, src in aliases.items() if src is not None})
    return out


# -----------------------------------------------------------------------------
# reading OLMo-core distributed checkpoints

# every global the .metadata of a torch.distributed checkpoint pickles (torch's FileSystemWriter
# and OLMo-core's RemoteFileSystemWriter): the metadata dataclasses, torch.Size, the storage
# record, a layout by name, and the checkpoint's path. Dtypes (torch.float32, ...) are
# allowed by type. Nothing else is ever imported: a file naming os.system is refused unrun.
DCP_METADATA = 'torch.distributed.checkpoint.metadata'
DCP_GLOBALS = {(DCP_METADATA, n) for n in ('Metadata', 'TensorStorageMetadata', 'BytesStorageMetadata',
                                           'ChunkStorageMetadata', 'TensorProperties', 'MetadataIndex',
                                           'StorageMeta', '_MEM_FORMAT_ENCODING')} | {
    ('torch.distributed.checkpoint.filesystem', '_StorageInfo'), ('torch', 'Size'),
    ('torch.serialization', '_get_layout'), ('collections', 'OrderedDict')}
PATH_CLASSES = ('PosixPath', 'WindowsPath', 'PurePosixPath', 'PureWindowsPath')  # StorageMeta.checkpoint_id


class _StudyUnpickler(pickle.Unpickler):
    """Reads a torch.distributed checkpoint's .metadata (torch's or OLMo-core's) without running
    anything in it: find_class returns only the classes of DCP_GLOBALS, torch dtypes and layouts,
    a pure path for the checkpoint id, and torch's _StorageInfo for OLMo-core's storage record
    (the same fields under OLMo-core's class name); any other global raises RefusedGlobal."""

    def find_class(self, module, name):
        import torch.distributed.checkpoint.filesystem  # noqa: F401 (DCP_GLOBALS' modules)
        import torch.distributed.checkpoint.metadata  # noqa: F401
        if module.startswith('olmo_core.') and name == '_StorageInfo':
            from torch.distributed.checkpoint.filesystem import _StorageInfo
            return _StorageInfo
        if (module, name) in DCP_GLOBALS:
            return getattr(sys.modules[module], name)
        if module == 'torch' and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        if module in ('pathlib', 'pathlib._local') and name in PATH_CLASSES:
            import pathlib  # a pure path: a name only, whichever system wrote it
            return pathlib.PureWindowsPath if 'Windows' in name else pathlib.PurePosixPath
        raise RefusedGlobal(f"{module}.{name}")


class MetadataError(ValueError):
    """A .metadata that unpickles to something no checkpoint holds (one line)."""


def _torch_reader(path):
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
            with open(os.path.join(self.path, '.metadata'), 'rb') as f:
                md = _StudyUnpickler(f).load()
            if not isinstance(md, Metadata):
                raise MetadataError(f"{self.path}/.metadata holds a {type(md).__name__}, not a checkpoint's Metadata")
            for info in (md.storage_data or {}).values():  # shards are files of this directory
                rel = getattr(info, 'relative_path', None)
                if not isinstance(rel, str) or rel in ('', '.', '..') or os.path.basename(rel) != rel:
                    raise MetadataError(f"{self.path}/.metadata names the shard {rel!r}, not a file of its directory")
            if getattr(md, 'storage_meta', None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md
    return Reader(path)


def read_distcp(path, prefix='model.'):
    """The tensors under `prefix` of a torch.distributed checkpoint directory (OLMo-core's
    model_and_optim/), unsharded on CPU: ({key without prefix: tensor}, reader used).
    torch's reader with the allow-list unpickler for .metadata; the shards' tensors are read
    with torch.load(weights_only=True). (ai2-olmo-core's own reader unpickles both without
    a list, so it is never used.) Raises ValueError in one line."""
    path = str(path)
    if not os.path.isfile(os.path.join(path, '.metadata')):
        raise ValueError(f"{path} has no .metadata: not a torch.distributed checkpoint directory (model_and_optim/)")
    warnings.filterwarnings('ignore', message='torch.distributed is disabled')  # one process, as intended
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    try:
        md = _torch_reader(path).read_metadata()
    except MetadataError:
        raise
    except Exception as e:
        meta = os.path.join(path, '.metadata')
        raise ValueError(describe_load_error(e, meta) or f"{meta} cannot be read ({type(e).__name__}): "
                         f"truncated or not a torch.distributed checkpoint; download it again") from None
    try:
        state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
                 if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)}
    except (AttributeError, TypeError, ValueError, RuntimeError) as e:  # the right classes, wrong contents
        raise ValueError(f"{path}/.metadata does not describe tensors ({type(e).__name__}): "
                         f"not a torch.distributed checkpoint; download it again") from None
    if not state:
        raise ValueError(f"{path} holds no tensors under {prefix!r}: not an OLMo-core model checkpoint")
    try:
        dcp.load(state, storage_reader=_torch_reader(path), no_dist=True)
    except (Exception, CheckpointException) as e:  # CheckpointException: a BaseException wrapping the reader's
        inner = next((f[0] for f in e.failures.values()), e) if isinstance(e, CheckpointException) else e
        first = str(inner).splitlines()[0] if str(inner) else ''
        raise ValueError(describe_load_error(e, path) or f"cannot read the shards of {path} "
                         f"({type(inner).__name__}{': ' + first if first else ''}): truncated or incomplete; download it again") from None
    return {k[len(prefix):]: v for k, v in state.items()}, 'torch.distributed.checkpoint'


def find_study_dir(path):
    """A study checkpoint dir (config.json + model_and_optim/) from itself or a run dir
    (its latest step<N>/). Raises ValueError when neither."""
    path = Path(path)
    if path.name == 'model_and_optim':
        path = path.parent
    if (path / 'config.json').is_file() and (path / 'model_and_optim').is_dir():
        return path
    steps = []
    for child in path.glob('step*'):
        if child.name[4:].isdigit() and (child / 'config.json').is_file() and (child / 'model_and_optim').is_dir():
            steps.append((int(child.name[4:]), child))
    if not steps:
        raise ValueError(f"{path} holds neither config.json + model_and_optim/ nor step<N>/ checkpoints: "
                         f"pass a run directory of the study (e.g. a downloaded aspect-ratio-scaling repo)")
    return max(steps)[1]


def find_tokenizer(ckpt_dir, config):
    """The study's tokenizer.json beside a checkpoint (tokenizer/ in the step or run dir), else
    the one config.json names if it exists here; None when none is found."""
    for d in (ckpt_dir, ckpt_dir.parent):
        if (d / 'tokenizer' / 'tokenizer.json').is_file():
            return str((d / 'tokenizer' / 'tokenizer.json').resolve())
    ident = get(config, 'dataset', 'tokenizer', 'identifier', default=None)
    if isinstance(ident, str) and ident.endswith('.json') and os.path.isfile(ident):
        return str(Path(ident).resolve())
    return None


def load_olmo_core(path, tokenizer=None):
    """A study run/step directory -> (our checkpoint dict, message). Raises ValueError."""
    ckpt_dir = find_study_dir(path)
    try:
        config = json.loads((ckpt_dir / 'config.json').read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{ckpt_dir / 'config.json'} is not valid JSON ({e.msg} at line {e.lineno})") from None
    state, reader = read_distcp(ckpt_dir / 'model_and_optim')
    cfg, kind, backend = config_from_study(config, state)
    model_state = from_study(state, cfg, kind, backend)
    tok = tokenizer or find_tokenizer(ckpt_dir, config)
    step = int(ckpt_dir.name[4:]) if ckpt_dir.name.startswith('step') and ckpt_dir.name[4:].isdigit() else None
    ckpt = {'model': model_state, 'model_args': asdict(cfg), 'iter_num': step,
            # vocab_size: the embedding's rows, set by the weights (padded past the tokenizer), not by data
            'config': {'tokenizer': tok, 'vocab_size': cfg.vocab_size,
                       'converted_from': str(ckpt_dir.resolve()), 'source': 'olmo_core',
                       'block': kind if kind != 'mhc' else backend}}
    msg = (f"{ckpt_dir}: block {kind}{'/' + backend if kind == 'mhc' else ''} -> {cfg.residual}, L={cfg.n_layer}, d={cfg.n_embd}, "
           f"heads {cfg.n_head}/{cfg.n_kv_head}, vocab {cfg.vocab_size}, read with {reader}; "
           f"tokenizer {tok or 'not found (pass --tokenizer=path/to/tokenizer.json)'}")
    return ckpt, msg


# -----------------------------------------------------------------------------
# HuggingFace Llama

def hf_layout(cfg):
    """(our key, transformers LlamaForCausalLM key) for every parameter of a Pre-LN model."""
    pairs = [('wte.weight', 'model.embed_tokens.weight'), ('norm_f.weight', 'model.norm.weight'),
             ('lm_head.weight', 'lm_head.weight')]
    for i in range(cfg.n_layer):
        h = f'model.layers.{i}'
        pairs += [(f'blocks.{i}.attn.{o}.weight', f'{h}.self_attn.{n}_proj.weight')
                  for o, n in (('wq', 'q'), ('wk', 'k'), ('wv', 'v'), ('wo', 'o'))]
        pairs += [(f'blocks.{i}.mlp.{o}.weight', f'{h}.mlp.{n}_proj.weight')
                  for o, n in (('w_gate', 'gate'), ('w_up', 'up'), ('w_down', 'down'))]
        pairs += [(f'residual.layers.{i}.attn_norm.weight', f'{h}.input_layernorm.weight'),
                  (f'residual.layers.{i}.mlp_norm.weight', f'{h}.post_attention_layernorm.weight')]
    return pairs


def read_hf_weights(d):
    """All tensors of a transformers directory: model.safetensors, sharded safetensors
    (model.safetensors.index.json) or pytorch_model.bin."""
    d = Path(d)
    files = sorted(d.glob('*.safetensors'))
    if files:  # safetensors holds tensors and a JSON header only: nothing in it can run
        from safetensors.torch import load_file
        out = {}
        for f in files:
            try:
                out.update(load_file(str(f)))
            except Exception as e:
                raise ValueError(f"{f} cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}): "
                                 f"truncated or not a safetensors file; download it again") from None
        return out
    bins = sorted(d.glob('pytorch_model*.bin'))
    if bins:
        out = {}
        for f in bins:
            try:
                w = torch.load(f, map_location='cpu', weights_only=True)
            except Exception as e:
                raise ValueError(describe_load_error(e, f) or f"{f} cannot be read ({type(e).__name__}): truncated "
                                 f"or not a torch file; download it again") from None
            if not isinstance(w, dict) or not all(isinstance(v, torch.Tensor) for v in w.values()):
                raise ValueError(f"{f} is not a state dict of tensors: not a transformers weights file")
            out.update(w)
        return out
    raise ValueError(f"{d} has no model.safetensors or pytorch_model.bin: download the weights too")


def load_hf(d, tokenizer=None):
    """A local LlamaForCausalLM directory -> (our Pre-LN checkpoint dict, message). Raises ValueError."""
    d = Path(d)
    if not (d / 'config.json').is_file():
        raise ValueError(f"{d} has no config.json: pass a transformers model directory")
    c = json.loads((d / 'config.json').read_text())
    if c.get('model_type') != 'llama' and 'LlamaForCausalLM' not in (c.get('architectures') or []):
        raise ValueError(f"{d} is a {c.get('model_type')!r} model; only LlamaForCausalLM (model_type 'llama') "
                         f"is exactly our Pre-LN")
    for key, ok in (('attention_bias', False), ('mlp_bias', False), ('hidden_act', 'silu')):
        if c.get(key, ok) != ok:
            raise ValueError(f"config.json {key} = {c[key]!r}: our Pre-LN needs {ok!r}")
    rope = c.get('rope_parameters') or {}
    if c.get('rope_scaling') or rope.get('rope_type', 'default') != 'default':
        raise ValueError(f"RoPE scaling {c.get('rope_scaling') or rope} is not supported: our RoPE is the plain one")
    theta = float(rope.get('rope_theta', c.get('rope_theta', 10000.0)))
    d_model, n_head = int(c['hidden_size']), int(c['num_attention_heads'])
    if int(c.get('head_dim') or d_model // n_head) != d_model // n_head:
        raise ValueError(f"head_dim = {c['head_dim']} is not hidden_size / num_attention_heads: not supported")
    cfg = GPTConfig(vocab_size=int(c['vocab_size']), n_embd=d_model, n_layer=int(c['num_hidden_layers']),
                    n_head=n_head, n_kv_head=int(c.get('num_key_value_heads') or n_head),
                    ffn_hidden=int(c['intermediate_size']), norm_eps=float(c.get('rms_norm_eps', 1e-6)),
                    rope_theta=theta, block_size=int(c.get('max_position_embeddings', 2048)), residual='preln')
    w = {k.removeprefix('_orig_mod.'): v for k, v in read_hf_weights(d).items()}
    tied = bool(c.get('tie_word_embeddings', False)) or 'lm_head.weight' not in w
    if tied and 'lm_head.weight' not in w:
        w['lm_head.weight'] = w['model.embed_tokens.weight']  # tied: one matrix, imported as two equal ones
    pairs = hf_layout(cfg)
    known = {h for _, h in pairs}
    for k in sorted(w):
        if k not in known and not k.endswith('rotary_emb.inv_freq'):
            raise ValueError(f"unknown key {k} in {d}: not a plain LlamaForCausalLM parameter (biases? another architecture?)")
    with torch.device('meta'):
        want = GPT(cfg).state_dict()
    state = {}
    for ours, h in pairs:
        if h not in w:
            raise ValueError(f"missing key {h} in {d}: the weights are incomplete")
        if tuple(w[h].shape) != tuple(want[ours].shape):
            raise ValueError(f"shape mismatch at {h}: {tuple(w[h].shape)}, config.json implies {tuple(want[ours].shape)}")
        state[ours] = w[h].float().contiguous().clone()
    tok = tokenizer or (str((d / 'tokenizer.json').resolve()) if (d / 'tokenizer.json').is_file() else None)
    ckpt = {'model': state, 'model_args': asdict(cfg), 'iter_num': None,
            'config': {'tokenizer': tok, 'vocab_size': cfg.vocab_size, 'converted_from': str(d.resolve()),
                       'source': 'hf'}}
    msg = (f"{d}: LlamaForCausalLM -> preln, L={cfg.n_layer}, d={cfg.n_embd}, heads {cfg.n_head}/{cfg.n_kv_head}, "
           f"theta {theta:g}, eps {cfg.norm_eps:g}, {'tied' if tied else 'untied'} embeddings; "
           f"tokenizer {tok or 'not found (pass --tokenizer)'}")
    return ckpt, msg


def hf_config(cfg):
    """config.json of a transformers LlamaForCausalLM equal to our Pre-LN `cfg`."""
    return {'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', 'vocab_size': cfg.vocab_size,
            'hidden_size': cfg.n_embd, 'intermediate_size': cfg.ffn_hidden, 'num_hidden_layers': cfg.n_layer,
            'num_attention_heads': cfg.n_head, 'num_key_value_heads': cfg.n_kv_head,
            'head_dim': cfg.n_embd // cfg.n_head, 'hidden_act': 'silu',
            'max_position_embeddings': cfg.block_size, 'rms_norm_eps': cfg.norm_eps,
            'rope_theta': cfg.rope_theta, 'rope_parameters': {'rope_type': 'default', 'rope_theta': cfg.rope_theta},
            'tie_word_embeddings': False, 'attention_bias': False, 'attention_dropout': 0.0, 'mlp_bias': False,
            'initializer_range': cfg.init_std, 'torch_dtype': 'float32', 'use_cache': True}


def export_hf(ckpt_path, out_dir, unsealed=False):
    """Our Pre-LN checkpoint -> out_dir/{config.json, model.safetensors} (+ tokenizer.json when the
    checkpoint records one). Written into a temporary directory and renamed. unsealed: read a
    checkpoint without a seal (--allow_unsealed=True). Raises ValueError."""
    from safetensors.torch import save_file
    try:  # its seal verified, weights_only; a damaged, refused, unsealed or partial file is one line (ValueError)
        ckpt = checkpoint.load_checkpoint(ckpt_path, unsealed=unsealed)
    except FileNotFoundError:
        raise ValueError(f"checkpoint {ckpt_path} not found") from None
    cfg = GPTConfig.from_dict(ckpt['model_args'])
    if cfg.residual != 'preln':
        raise ValueError(f"only Pre-LN is a LlamaForCausalLM; {cfg.residual} has no transformers class "
                         f"(probe it here, or convert a Pre-LN run)")
    state = {k.removeprefix('_orig_mod.'): v for k, v in ckpt['model'].items()}
    tensors = {}
    for ours, h in hf_layout(cfg):
        if ours not in state:
            raise ValueError(f"missing key {ours} in {ckpt_path}: not a complete Pre-LN checkpoint")
        tensors[h] = state[ours].float().contiguous()
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"{out_dir} exists and is not empty: choose a new --out directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f'.{out_dir.name}.', dir=out_dir.parent))
    try:
        save_file(tensors, str(tmp / 'model.safetensors'), metadata={'format': 'pt'})
        (tmp / 'config.json').write_text(json.dumps(hf_config(cfg), indent=2) + '\n')
        tok = (ckpt.get('config') or {}).get('tokenizer')
        if isinstance(tok, str) and tok.endswith('.json') and os.path.isfile(tok):
            (tmp / 'tokenizer.json').write_bytes(Path(tok).read_bytes())
        for f in tmp.iterdir():
            with open(f, 'rb') as fh:
                os.fsync(fh.fileno())
        if out_dir.exists():
            out_dir.rmdir()
        os.replace(tmp, out_dir)
    except BaseException:
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
        raise
    return f"{ckpt_path} -> {out_dir} (LlamaForCausalLM, L={cfg.n_layer}, d={cfg.n_embd})"


# -----------------------------------------------------------------------------

def save_checkpoint(ckpt, out):
    """Writes our checkpoint through checkpoint.save_checkpoint (sealed with its sha256, temp +
    fsync + rename), after checking it loads into GPT."""
    cfg = GPTConfig.from_dict(ckpt['model_args'])
    with torch.device('meta'):
        model = GPT(cfg)
    model.load_state_dict(ckpt['model'], strict=True, assign=True)  # raises on any key/shape mismatch
    checkpoint.save_checkpoint(str(out), ckpt)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--from', dest='src', choices=('olmo_core', 'hf'), help="import: the source format")
    p.add_argument('--to', dest='dst', choices=('hf',), help="export: the target format")
    p.add_argument('path', help="olmo_core: run or step<N>/ dir; hf: transformers dir; --to=hf: our ckpt.pt")
    p.add_argument('--out', required=True, help="import: our ckpt.pt to write; --to=hf: the directory to write")
    p.add_argument('--tokenizer', default=None,
                   help="tokenizer.json to record in the checkpoint (default: the one found beside the source)")
    p.add_argument('--allow_unsealed', default=False, type=lambda v: v.lower() == 'true', metavar='True|False',
                   help="--to=hf: read a checkpoint without a seal (another tool's), unverified")
    args = p.parse_args(argv)
    if (args.src is None) == (args.dst is None):
        raise SystemExit("error: give exactly one of --from=olmo_core|hf (import) or --to=hf (export)")
    try:
        if args.dst == 'hf':
            print(export_hf(args.path, args.out, args.allow_unsealed))
            return
        if Path(args.out).suffix != '.pt':
            raise ValueError(f"--out={args.out} should be a checkpoint file such as out/<name>/ckpt.pt")
        if args.tokenizer is not None and not os.path.isfile(args.tokenizer):
            raise ValueError(f"--tokenizer={args.tokenizer} not found")
        tok = str(Path(args.tokenizer).resolve()) if args.tokenizer else None
        ckpt, msg = (load_olmo_core if args.src == 'olmo_core' else load_hf)(args.path, tok)
        save_checkpoint(ckpt, args.out)
        print(f"{msg}\nwrote {args.out}")
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"error: {e}")


if __name__ == '__main__':
    main()
