"""User code run in worker processes, so that it cannot stop or silently spoil a run: the
reward of every sample, and an environment's answer to every assistant turn (its tool calls).

    pool = RewardPool(rewards.math_reward, workers=2, timeout=10.0)   # or "file.py:fn", "module:fn"
    values, counts, first_failure = pool.score(prompts, completions, examples, completion_ids)
    pool.close()

    tools = CallPool(envs.calls.Calls(spec), workers=2, timeout=5.0, kind="tool", check=None, fallback=None)
    replies, failures = tools.map([(key, first, "step", row, messages), ...], pin=[key, ...])
    # failures: [(index, "timeouts", why), ...]; pin: the worker that must run each call (None: any)

A reward that runs past `timeout` seconds (reward_timeout), kills its own process, raises,
or returns something that is not a number (user_code.to_float; in TRL's form, not a list of one
number per completion) gets RewardPool's `fallback` (NaN, an unscored sample, unless the caller says). Each is counted
(`reward_timeouts`, `reward_crashes`, `reward_errors`; `tool_...` for an environment) and
the first is described; a worker that hung or died is killed and replaced, and the rest
goes on. Each worker leads its own process group, and a worker that is stopped, hung or dead
is ended with its whole group, so a tool's children (a shell's `sleep 300 &`) die with it.
A worker found dead while idle (killed by the kernel, say), or killed before it finished
loading, is replaced and the call it was about to get is sent to the new one: never a crash
of the trainer. The timeout runs
per sample from the moment a worker receives it. Signals would not do: math-verify's
own signal timeout fails outside the main thread (and with async_steps, scoring runs
on a thread), so rewards.py turns it off and this pool is the guard.

Workers come from a forkserver: a clean process started once, not a fork of the
multi-threaded trainer, with the training script (rewards.py with it), math-verify and what its
caller names preloaded
so that a replacement worker starts in milliseconds. The function reaches a worker pickled
(a module-level function, or an object that loads itself when unpickled, like
envs.calls.Calls), or as the `--reward_fn` string, which each worker loads itself (a
function from `file.py` cannot be pickled by name).

workers=0 calls in the calling process: no timeout (a hanging reward hangs the run),
but breakpoint() works inside it.
"""

import atexit
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import threading
import time

from infra.tracking import private_dir
from infra.user_code import Reward, load_object, to_float

STARTUP_TIMEOUT = 120.0  # seconds for a new worker to load the function and say it is ready
MAX_EARLY_DEATHS = 3  # workers killed by a signal before "ready", in a row, before loading is called broken


def resolve(fn):
    """A callable, or a "module:name" / "file.py:name" string."""
    return load_object(fn) if isinstance(fn, str) else fn


def call_one(fn, check, fallback, args):
    """(check(fn(*args)), None), or (fallback, "what went wrong") when either raises; check=None
    takes fn's value as it is."""
    try:
        value = fn(*args)
        return (value if check is None else check(value)), None
    except Exception as e:  # noqa: BLE001 - user code may raise anything
        return fallback, f"{type(e).__name__}: {e}"


def work(conn, fn, check, fallback, scratch):
    """A worker: load the function, say ready, then answer (i, args) with (i, value, error)
    until the pipe closes. Its temporary files go into `scratch`, which the pool removes with it."""
    os.setsid()  # its own process group: ending the group ends whatever a call started (end_group)
    os.environ["TMPDIR"] = tempfile.tempdir = scratch  # an instance that dies with the worker leaves nothing behind
    try:  # SIGKILL when the forkserver dies (it dies with the trainer): no orphan left hanging in a reward
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG, Linux
    except (OSError, AttributeError):
        pass
    fn = resolve(fn)
    try:
        conn.send("ready")
        while True:
            i, args = conn.recv()
            conn.send((i, *call_one(fn, check, fallback, args)))
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the pool closed its end: stop
        return


