"""Runs train.py (its arguments follow) under torchrun and records, per rank, into
$DIST_RECORD.<rank>.json at exit:
  gathers  {parameter name: FSDP2 all-gathers of it}
  splits   one entry per graph that DDPOptimizer compiled: its parameters, the pieces it was
           cut into (at DDP's gradient-bucket boundaries) and, over its cuts, the most bytes of
           tensors made before a cut and used after it (0 when the pieces share only the
           graph's inputs; None when it was not cut)
DDP's buckets are made tiny (DIST_BUCKET_BYTES, default 1 KiB) so that every graph holding
two parameters or more is cut. Used by tests/test_distributed.py:
    torchrun --nproc_per_node=2 tests/dist_record.py --fsdp=True ..."""

import atexit
import collections
import json
import os
import runpy
import sys

import torch
import torch.distributed
from torch._dynamo.backends.distributed import DDPOptimizer
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.nn.parallel import DistributedDataParallel

gathers, splits = collections.Counter(), []
real_gather = _fsdp_param_group.foreach_all_gather


def counted_gather(fsdp_params, *args, **kwargs):
    for p in fsdp_params:
        gathers[p._param_fqn or p._module_info.param_name] += 1
    return real_gather(fsdp_params, *args, **kwargs)


real_compile_fn = DDPOptimizer.compile_fn


def recorded_compile_fn(self, gm, example_inputs):
    out = real_compile_fn(self, gm, example_inputs)
    piece = {n: i for i, b in enumerate(self.buckets) for n in b.nodes}

    def nbytes(n):
        v = n.meta.get('example_value')
        return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0
    # at each cut, the tensors made before it and used after it: what one piece hands the next
    crossing = [sum(nbytes(n) for n in gm.graph.nodes
                    if n in piece and piece[n] <= cut and any(piece.get(u, -1) > cut for u in n.users))
                for cut in range(len(self.buckets) - 1)]
    splits.append(dict(params=sum(len(b.params) for b in self.buckets), pieces=len(self.buckets),
                       largest_crossing=max(crossing) if crossing else None))
    return out


real_ddp_init = DistributedDataParallel.__init__


def small_buckets(self, *args, **kwargs):
    kwargs['bucket_cap_mb'] = int(os.environ.get('DIST_BUCKET_BYTES', 1024)) / 2**20
    real_ddp_init(self, *args, **kwargs)


_fsdp_param_group.foreach_all_gather = counted_gather
DDPOptimizer.compile_fn = recorded_compile_fn
DistributedDataParallel.__init__ = small_buckets
torch.distributed._DEFAULT_FIRST_BUCKET_BYTES = int(os.environ.get('DIST_BUCKET_BYTES', 1024))
path = f"{os.environ['DIST_RECORD']}.{os.environ.get('RANK', 0)}.json"
atexit.register(lambda: open(path, 'w').write(json.dumps(dict(gathers=gathers, splits=splits))))
repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, repo)
sys.argv = ['train.py'] + sys.argv[1:]
runpy.run_path(os.path.join(repo, 'train.py'), run_name='__main__')
