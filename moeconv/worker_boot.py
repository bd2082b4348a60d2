"""What the fork server imports before it forks the workers (`executor.start_workers`): one intra-op
thread (OpenMP and MKL read these variables when torch first starts them), then torch and the code
every task runs. Each worker is forked from that server, so the workers share these pages instead of
importing their own (16 private imports took the tree from 1.0 to 5.4 GB on the 16-core host,
docs/BENCHMARKS.md), and the process that plans never imports torch."""

import os

for _variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_variable] = "1"

import torch  # noqa: E402

import moeconv.transform  # noqa: E402,F401

torch.set_num_threads(1)
