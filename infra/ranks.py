"""Every rank together: rank 0 talks to the servers while the other ranks wait for it on the CPU,
and a failure or a stop on any rank ends every rank within seconds.

    ranks.start()                  every rank, after init_process_group: the CPU group, SIGTERM, the watch
    value = ranks.from_rank0(fn)   rank 0 runs fn(); every rank returns its value, or raises its failure
    ranks.share(obj)               rank 0's obj on every rank
    ranks.barrier()                every rank here
    ranks.stopping()               whether any rank was told to stop (a collective: every rank asks)
    ranks.abort()                  this rank failed: every other rank ends (exit 1) within seconds
    ranks.failed_elsewhere()       whether another rank failed first (this rank's error is its echo)
    ranks.ending()                 the run is over here: a late SIGTERM lets the exit finish
    ranks.close()                  before destroy_process_group (parallel.close_distributed)

Why not broadcast_object_list on the default group: on GPUs that is an NCCL collective, and a rank
waiting in one spins a kernel on the GPU that rank 0's colocated vLLM server computes on, for as long
as rank 0 generates, sleeps, wakes or reloads. It also never returns to Python: a SIGTERM's handler
waits until rank 0 is done, and an error that only rank 0 sees (a server that did not start) leaves the
other ranks in the collective until backend_timeout (30 min). Here the waiting ranks wait in a gloo
group (CPU memory, CPU sockets), on work they poll from Python every POLL seconds, so a signal's
handler runs at once, and a rank that is gone ends the wait with gloo's error.

A rank told to stop (torchrun's SIGTERM, or its launcher gone): before the loop it unwinds at once
(SystemExit 143: finally blocks stop the servers we launched); inside it, rank 0 drops the step it is
generating (Stop, raised in fn), every rank learns it from from_rank0, and train.py checkpoints the last
trained step; during training the step finishes and stopping() stops every rank after it. A rank that
another rank's failure or its launcher's end reaches in native code (a collective whose peer is gone) gets
STUCK seconds to come back to Python, then exits, posting its end for the others; a SIGTERM alone sets no
such bound (a step's backward may take longer; torchrun kills its ranks after its own grace).

A failure: what rank 0 raises inside from_rank0 reaches every rank (our faults as the same exception,
printed once by rank 0; anything else as Ended on the other ranks, which exit quietly while rank 0's
own error is printed). A failure anywhere else (a rank's out-of-memory in the update) is posted by
abort() to the store every rank watches; the others end within WATCH + STUCK seconds. The waits
themselves have no deadline of backend_timeout's: rank 0 may generate for longer than that, and every
call it makes to a server has a timeout of its own (WAIT_LIMIT bounds a wait whose peer hangs).
"""

import atexit
import os
import pickle
import select
import signal
import sys
import threading
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

POLL = 0.05  # seconds between two looks at a collective we wait on
WATCH = 1.0  # seconds between two looks at the store and the launcher
STUCK = 10.0  # seconds a rank told to end has to come back to Python before it exits from the watch
LOST = 3  # store checks failed in a row before the launcher counts as gone
WAIT_LIMIT = timedelta(hours=24)  # the CPU group's deadline: a wait for rank 0 is bounded by its calls' timeouts


class Stop(BaseException):
    """A rank was told to stop while rank 0 drove a server: every rank stops at the same point."""


class Ended(BaseException):
    """Another rank failed (it says why), or our launcher is gone: end quietly with `status`."""

    def __init__(self, status=1):
        super().__init__(status)
        self.status = status


class Ranks:
    """This process's part: the CPU group, the stop and end flags, the watch thread."""

    def __init__(self):
        self.group = None  # the gloo group every wait for rank 0 uses
        self.watch, self.closed = None, False  # the watch thread, and whether it is to stop
        self.in_loop = self.stop = self.in_fn = False  # the training loop; told to stop; rank 0 inside fn
        self.ended = None  # status an Ended raises, once the watch saw another rank fail
        self.ending = False  # the run is over: its exit (atexit's calls among it) is not to be interrupted
        self.pending = None  # since when a SIGTERM waits for its handler (None: none waits)
        self.handled = 0.0  # when the handler last ran
        self.bounded = None  # since when the handler must run within STUCK (another rank failed, the launcher gone)
        self.nonce = ""  # this attempt's, in every store key: torchrun's restart counts differ between nodes


R = Ranks()


