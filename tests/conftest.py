"""Shared pytest set-up: the test models are tiny, and for tiny tensors one intra-op thread
is faster than several (and steadier when other processes share the cores)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope='session')
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(params=['stacked', 'looped'])
def read_form(request, monkeypatch):
    """Runs a test with both forms of the depth reads' sums over sources (ops.stack_if_small):
    batched ops over a stack (what the tests' tiny shapes get by default) and one in-place op
    per source (what sources too big to stack get)."""
    if request.param == 'looped':
        import ops
        monkeypatch.setattr(ops, 'STACK_BYTES', 0)
    return request.param
