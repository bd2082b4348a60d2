"""What the fork server imports before it forks the workers (`executor.start_workers`): one intra-op
thread (OpenMP and MKL read these variables when torch first starts them), then torch and the code
every task runs. Each worker is forked from that server, so the workers share these pages instead of
importing their own (16 private imports took the tree from 1.0 to 5.4 GB on the 16-core host,
docs/BENCHMARKS.md), and the process that plans never imports torch."""

import os

# The server may still be importing torch when the command is over (verify starts it before its
# digests, and a damaged output ends verify there): it must not hold the command's output open
# meanwhile (a caller reading it to the end, `$(moeconv verify ...)` or a subprocess pipe, would wait
# for the import). The workers' results and errors come back through the pool, not their stdio.
_nowhere = os.open(os.devnull, os.O_WRONLY)
for _stream in (1, 2):
    os.dup2(_nowhere, _stream)
os.close(_nowhere)

for _variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_variable] = "1"

import torch  # noqa: E402

import moeconv.transform  # noqa: E402,F401

torch.set_num_threads(1)