def start():
    """Every rank, after init_process_group: the gloo group the waits use, SIGTERM's handler, and (in a
    world of several ranks) the thread that watches the store, the launcher and a stuck main thread."""
    R.group = dist.new_group(backend="gloo", timeout=WAIT_LIMIT)
    signal.signal(signal.SIGTERM, handle)
    if dist.get_world_size() > 1:
        R.nonce = share(uuid.uuid4().hex)
        read, write = os.pipe()
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)  # the C handler writes here even when the
        # main thread is inside a collective and cannot run the Python one
        R.watch = threading.Thread(target=watch, args=(read, os.getppid()), daemon=True, name="ranks-watch")
        R.watch.start()


def close():
    """Before the process group goes (parallel.close_distributed): the watch stops, and the CPU group is let
    go, so that nothing holds it past destroy_process_group (a group freed while the interpreter exits
    aborts the process: parallel.close_distributed says why)."""
    R.closed = True
    if R.watch is not None:
        R.watch.join(timeout=2 * WATCH)
        R.watch = None
    R.group = None


def handle(*_):
    """SIGTERM (and the watch's interruptions) on the main thread."""
    R.handled = time.monotonic()
    if R.ending:  # the process is already on its way out (torchrun stops the others once one exits)
        return
    if R.ended is not None:
        raise Ended(R.ended)
    if not R.in_loop:
        sys.exit(128 + signal.SIGTERM)
    R.stop = True
    if R.in_fn:  # rank 0 drops the generation, the sleep or the wake it is in: every rank stops with it
        R.in_fn = False  # once: a second SIGTERM on the way out does not raise again
        raise Stop()


def from_rank0(fn):
    """Rank 0 calls fn(); every rank returns its value. What fn raises on rank 0 is raised on every rank:
    an exception whose class says `every_rank = True` (our faults, infra/faults.py) as itself, Stop as
    Stop; anything else rank 0 raises as it is, and the other ranks end quietly (Ended). The other ranks
    wait on the CPU group, responsive to signals."""
    if not dist.is_initialized():
        return fn()
    outcome, error = None, None
    if dist.get_rank() == 0:
        try:
            try:
                R.in_fn = True  # a SIGTERM from here on raises Stop in fn (handle)
                if R.stop and R.in_loop:  # told while rank 0 was outside any call (its evaluation): stop here
                    raise Stop()
                outcome = ("ok", fn())
            finally:
                R.in_fn = False
        except Stop as e:  # wherever it was raised above: every rank stops with rank 0
            outcome, error = ("stop", None), e
        except BaseException as e:  # noqa: BLE001 - every rank must hear of it; rank 0 raises it below
            outcome, error = ("carried", e) if getattr(e, "every_rank", False) else ("failed", None), e
    kind, value = share(outcome)
    if error is not None:
        raise error
    if kind == "ok":
        return value
    if kind == "stop":
        raise Stop()
    if kind == "carried":
        raise value
    raise Ended(1)


def share(obj=None):
    """Rank 0's obj on every rank (pickled), over the CPU group; the others wait polling."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    rank0 = dist.get_rank() == 0
    data = pickle.dumps(obj) if rank0 else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    wait(dist.broadcast(size, src=0, group=R.group, async_op=True))
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if rank0 else torch.empty(int(size), dtype=torch.uint8)
    wait(dist.broadcast(buf, src=0, group=R.group, async_op=True))
    return obj if rank0 else pickle.loads(buf.numpy().tobytes())


def barrier():
    """Every rank here, waiting on the CPU group."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        wait(dist.barrier(group=R.group, async_op=True))


def stopping():
    """Whether any rank was told to stop (every rank asks, after the same step)."""
    flag = torch.tensor([float(R.stop)])
    if dist.is_initialized() and dist.get_world_size() > 1:
        wait(dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=R.group, async_op=True))
    return bool(flag.item())


def wait(work):
    """Until `work` completes, back in Python every POLL seconds (a signal's handler runs). A peer that is
    gone ends it with gloo's error: this rank ends quietly, the failed one says why. A peer that hung past
    WAIT_LIMIT: this rank says so, in one line, and every rank ends."""
    while not work.is_completed():
        time.sleep(POLL)
    try:
        work.wait()
    except RuntimeError as e:  # DistBackendError and gloo's "connection closed by peer" among them
        if "timed out" in str(e).lower() and not failed_elsewhere():
            print(f"error: rank {dist.get_rank()} waited {WAIT_LIMIT.total_seconds():g} s for the other ranks, and one "
                  "never came (a rank hung outside any call with a timeout); see each rank's last lines",
                  file=sys.stderr)
            abort()
        raise Ended(1) from None


