"""Agents as programs: episodes played by code that only knows an OpenAI base URL (the wing: __init__.py).

    --agent my_agent.py:solve     solve(row, base_url, api_key) -> reward or None (sync or async)
    --agent_cmd "node agent.js"   a command in any language: OPENAI_BASE_URL and OPENAI_API_KEY in
                                  its environment, the row as JSON on its stdin; the last line it
                                  prints is its reward (a number), or nothing

A program is run num_samples_per_prompt_rollout times per prompt, each run an episode, in
agent_workers worker processes (worker_pool.CallPool: agent_timeout seconds a run; a run that
hangs or crashes is ended with its process group, and its model call in flight aborted at vLLM:
agent_timeout bounds the step). It calls the policy through the gateway (agent_programs/gateway.py),
which samples with the trainer's settings and records every token vLLM saw and sampled: the
episode's sample, exactly. The plainest agent:

    def solve(row, base_url, api_key):
        client = openai.OpenAI(base_url=base_url, api_key=api_key)
        messages = [{"role": "user", "content": row["prompt"]}]
        reply = client.chat.completions.create(model="policy", messages=messages)
        return None  # the reward (--reward_fn, or the dataset's) scores the final answer

What is trained (docs/data.md):
- the tokens the policy sampled in each call (mask 1), with the tokens between calls (tool results,
  new user turns, as the chat template renders them) in context, out of the loss; a call that
  rewrote the history starts a new sequence of the same sample (agent_programs/trace.py);
- the reward: the number the program returned (a --reward_fn you set is added, as to an
  environment's reward), or, when it returned None, the reward of the final conversation: the
  policy's last turn as the completion, the whole conversation as example["messages"];
- one advantage per episode, from its group of num_samples_per_prompt_rollout runs, on every
  sampled token of the episode.
A run that raised, timed out or crashed (agent_errors, agent_timeouts, agent_crashes), a call the
gateway could not serve (agent_refused: the server failed, a prompt too long, tools and no
--tool_call_parser) or a run that never called the model (agent_idle) is ours (faults.FAULTS): the
episode is unscored, its group leaves the batch, and unscored_stop stops a run that loses too many.
A mistake of the policy's that the program can see (a bad tool call, an expression that overflows)
is the program's to tell the policy, as the tool's answer (examples/calculator_agent.py). A run that
ends on one raises agent_programs.PolicyFailed (reward=None, or a number), and a framework's own limit
on the policy (the Agents SDK's MaxTurnsExceeded, pydantic-ai's UsageLimitExceeded, LangGraph's
GraphRecursionError: faults.POLICY_EXCEPTIONS) counts as that: the policy's (agent_policy_failures),
scored as a run that returned that reward, and trained on.

The programs run as the trainer's user, in its worker processes: they are not sandboxed. An agent
that runs code the model wrote runs it in envs/sandbox.py (sandbox.run, or an Interpreter per episode).
"""

import asyncio
import contextlib
import inspect
import json
import os
import secrets
import subprocess
import time
import urllib.request

from infra import faults
from envs import tool_calls
from envs.chat import ChatTokens
from episodes import Episode, turn_seed
from agent_programs.gateway import Gateway
from infra.user_code import load_object, to_float
from infra.worker_pool import CallPool

FAILURES = tuple(k for k in faults.FAULTS if k.startswith("agent_"))  # how a program's episode fails (all ours but one)


def returned(value):
    """What a program's run gave: None (the reward scores it) or a finite number."""
    return None if value is None else to_float(value)


class Failed:
    """A run that raised the policy's failure (faults.POLICY_EXCEPTIONS, agent_programs.PolicyFailed):
    why, and the reward it gave (None: the reward scores the conversation as it stands)."""

    def __init__(self, why, reward):
        self.why, self.reward = why, reward


class Program:
    """What a worker runs for one episode: the --agent function or the --agent_cmd command. It
    reaches the worker pickled as its spec and loads the function there."""

    def __init__(self, spec, cmd, timeout):
        self.spec, self.cmd, self.timeout = spec, cmd, timeout
        self.fn = load_object(spec, "agent") if spec else None

    def __getstate__(self):
        return dict(spec=self.spec, cmd=self.cmd, timeout=self.timeout)

    def __setstate__(self, state):
        self.__init__(**state)

    def __call__(self, row, base_url, api_key):
        try:
            if self.cmd:
                return self.run(row, base_url, api_key)
            value = self.fn(row, base_url, api_key)
            return returned(asyncio.run(value) if inspect.isawaitable(value) else value)
        except Exception as e:  # noqa: BLE001 - the program's code may raise anything; the rest is ours
            if not faults.policy_failed(e):
                raise
            return Failed(f"{type(e).__name__}: {e}", returned(getattr(e, "reward", None)))
        finally:  # the episode ends with its run: a call a thread it left makes later is refused, not recorded
            with contextlib.suppress(OSError):
                urllib.request.urlopen(urllib.request.Request(f"{base_url}/end", b"{}", method="POST"),
                                       timeout=self.timeout).close()

    def run(self, row, base_url, api_key):
        env = dict(os.environ, OPENAI_BASE_URL=base_url, OPENAI_API_KEY=api_key)
        done = subprocess.run(self.cmd, shell=True, input=json.dumps(row, default=str), capture_output=True,
                              text=True, env=env, timeout=self.timeout + 60)  # the pool's timeout comes first
        if done.returncode:
            tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"agent_cmd exited with code {done.returncode}: {tail}")
        last = (done.stdout.strip().splitlines() or [""])[-1].strip()
        return returned(float(last)) if last else None


