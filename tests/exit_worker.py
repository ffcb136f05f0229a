"""Run by tests/test_exit.py under torchrun (2 gloo ranks): a finished run must exit 0.

    python -m torch.distributed.run --nproc_per_node 2 tests/exit_worker.py MODEL_DIR [close|destroy]

FSDP2 trains the model one step; then rank 1 starts a collective that its peer joins a
second later, with a Python callback that the gloo worker thread runs when it completes,
and drops every handle to it. That is the race at exit made certain: a gloo thread needs
the GIL while the main thread is leaving. `close` ends with parallel.close_distributed()
and prints the threads left; `destroy` ends as the scripts used to, with
destroy_process_group() alone, and the interpreter finalizes while the gloo thread works.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

import train
from config import Config
from infra.parallel import close_distributed
from infra.weight_sync import full_state_dict


def run(model_dir):
    cfg = Config(model_name_or_path=model_dir)
    rank, _, device, mesh = train.setup_distributed(cfg)
    policy = train.load_model(cfg, device, mesh)
    optimizer, _ = train.make_optimizer(cfg, policy, 1, device)
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    policy(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    full_state_dict(policy)
    if rank == 1:
        late = dist.all_reduce(torch.ones(1000), async_op=True)
        late.get_future().then(lambda fut: fut.value())
    else:
        time.sleep(1)
        dist.all_reduce(torch.ones(1000))
    return rank


class SlowToFree:
    """Freed while the interpreter finalizes: a big model takes that long to free."""

    def __del__(self, sleep=time.sleep):
        sleep(3)


def native_threads():
    return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))


model_dir, how = sys.argv[1], sys.argv[2]
rank = run(model_dir)
if how == "close":
    close_distributed()
    print(f"rank {rank} threads after close: {native_threads()}", flush=True)
else:
    dist.destroy_process_group()
slow = SlowToFree()
