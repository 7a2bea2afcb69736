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
