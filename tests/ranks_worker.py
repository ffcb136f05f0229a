"""One case of infra/ranks.py on 2 gloo ranks under torchrun (tests/test_ranks.py):

    python -m torch.distributed.run --nproc_per_node 2 tests/ranks_worker.py CASE OUT_DIR

Each rank writes OUT_DIR/rank{r}.json with what it saw, then exits as train.py's __main__ would.
The cases:
    wait       rank 0's call takes 2 s; rank 1 logs the collectives it entered and whether a timer's
               signal handler ran while it waited (it is back in Python)
    carried    rank 0's call raises VLLMError: every rank raises it
    failed     rank 0's call raises a RuntimeError: rank 0 raises it, rank 1 ends quietly (exit 1)
    abort      rank 1 fails outside any call while rank 0 waits inside a gloo all_reduce (native code)
    stuck      the same, but rank 1 lingers after posting its failure: its socket stays open
    long       rank 0's call sleeps for 10 minutes, inside the loop (the test stops or kills the launcher)
    hang       rank 0's call takes 20 s, past a WAIT_LIMIT of 3 s (24 h in a run): rank 1 says so, every rank ends
"""

import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from infra import ranks  # noqa: E402
from infra.faults import VLLMError  # noqa: E402


def record(out, rank, **seen):
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)


def logged_collectives(log):
    """dist's collectives, each call logged with whether it ran on the CPU group (infra/ranks.py)."""
    for name in ("broadcast", "barrier", "all_reduce", "broadcast_object_list", "all_gather"):
        real = getattr(dist, name)

        def logged(*args, _real=real, _name=name, **kw):
            log.append([_name, kw.get("group") is ranks.R.group and ranks.R.group is not None])
            return _real(*args, **kw)
        setattr(dist, name, logged)


def case(name, rank, out):
    if name == "wait":
        log, ticks = [], []
        signal.signal(signal.SIGALRM, lambda *_: ticks.append(time.monotonic()))
        logged_collectives(log)
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        start = time.monotonic()
        value = ranks.from_rank0(lambda: time.sleep(2) or {"answer": 42})
        done = time.monotonic()
        record(out, rank, value=value, collectives=log, tick=ticks[0] - start if ticks else None, waited=done - start)
    elif name == "carried":
        try:
            ranks.from_rank0(lambda: (_ for _ in ()).throw(VLLMError("the server did not start")))
        except VLLMError as e:
            record(out, rank, raised=str(e))
            raise
    elif name == "failed":
        ranks.from_rank0(lambda: 1 / 0)
    elif name in ("abort", "stuck"):
        if rank == 1:
            time.sleep(1)
            if name == "stuck":  # it says so, then takes its time to exit: its peer's socket stays open (past
                ranks.abort()  # rank 0's STUCK; a SIGTERM no longer interrupts a rank that is ending)
                time.sleep(25)
            raise RuntimeError("rank 1 failed on its own")
        dist.all_reduce(torch.ones(1))  # never met; gloo notices a peer that exits, not one that lingers
    elif name == "hang":
        ranks.from_rank0(lambda: time.sleep(20))
    elif name == "long":
        ranks.R.in_loop = True
        record(out, rank, started=True)
        try:
            ranks.from_rank0(lambda: time.sleep(600))
        except ranks.Stop:
            record(out, rank, stopped=True)
            return 128 + signal.SIGTERM
    return 0


def main():
    name, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    if name == "hang":
        ranks.WAIT_LIMIT = timedelta(seconds=3)
    ranks.start()
    try:
        status = case(name, dist.get_rank(), out)
    except VLLMError as e:  # as train.py: every rank is here, rank 0 says it
        if dist.get_rank() == 0:
            print(f"error: {e}", file=sys.stderr)
        status = 1
    except ranks.Ended as e:
        ranks.exit_now(e.status)
    except BaseException:
        if ranks.failed_elsewhere():
            ranks.exit_now(1)
        ranks.abort()
        raise
    ranks.barrier()
    ranks.close()
    dist.destroy_process_group()
    sys.exit(status)


if __name__ == "__main__":
    main()
