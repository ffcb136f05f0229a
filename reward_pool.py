"""Rewards scored in worker processes, so that reward code cannot stop or silently spoil a run.

    pool = RewardPool(rewards.math_reward, workers=2, timeout=10.0)   # or "file.py:fn", "module:fn"
    values, counts, first_failure = pool.score(prompts, completions, examples)
    pool.close()

A reward that runs past `timeout` seconds (reward_timeout), kills its own process, raises,
or returns something that is not a number (rewards.to_float) scores 0. Each is counted
(`reward_timeouts`, `reward_crashes`, `reward_errors`) and the first is described; a
worker that hung or died is killed and replaced, and scoring goes on. The timeout runs
per sample from the moment a worker receives it. Signals would not do: math-verify's
own signal timeout fails outside the main thread (and with async_steps, scoring runs
on a thread), so rewards.py turns it off and this pool is the guard.

Workers come from a forkserver: a clean process started once, not a fork of the
multi-threaded trainer, with the training script, rewards.py and math-verify preloaded
so that a replacement worker starts in milliseconds. The reward reaches a worker pickled
(a module-level function), or as the `--reward_fn` string, which each worker loads
itself (a function from `file.py` cannot be pickled by name).

workers=0 scores in the calling process: no timeout (a hanging reward hangs the run),
but breakpoint() works inside the reward.
"""

import atexit
import multiprocessing
import multiprocessing.connection
import signal
import threading
import time

from rewards import load_reward_fn, to_float

STARTUP_TIMEOUT = 120.0  # seconds for a new worker to load the reward and say it is ready


def score_one(fn, prompt, completion, example):
    """(reward, None), or (0.0, "what went wrong") when the reward raises or is not a number."""
    try:
        return to_float(fn(prompt, completion, example)), None
    except Exception as e:  # noqa: BLE001 - user code may raise anything
        return 0.0, f"{type(e).__name__}: {e}"


def work(conn, reward):
    """A worker: load the reward, say ready, then answer (i, prompt, completion, example) with
    (i, reward, error) until the pipe closes."""
    try:  # SIGKILL when the forkserver dies (it dies with the trainer): no orphan left hanging in a reward
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG, Linux
    except (OSError, AttributeError):
        pass
    fn = load_reward_fn(reward) if isinstance(reward, str) else reward
    conn.send("ready")
    while True:
        try:
            i, prompt, completion, example = conn.recv()
        except EOFError:
            return
        conn.send((i, *score_one(fn, prompt, completion, example)))


class Worker:
    def __init__(self, ctx, reward):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=work, args=(child, reward), daemon=True)
        self.proc.start()
        child.close()
        self.ready, self.task, self.deadline, self.started = False, None, None, time.monotonic()

    def stop(self):
        self.conn.close()  # a healthy worker sees EOF and returns
        self.proc.join(timeout=1)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


class RewardPool:
    def __init__(self, reward, workers=2, timeout=10.0):
        self.reward, self.timeout = reward, timeout
        self.fn = load_reward_fn(reward) if isinstance(reward, str) else reward  # for workers=0
        self.lock = threading.Lock()  # with async_steps, evaluation and the rollout thread share the pool
        self.workers = []
        if workers:
            self.ctx = multiprocessing.get_context("forkserver")
            self.ctx.set_forkserver_preload(["__main__", "rewards", "reward_pool", "math_verify"])
            # The forkserver and its workers ignore SIGTERM (an ignored signal stays ignored across
            # fork and exec): torchrun and schedulers signal the trainer's whole process group, and
            # the trainer finishes its step, scores included, before it stops. They still end with
            # the trainer: the forkserver exits when the trainer does, and a worker with the forkserver.
            previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
            try:
                self.workers = [Worker(self.ctx, reward) for _ in range(workers)]
            finally:
                signal.signal(signal.SIGTERM, previous)
            # Closed at exit before multiprocessing's own handler, which would SIGTERM them and wait
            atexit.register(self.close)

    def score(self, prompts, completions, examples):
        """Rewards in input order; counts of reward_errors, reward_timeouts and reward_crashes;
        the first failure's description (None when all went well)."""
        counts, first = dict(reward_errors=0, reward_timeouts=0, reward_crashes=0), []

        def fail(kind, message):
            counts[kind] += 1
            first.append(message)

        values = [0.0] * len(prompts)
        if not self.workers:
            for i, task in enumerate(zip(prompts, completions, examples)):
                values[i], error = score_one(self.fn, *task)
                if error:
                    fail("reward_errors", error)
            return values, counts, first[0] if first else None
        with self.lock:
            todo, left = list(range(len(prompts)))[::-1], len(prompts)
            while left:
                now = time.monotonic()
                for w in self.workers:  # hand a sample to every ready, idle worker
                    if w.ready and w.task is None and todo:
                        w.task, w.deadline = todo.pop(), now + self.timeout
                        w.conn.send((w.task, prompts[w.task], completions[w.task], examples[w.task]))
                deadlines = [w.deadline for w in self.workers if w.task is not None]
                wait = min(deadlines) - now if deadlines else STARTUP_TIMEOUT
                ready = multiprocessing.connection.wait([w.conn for w in self.workers], timeout=max(wait, 0.0))
                for k, w in enumerate(self.workers):
                    if w.conn in ready:
                        left -= self.receive(k, w, values, fail)
                    elif w.task is not None and time.monotonic() >= w.deadline:
                        fail("reward_timeouts", f"sample {w.task}: no reward after reward_timeout={self.timeout}s")
                        self.replace(k)
                        left -= 1
                    elif not w.ready and time.monotonic() - w.started > STARTUP_TIMEOUT:
                        raise RuntimeError(f"a reward worker did not start in {STARTUP_TIMEOUT:.0f}s "
                                           f"(loading the reward {self.reward!r} hangs?)")
        return values, counts, first[0] if first else None

    def receive(self, k, w, values, fail):
        """Read worker k's message; returns how many samples it finished (0 or 1)."""
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):  # the worker died
            w.proc.join(timeout=5)
            if w.task is None:
                raise RuntimeError(f"a reward worker exited with code {w.proc.exitcode} before scoring anything: "
                                   f"the reward {self.reward!r} cannot be loaded in a worker (see its error above)")
            fail("reward_crashes", f"sample {w.task}: the reward's process died (exit code {w.proc.exitcode})")
            self.replace(k)
            return 1
        if msg == "ready":
            w.ready = True
            return 0
        i, values[i], error = msg
        if error:
            fail("reward_errors", f"sample {i}: {error}")
        w.task = None
        return 1

    def replace(self, k):
        """Kill worker k (hung or dead) and start a fresh one in its place."""
        w = self.workers[k]
        w.proc.kill()
        w.proc.join()
        w.conn.close()
        self.workers[k] = Worker(self.ctx, self.reward)

    def close(self):
        for w in self.workers:
            w.stop()
        self.workers = []
