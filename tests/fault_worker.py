"""train.py with one fault injected, for tests/test_faults.py.

    python tests/fault_worker.py nan_loss=2,4,5,6 [train.py flags]     # the loss is NaN at these steps (rank 0)
    torchrun ... tests/fault_worker.py kill_in_checkpoint=4 [flags]    # rank 1 SIGKILLs itself while writing checkpoint 4
    python tests/fault_worker.py lost_sync=3 [flags]     # the server answers the reload after step 3 but keeps its weights
    torchrun ... tests/fault_worker.py kill_at_step=5 [flags]     # every rank SIGKILLs itself as step 5 begins
    torchrun ... tests/fault_worker.py kill_after_update=6 [flags]   # every rank SIGKILLs itself in step 6, updated
                                                                   # but neither synced, checkpointed nor logged
"""

import os
import signal
import sys

from infra import checkpoint
from infra.generator import Generator
from infra import vllm_client
import train
import update
from config import Config
from infra.cli import parse_args

if __name__ == "__main__":  # the reward pool's workers import this script again as __mp_main__
    kind, steps = sys.argv[1].split("=")
    steps = {int(s) for s in steps.split(",")}
    rank = int(os.environ.get("RANK", 0))

    if kind == "nan_loss":
        now = {}
        real_rollout, real_loss = train.rollout_batch, update.grpo_loss  # train.py's batch maker calls it

        def rollout_batch(cfg, client, sampler, step, *a, **k):  # rank 0 knows the step here
            now["step"] = step
            return real_rollout(cfg, client, sampler, step, *a, **k)

        def grpo_loss(*a, **k):
            loss, metrics = real_loss(*a, **k)
            return (loss * float("nan") if now.get("step") in steps else loss), metrics

        train.rollout_batch, update.grpo_loss = rollout_batch, grpo_loss
    elif kind == "kill_in_checkpoint":
        real_fsync = checkpoint.fsync

        def fsync(path):  # called after DCP has written this rank's shards, before the rename
            if rank == 1 and any(f"step_{s:08d}.partial" in path for s in steps):
                os.kill(os.getpid(), signal.SIGKILL)
            real_fsync(path)

        checkpoint.fsync = fsync
    elif kind == "lost_sync":  # at the HTTP boundary: the reload request is never sent, and nothing says so
        real_reload, syncs = vllm_client.VLLMClient.reload_weights, [0]  # sync 0: a user's server gets our weights

        def reload_weights(self, weights_dir, timeout=None):
            syncs[0] += 1
            if syncs[0] - 1 not in steps:
                real_reload(self, weights_dir, timeout)

        vllm_client.VLLMClient.reload_weights = reload_weights
    elif kind == "kill_at_step":  # a SIGKILL at a known place: the steps before are logged, nothing of this one
        real_batch = Generator.batch

        def batch(self, step, policy):
            if step in steps:
                os.kill(os.getpid(), signal.SIGKILL)
            return real_batch(self, step, policy)

        Generator.batch = batch
    elif kind == "kill_after_update":  # a SIGKILL in the middle of a step: the weights moved, nothing else did
        real_step, calls = train.train_step, [0]

        def train_step(*a, **k):
            out = real_step(*a, **k)
            calls[0] += 1  # once a step, updates or none: a fresh run's step number
            if calls[0] in steps:
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        train.train_step = train_step
    else:
        raise SystemExit(f"unknown fault {kind!r}")

    status = train.main(parse_args(Config, sys.argv[2:]))
    train.close_distributed()
    sys.exit(status)
