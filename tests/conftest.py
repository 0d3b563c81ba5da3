"""Test-wide settings.

One torch thread: the tests use tiny tensors, where a second OpenMP thread only adds
synchronisation, and on a busy machine spinning threads can slow tiny matmuls a hundredfold.
"""

import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")  # for subprocesses the tests start
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def one_thread():
    """Every test starts on one thread, whatever an earlier test set (a training run's train.threads, say)."""
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(1)
