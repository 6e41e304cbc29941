"""``torchrun --max-restarts 1 --nproc-per-node 2 ... torchrun_restart.py <marker file>``: a
worker group that torchrun restarts, in plain torch without project code, so that what it shows
is torchrun's own behaviour.

Two processes join a gloo group and all-reduce a one, ten times. Rank 1 kills itself with
SIGKILL before the fourth all-reduce of the first start (it creates the marker file first, so
it does so once); torchrun stops rank 0 and starts both again. Each process prints
``rank <r> start <n> sum <s>`` at the end: the sum is 20.0 when both took part in all ten
all-reduces.

With torch 2.14.1 the restarted group joins only some of the time when torchrun's agent shares
its TCP store with the workers (``TORCHELASTIC_USE_AGENT_STORE=True``, the default of both the
static and the c10d rendezvous): the restarted processes can meet the first start's entries in
that store, and gloo's ``connectFullMesh`` then fails with "Connection refused", or the join
hangs. With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's environment and
``--rdzv-backend c10d``, every start gets a store of its own and the restart works
(docs/distributed.md, "Restarts").
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

STEPS, KILLED_AT = 10, 3

marker = Path(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
total = torch.zeros(1)
for step in range(STEPS):
    if rank == 1 and step == KILLED_AT and not marker.exists():
        marker.touch()
        os.kill(os.getpid(), 9)
    one = torch.ones(1)
    dist.all_reduce(one)
    total += one
print(f"rank {rank} start {os.environ['TORCHELASTIC_RESTART_COUNT']} sum {total.item()}",
      flush=True)
dist.destroy_process_group()
# Gloo's worker thread may free the last collective's tensors while the interpreter shuts
# down, and the process then aborts (recipes.runner.training.launch.exit_process): exit at once.
os._exit(0)
