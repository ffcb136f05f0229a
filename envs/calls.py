"""An environment's calls where they run: in a tool worker (worker_pool.CallPool), or in the
trainer with tool_workers=0. Calls is what the pool runs; a per-episode instance lives here, in
INSTANCES, from its episode's first call to its "finish" or "close".

Its doors: envs/environment.py (Environment.start makes the CallPool of Calls) and
worker_pool.py (its forkserver preloads this module, so that a replacement worker starts fast).
"""

import tool_calls
from rewards import load_object, to_float
from tool_calls import ToolError

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


INSTANCES = {}  # this process's per-episode environments: episode key -> instance
LOST = "the episode's environment was lost with its worker"  # what "finish" raises for an instance gone


def per_episode(obj):
    """True for a class or a zero-argument factory (one instance per episode), False for an
    instance with a step method (one object for every episode)."""
    return isinstance(obj, type) or (callable(obj) and not callable(getattr(obj, "step", None)))


class Calls:
    """The calls of one --environment in this process (a tool worker, or the trainer with
    tool_workers=0). It reaches a worker pickled as its spec and loads the environment there as
    it is unpickled, at the worker's start (under the pool's start-up timeout, not a call's).

    A per-episode environment's instance is made, and reset(row), by the episode's first call, in
    the worker pinned to the episode, and kept there until "finish" or "close". what="step" returns
    (messages, kind): kind None, "bad_calls" (the policy's mistake, a ToolError) or "lost" (the
    instance died with an earlier worker: the episode ends). what="finish" returns (the episode's
    reward or None without a reward method, why close() failed or None): the reward is computed,
    then the instance closed, and a close that raises costs the episode nothing. what="close" only
    closes it (an episode that will not be scored)."""

    def __init__(self, spec):
        self.spec, self.obj = spec, load_object(spec, "environment", "environment")

    def __getstate__(self):
        return self.spec

    def __setstate__(self, spec):
        self.__init__(spec)

    def __call__(self, key, first, what, row, messages):
        env = self.obj
        if per_episode(env):
            if first and what != "close":  # an episode's first call; "close": it never had one
                INSTANCES[key] = self.obj()
                if callable(getattr(INSTANCES[key], "reset", None)):
                    INSTANCES[key].reset(row)  # its state starts here; the prompt was rendered at load time
            env = INSTANCES.pop(key, None) if what != "step" else INSTANCES.get(key)
            if env is None and what == "step":
                return [], "lost"
            if env is None and what == "close":
                return None
            if env is None:
                raise LookupError(LOST)
        if what == "step":
            try:
                if not callable(getattr(env, "step", None)):  # native tool calls, answered by the tools
                    replies, bad = tool_calls.answer_calls(env.tools, messages[-1])
                    return replies, "bad_calls" if bad else None
                return check_messages(env.step(row, messages)), None
            except ToolError as e:
                return [{"role": "tool", "content": f"error: {e}"}], "bad_calls"
        if what == "close":  # an episode that will not be scored (its rollout failed): cleaned up only
            return close(env) if per_episode(self.obj) else None
        try:  # "finish": the reward, then close, however the reward went; a close that fails keeps the reward
            reward = to_float(env.reward(row, messages)) if callable(getattr(env, "reward", None)) else None
        finally:
            closed = close(env) if per_episode(self.obj) else None
        return reward, closed


def close(env):
    """Close a per-episode instance: None, or why its close() failed (the episode's reward stands)."""
    try:
        if callable(getattr(env, "close", None)):
            env.close()
    except Exception as e:  # noqa: BLE001 - user code may raise anything
        return f"close() raised {type(e).__name__}: {e}"
    return None
