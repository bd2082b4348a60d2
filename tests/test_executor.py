"""The executor's workers: one torch intra-op thread each, so threads never exceed the cores asked for."""

from __future__ import annotations

import pytest
import torch

from moeconv.executor import Executor


@pytest.mark.parametrize("workers", [1, 2])
def test_every_worker_runs_one_torch_thread_and_the_caller_gets_its_own_back(workers):
    torch.set_num_threads(2)  # what torch picks by itself on a 2-core machine
    with Executor(workers) as executor:
        assert list(executor.map(torch.get_num_threads, [()] * 4)) == [1, 1, 1, 1]
    assert torch.get_num_threads() == 2