def end_group(proc):
    """SIGKILL a worker's process group (it leads one: os.setsid in work), children included, and
    reap the worker. The group outlives its leader while any member lives, so this also ends what
    a dead worker left running."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone (or was never made: the worker died before setsid)
    proc.kill()
    proc.join()


class Worker:
    def __init__(self, ctx, fn, check, fallback):
        self.conn, child = ctx.Pipe()
        # the worker's temporary files (a per-episode instance's scratch directory, a sandbox's): a worker
        # killed mid-call cannot close its episodes' instances, so what they made goes with the worker (and
        # with the next run's first worker, when the trainer itself was killed)
        self.scratch = private_dir("flatgrpo-worker-")
        self.proc = ctx.Process(target=work, args=(child, fn, check, fallback, self.scratch), daemon=True)
        self.proc.start()
        child.close()
        self.ready, self.task, self.deadline, self.started = False, None, None, time.monotonic()
        self.early_deaths = 0  # how many workers in a row died in this slot before saying "ready"

    def stop(self):
        self.conn.close()  # a healthy worker sees EOF and returns
        self.proc.join(timeout=1)
        end_group(self.proc)  # and what its calls left running
        shutil.rmtree(self.scratch, ignore_errors=True)


class CallPool:
    """fn(*args) of many argument tuples in `workers` processes, each call under `timeout`;
    check(value) validates what fn returned, fallback stands in for a call that failed."""

    def __init__(self, fn, workers=2, timeout=10.0, kind="reward", check=to_float, fallback=0.0, preload=()):
        self.spec, self.timeout, self.kind, self.check, self.fallback = fn, timeout, kind, check, fallback
        self.fn = resolve(fn)  # for workers=0, and to fail here, in one line, on a bad name
        self.lock = threading.Lock()  # with async_steps, evaluation and the rollout thread share the pool
        self.workers = []
        if workers:
            self.ctx = multiprocessing.get_context("forkserver")
            # preload: the modules fn's callers know it needs (envs.calls); the first pool's list is the forkserver's
            self.ctx.set_forkserver_preload(["__main__", "infra.worker_pool", "math_verify", *preload])
            # The forkserver and its workers ignore SIGTERM (an ignored signal stays ignored across
            # fork and exec): torchrun and schedulers signal the trainer's whole process group, and
            # the trainer finishes its step, scores included, before it stops. They still end with
            # the trainer: the forkserver exits when the trainer does, and a worker with the forkserver.
            previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
            try:
                self.workers = [Worker(self.ctx, fn, check, fallback) for _ in range(workers)]
            finally:
                signal.signal(signal.SIGTERM, previous)
            # Closed at exit before multiprocessing's own handler, which would SIGTERM them and wait
            atexit.register(self.close)

    def map(self, tasks, pin=None):
        """fn(*args) for each args tuple of tasks, in order (fallback where a call failed), and the
        failures as (index, "errors" | "timeouts" | "crashes", what went wrong) in the order of their
        tasks, whichever worker finished first (the first one described is the same every run).
        pin[i], when given and not None, is the worker that must run task i (the one that holds its
        episode's state): it waits for that worker."""
        failures = []
        values = [self.fallback] * len(tasks)
        if not self.workers:
            for i, args in enumerate(tasks):
                values[i], error = call_one(self.fn, self.check, self.fallback, args)
                if error:
                    failures.append((i, "errors", error))
            return values, failures
        pin = [None] * len(tasks) if pin is None else [None if p is None else p % len(self.workers) for p in pin]
        with self.lock:
            todo, left = list(range(len(tasks))), len(tasks)
            while left:
                self.hand_out(tasks, todo, pin)
                now = time.monotonic()
                deadlines = [w.deadline for w in self.workers if w.task is not None]
                wait = min(deadlines) - now if deadlines else STARTUP_TIMEOUT
                ready = multiprocessing.connection.wait([w.conn for w in self.workers], timeout=max(wait, 0.0))
                for k, w in enumerate(self.workers):
                    if w.conn in ready:
                        left -= self.receive(k, w, values, failures)
                    elif w.task is not None and time.monotonic() >= w.deadline:
                        failures.append((w.task, "timeouts", f"no answer after {self.kind}_timeout={self.timeout}s"))
                        self.replace(k)
                        left -= 1
                    elif not w.ready and time.monotonic() - w.started > STARTUP_TIMEOUT:
                        raise RuntimeError(f"a {self.kind} worker did not start in {STARTUP_TIMEOUT:.0f}s "
                                           f"(loading {self.spec!r} hangs?)")
        return values, sorted(failures, key=lambda f: f[0])

    def hand_out(self, tasks, todo, pin):
        """Give every ready, idle worker the first task it may run. A worker found dead when it is
        handed one (its pipe is broken) is replaced, and the task stays to be handed out again."""
        for k, w in enumerate(self.workers):
            mine = next((i for i in todo if pin[i] in (None, k)), None)
            if not (w.ready and w.task is None) or mine is None:
                continue
            try:
                w.conn.send((mine, tasks[mine]))
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
                self.replace(k)
                continue
            todo.remove(mine)
            w.task, w.deadline = mine, time.monotonic() + self.timeout

    def receive(self, k, w, values, failures):
        """Read worker k's message; returns how many samples it finished (0 or 1)."""
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):  # the worker died
            w.proc.join(timeout=5)
            code = w.proc.exitcode
            # An exit of its own before "ready" is the function failing to load; a signal is a kill from
            # outside (the OOM killer, say) unless it repeats (a crash in the import): then it is the load too
            if not w.ready and (code is None or code >= 0 or w.early_deaths >= MAX_EARLY_DEATHS):
                raise RuntimeError(f"a {self.kind} worker exited with code {code} before answering anything: "
                                   f"{self.spec!r} cannot be loaded in a worker (see its error above)") from None
            task = w.task
            self.replace(k, early_deaths=0 if w.ready else w.early_deaths + 1)
            if task is None:  # died while idle: replaced, nothing lost
                return 0
            failures.append((task, "crashes", f"the {self.kind}'s process died (exit code {w.proc.exitcode})"))
            return 1
        if msg == "ready":
            w.ready = True
            return 0
        i, values[i], error = msg
        if error:
            failures.append((i, "errors", error))
        w.task = None
        return 1

    def replace(self, k, early_deaths=0):
        """End worker k (hung or dead) with its process group and start a fresh one in its place."""
        w = self.workers[k]
        end_group(w.proc)
        w.conn.close()
        shutil.rmtree(w.scratch, ignore_errors=True)  # the instances it held are gone: their files too
        self.workers[k] = Worker(self.ctx, self.spec, self.check, self.fallback)
        self.workers[k].early_deaths = early_deaths

    def close(self):
        for w in self.workers:
            w.stop()
        self.workers = []


