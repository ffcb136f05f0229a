"""An environment's calls where they run: in a tool worker (worker_pool.CallPool), or in the
trainer with tool_workers=0. Calls is what the pool runs; a per-episode instance lives here, in
INSTANCES, from its episode's first call to its "finish" or "close".

Its doors: envs/environment.py (Environment.start makes the CallPool of Calls) and
worker_pool.py (its forkserver preloads this module, so that a replacement worker starts fast).
"""

import inspect
import json
import zlib

from envs import tool_calls
from infra.user_code import load_object, to_float
from envs.tool_calls import Starved, ToolError, Unavailable

KEYS = ("role", "content", "name", "tool_call_id", "tool_calls")  # what a message keeps


def check_messages(value):
    """An environment's answer: a list of {"role": str, "content": str} ([] or None: the end), which
    may carry a tool message's "name" and "tool_call_id"."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        raise TypeError(f"step returned {value!r:.80}, not a list of {{'role': str, 'content': str}} messages")
    return [{k: m[k] for k in KEYS if k in m} for m in value]


NOT_IDENTITY = ("messages", "prompt_text", "prompt_ids")  # what data.tokenize_rows adds to a row after its reset


def row_seed(row):
    """The seed of a row's reset: the row's own "seed" (an integer column: a dataset that names its games
    or items), else a stable hash of its content (its dataset columns; not what its rendering adds), the
    same at load time and in every episode of its group, in any process and run. Its content, not its
    index: a row reaches a worker as itself, shuffled, without a place."""
    if isinstance(row.get("seed"), int) and not isinstance(row.get("seed"), bool):
        return row["seed"]
    identity = {k: v for k, v in row.items() if k not in NOT_IDENTITY}
    return zlib.crc32(json.dumps(identity, sort_keys=True, default=str).encode())


def seeded(reset):
    """True when reset takes a `seed` (the Gym convention): the trainer passes row_seed(row)."""
    try:
        return "seed" in inspect.signature(reset).parameters
    except (TypeError, ValueError):  # no signature to read: called with the row alone
        return False


def first_messages(instance, row):
    """An instance's reset(row), seeded by the row where its reset takes a seed, as checked messages."""
    reset = instance.reset
    return check_messages(reset(row, seed=row_seed(row)) if seeded(reset) else reset(row))


def mismatch(got, rendered, source="the prompt was rendered from"):
    """Why an episode's first messages are not its prompt's (None when they are): a reset that drew
    another state than the one the prompt was rendered from, so the policy would play another game."""
    if got == rendered:
        return None
    where = next((i for i, (a, b) in enumerate(zip(got, rendered)) if a != b), min(len(got), len(rendered)))
    shown = lambda ms: repr(ms[where]["content"]) if where < len(ms) else "nothing"  # noqa: E731
    return (f"reset gave {shown(got):.60} where {source} {shown(rendered):.60} "
            f"(message {where}); seed your reset (take a `seed` parameter: the trainer passes one derived "
            f"from the row) or derive its state from the row")


INSTANCES = {}  # this process's per-episode environments: episode key -> instance
LOST = "the episode's environment was lost with its worker"  # the why of a call whose instance is gone


def per_episode(obj):
    """True for a class or a zero-argument factory (one instance per episode), False for an
    instance with a step method (one object for every episode)."""
    return isinstance(obj, type) or (callable(obj) and not callable(getattr(obj, "step", None)))