class Agents:
    """The --agent or --agent_cmd on the trainer's side, the player of its episodes (episodes.Player):
    its gateway and worker processes."""

    multi_turn = scores = True  # its episodes come with their reward (or ask for one: Episode.needs_reward)

    def __init__(self, cfg, tokenizer):
        self.cfg, self.tokenizer, self.pool, self.gateway = cfg, tokenizer, None, None
        self.program = Program(cfg.agent, cfg.agent_cmd, cfg.agent_timeout)
        if cfg.agent and not callable(self.program.fn):
            raise ValueError(f"agent={cfg.agent!r} is not a function; see agent_programs/runner.py")
        self.name = cfg.agent or f"agent_cmd {cfg.agent_cmd!r}"
        self.parser = tool_calls.Parser(cfg.tool_call_parser, tokenizer, None) if cfg.tool_call_parser else None
        self.reasoning = tool_calls.Reasoning(cfg.reasoning_parser, tokenizer, ChatTokens(
            tokenizer).generation_prompt()) if cfg.reasoning_parser else None

    def start(self):
        """The gateway and the worker processes (rank 0, which plays the episodes)."""
        self.gateway = Gateway(self.tokenizer, self.cfg, self.parser, self.reasoning)
        self.pool = CallPool(self.program, self.cfg.agent_workers, self.cfg.agent_timeout, kind="agent",
                             check=None, fallback=None)

    def play(self, client, rows, n, seed, temperature):
        """n runs of the program on each row, all at once as workers allow. Call t of episode k is
        seeded turn_seed(seed, t, len(rows) * n, k), as an environment's turns are. Returns the
        episodes and their counts."""
        self.gateway.client = client
        episodes = [Episode(k, row, self.cfg.response_length, [])
                    for k, row in enumerate(r for r in rows for _ in range(n))]
        # keys no other process on the machine can guess: a call with one is the episode's
        keys = [self.gateway.open(f"{secrets.token_hex(8)}-{e.k}", temperature,
                                  lambda t, k=e.k: turn_seed(seed, t, len(episodes), k)) for e in episodes]
        shown = [{k: v for k, v in e.row.items() if k not in ("prompt_ids", "messages")} for e in episodes]
        started = time.perf_counter()
        values, failures = self.pool.map([(row, url, key) for row, (url, key) in zip(shown, keys)])
        why, overrides, down = {i: (what, text) for i, what, text in failures}, 0, None
        self.gateway.end([key for _, key in keys])  # the programs are over: their calls in flight aborted at once
        for e, value, (_, key) in zip(episodes, values, keys):
            trace = self.gateway.close(key)
            overrides, down = overrides + trace.overrides, down or trace.server_error
            self.take(e, value, trace, why.get(e.k))
        if down:  # the server failed, not the programs: the step stops there, and a server of ours is restarted
            raise down
        counts = {kind: sum(e.agent_failure == kind for e in episodes) for kind in FAILURES}
        return episodes, dict(time_generate=time.perf_counter() - started, turns=sum(e.turns for e in episodes),
                              tool_calls=sum(e.tool_calls for e in episodes), agent_overrides=overrides, **counts)

    def take(self, e, value, trace, failed):
        """Episode e from its program's run (its value, or how it failed) and the gateway's trace. The
        reward and the logged samples see the prompt of its first call as the prompt."""
        if trace.sample is not None:
            e.sample, e.messages, e.completion = trace.sample, trace.messages, trace.completion
            e.row = dict(e.row, prompt_text=self.tokenizer.decode(trace.sample.prompt_ids))
            e.turns, e.tool_calls, e.cut, e.eos = trace.calls, trace.tool_calls, trace.cut, trace.eos is not None
        gave_up, value = (value, value.reward) if isinstance(value, Failed) else (None, value)
        e.agent_failure, why = (  # the gateway's refusal first: the cause, when the program then failed on it
            ("agent_refused", trace.failure) if trace.failure else
            (f"agent_{failed[0]}", f"the agent: {failed[1]}") if failed else
            ("agent_idle", "the agent never called the model") if trace.sample is None else
            ("agent_policy_failures", gave_up.why) if gave_up else (None, None))
        if faults.ours(e.agent_failure):
            e.failure = why
        e.env_reward, e.needs_reward = value, value is None or bool(self.cfg.reward_fn)  # a --reward_fn is added

    def close(self):
        if self.pool:
            self.pool.close()
        if self.gateway:
            self.gateway.shutdown()