def abort():
    """This rank failed: post it where every rank's watch looks (best effort: the store may be gone). Its own
    watch sees the post too: from here the rank is ending, and nothing interrupts its way out."""
    R.ending = True
    if dist.is_initialized() and dist.get_world_size() > 1:
        with_store(lambda c: c.set(key("abort"), str(dist.get_rank())))


def ending():
    """The run is over on this rank: a SIGTERM now (torchrun's, once another rank has exited) lets the exit
    finish, atexit's calls included, instead of breaking into them with a traceback."""
    R.ending = True


def failed_elsewhere():
    """Whether another rank posted its failure (this rank's error, then, is only the echo of it: gloo's
    "connection closed by peer")."""
    if R.ended is not None:
        return True
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return False
    try:
        return store().check([key("abort")])
    except Exception:  # noqa: BLE001 - the store is gone with the launcher
        return False


def exit_now(status):
    """End this process without the interpreter's shutdown (another rank failed: no barrier to meet, and
    gloo's threads must not be torn down under a finalizing interpreter); atexit's calls run first (a
    teacher's server is stopped there), not to be interrupted by the watch."""
    R.ending = True
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def key(name):
    """A store key of this run and attempt (torchrun keeps its store across --max_restarts, and each node's
    agent counts its restarts on its own: the attempt is start()'s nonce, the same on every rank)."""
    return f"flatgrpo/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{R.nonce}/{name}"


def store():
    """A client of the rendezvous store of our own (MASTER_ADDR:MASTER_PORT: torchrun's agent holds it)."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=10), wait_for_workers=False)


def watch(signals, parent):
    """The watch thread: every WATCH seconds, another rank's abort, a stop told to another rank, and the
    launcher (our parent process, and its store); a SIGTERM whose handler cannot run. Ends the process
    itself when the main thread, told that another rank failed or that the launcher is gone, does not
    come back to Python within STUCK seconds."""
    client, posted, told_seen, gone_seen, lost, nudged = None, False, False, False, 0, 0.0
    looked = time.monotonic()  # a signal's byte read now was written after this
    while not R.closed:
        ready = select.select([signals], [], [], WATCH)[0]
        if ready and signal.SIGTERM in os.read(signals, 64) and R.pending is None:
            R.pending = looked
        looked = time.monotonic()
        failed = told = False
        try:
            client = client or store()
            failed, told = client.check([key("abort")]), client.check([key("stop")])
            if R.stop and not posted:  # the others stop after the same step
                client.set(key("stop"), str(dist.get_rank()))
                posted = True
            lost = 0
        except Exception:  # noqa: BLE001 - the store is the launcher's: gone, once it fails LOST times in a row
            client, lost = None, lost + 1
        gone = os.getppid() != parent or lost >= LOST
        if failed and R.ended is None:
            R.ended = 1
        if (gone and not gone_seen) or (told and not R.stop and not told_seen):
            gone_seen, told_seen = gone_seen or gone, told_seen or told
            interrupt()  # as a SIGTERM: stop (or, before the loop, exit)
        if (R.ended is not None or gone) and R.bounded is None:
            R.bounded = time.monotonic()  # from here the main thread has STUCK seconds to come back to Python
        if R.ended is not None and not R.ending and time.monotonic() - nudged > STUCK:
            nudged = time.monotonic()  # the handler raises Ended (again, where a __del__ swallowed it)
            interrupt()
        if R.pending is not None and R.handled >= R.pending:
            R.pending = None  # the handler ran since
        elif R.pending is not None and R.bounded is not None and time.monotonic() - max(R.pending, R.bounded) > STUCK:
            with_store(lambda c: c.set(key("abort"), str(dist.get_rank())), client)  # its peers end too
            exit_now(R.ended or 128 + signal.SIGTERM)  # in native code since: a collective whose peer is gone


def with_store(fn, client=None):
    """fn(a store client), best effort: the store may be gone with the launcher."""
    try:
        fn(client or store())
    except Exception:  # noqa: BLE001
        pass


def interrupt():
    """SIGTERM's handler on the main thread: a signal to that thread, which ends a system call it waits in
    (a socket's, a sleep) where _thread.interrupt_main would wait for the call to return."""
    R.pending = R.pending or time.monotonic()
    signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