class Calls:
    """The calls of one --environment in this process (a tool worker, or the trainer with
    tool_workers=0). It reaches a worker pickled as its spec and loads the environment there as
    it is unpickled, at the worker's start (under the pool's start-up timeout, not a call's).

    A per-episode environment's instance is made, and reset(row), by the episode's first call, in
    the worker pinned to the episode, and kept there until "finish" or "close". Each failure is
    named by its row of faults.FAULTS, and whose it is decided there:
    - what="step" returns (messages, kind, why): kind None, "tool_bad_calls" (the policy's mistake:
      the messages tell it), or one of ours with no messages ("tool_errors", "tool_unavailable", "tool_starved",
      "tool_resets", "tool_reset_mismatch": its reset gave other messages than its prompt was rendered
      from, "tool_lost": the instance died with an earlier worker);
    - what="finish" returns (the episode's reward or None without a reward method, kind, why): the
      reward is computed, then the instance closed; a close that raises is "tool_errors", and a
      reward that raises goes up to the pool (reward_errors);
    - what="close" only closes it (an episode that will not be scored), quietly;
    - what="check" runs the environment's check() once, at start-up (Environment.start), in a worker
      (with tool_workers=0, in the trainer)."""

    def __init__(self, spec):
        self.spec, self.obj = spec, load_object(spec, "environment", "environment")

    def __getstate__(self):
        return self.spec

    def __setstate__(self, spec):
        self.__init__(spec)

    def __call__(self, key, first, what, row, messages):
        if what == "check":  # raises when the environment cannot run in this process (a sandbox without bwrap)
            return self.check()
        env = self.obj
        if per_episode(env):
            if first and what != "close":  # an episode's first call; "close": it never had one
                failed = self.make(key, row)
                if failed:
                    return ([] if what == "step" else None), *failed
            env = INSTANCES.pop(key, None) if what != "step" else INSTANCES.get(key)
            if env is None and what == "close":
                return None
            if env is None:  # its instance died with an earlier worker
                return ([] if what == "step" else None), "tool_lost", LOST
        if what == "step":
            return step(env, row, messages)
        if what == "close":  # an episode that will not be scored (its rollout failed): cleaned up only
            return close(env) if per_episode(self.obj) else None
        try:  # "finish": the reward, then close, however the reward went
            reward = to_float(env.reward(row, messages)) if callable(getattr(env, "reward", None)) else None
        finally:
            closed = close(env) if per_episode(self.obj) else None
        return (reward, None, None) if closed is None else (None, "tool_errors", closed)

    def check(self):
        """The environment's check(), on an instance as the episodes will have it (a per-episode one made
        for it, then closed)."""
        env = self.obj() if per_episode(self.obj) else self.obj
        try:
            if callable(getattr(env, "check", None)):
                env.check()
        finally:
            if per_episode(self.obj):
                close(env)

    def make(self, key, row):
        """The episode's instance, made and reset(row) into INSTANCES; None, or (kind, why): its
        constructor or reset raised ("tool_resets"), or its reset's messages are not the ones its
        prompt was rendered from at load time, row["messages"] ("tool_reset_mismatch")."""
        instance, failed = None, None
        try:
            instance = self.obj()
            if callable(getattr(instance, "reset", None)):  # its state starts here
                why = mismatch(first_messages(instance, row), row.get("messages"))
                failed = ("tool_reset_mismatch", why) if why else None
        except Exception as e:  # noqa: BLE001 - user code may raise anything: not the policy's doing
            failed = "tool_resets", f"the environment could not be made or reset: {type(e).__name__}: {e}"
        if failed:
            if instance is not None:
                close(instance)
            return failed
        INSTANCES[key] = instance
        return None


def step(env, row, messages):
    """The environment's answer to the policy's last turn, as (messages, kind, why) (Calls)."""
    try:
        if not callable(getattr(env, "step", None)):  # native tool calls, answered by the tools
            replies, bad = tool_calls.answer_calls(env.tools, messages[-1])
            return replies, "tool_bad_calls" if bad else None, None
        return check_messages(env.step(row, messages)), None, None
    except ToolError as e:
        return [{"role": "tool", "content": f"error: {e}"}], "tool_bad_calls", None
    except Starved as e:
        return [], "tool_starved", f"the tool was kept from a CPU: {e}"
    except Unavailable as e:
        return [], "tool_unavailable", f"the tool could not run: {e}"
    except Exception as e:  # noqa: BLE001 - the environment's own code failed: raise ToolError for the policy's mistakes
        return [], "tool_errors", f"{type(e).__name__}: {e}"


def close(env):
    """Close a per-episode instance: None, or why its close() failed."""
    try:
        if callable(getattr(env, "close", None)):
            env.close()
    except Exception as e:  # noqa: BLE001 - user code may raise anything
        return f"close() raised {type(e).__name__}: {e}"
    return None