class RewardPool(CallPool):
    """The reward of each (prompt, completion, example); `fallback` (NaN) for one that fails. The reward is in
    our form or TRL's (user_code.Reward, which tells them apart at load and calls either one sample at a time)."""

    def __init__(self, reward, workers=2, timeout=10.0, fallback=float("nan"), weights=None):
        # fallback: the value of a failed sample; NaN, so that no caller takes it for a real reward of 0
        # check=None: Reward checks its value itself, and passes a TRL-form reward's None (score counts it)
        super().__init__(reward if isinstance(reward, Reward) else Reward(reward, weights), workers, timeout,
                         check=None, fallback=fallback)

    def score(self, prompts, completions, examples, completion_ids=None, alone=None):
        """Rewards in input order; counts of reward_errors, reward_timeouts, reward_crashes and
        reward_none; the first failure's description, "sample i: ..." (None when all went well).
        completion_ids: each sample's sampled token ids, for a TRL-form reward's `completion_ids`
        (None: not given). A TRL-form reward's None is "not applicable": where this reward is the
        sample's only one (alone[i], True when not given) the sample is unscored (the fallback) and
        counted (reward_none); beside another (an environment's) it adds 0. With several functions
        (--reward_fn a,b; reward_weights) a sample's reward is their weighted sum (Reward.combine), and
        the counts carry each function's values, "rewards/NAME": the values it gave (None left out)."""
        completion_ids = [None] * len(prompts) if completion_ids is None else completion_ids
        alone = [True] * len(prompts) if alone is None else alone
        values, failures = self.map(list(zip(prompts, completions, examples, completion_ids)))
        failed = {i for i, _, _ in failures}
        parts = {}
        if self.fn.several:  # each function's values, then their weighted sum
            scored = [v for i, v in enumerate(values) if i not in failed]
            parts = {f"rewards/{name}": [v[j] for v in scored if v[j] is not None]
                     for j, name in enumerate(self.fn.names)}
            values = [v if i in failed else self.fn.combine(v) for i, v in enumerate(values)]
        failures += [(i, "none", "the reward returned None (not applicable), and no other reward scores the sample")
                     for i, v in enumerate(values) if v is None and i not in failed and alone[i]]
        failures.sort(key=lambda f: f[0])
        values = [(self.fallback if alone[i] else 0.0) if v is None and i not in failed else v
                  for i, v in enumerate(values)]
        counts = {f"reward_{what}": sum(f[1] == what for f in failures) for what in ("errors", "timeouts", "crashes",
                                                                                        "none")}
        return values, dict(counts, **parts), f"sample {failures[0][0]}: {failures[0][2]}" if failures else None
