"""Environments: episodes of several turns, written as plain Python and passed by flag.

    --environment my_env.py:shop      an instance: one object for every episode (stateless)
    --environment my_env.py:Shop      a class or zero-argument factory: one instance per episode
    (or module:name; built in: envs.calculator:calculator, envs.calculator:calculator_tool,
    envs.python_tool:PythonTool; envs/openenv_adapter.py runs OpenEnv environments)

The object needs a step method, or tools and --tool_call_parser (tool_calls.py), and may
have more:

    step(row, messages) -> list of new messages, or [] to end the episode
        messages is the conversation so far, ending with the policy's last turn as
        {"role": "assistant", "content": text}; the answer is usually a tool's result,
        [{"role": "tool", "content": "873"}], or feedback as a user message. Raise
        ToolError("...") for the policy's mistake (a bad call): its text is the answer.
    reset(row) -> the first messages (default: the row's prompt as one user message); the
        same messages for the same row, since they are rendered into the row's prompt once. A reset
        that takes a `seed` (reset(row, seed=None), the Gym convention) is given calls.row_seed(row),
        the same at load time and in every episode; start-up resets the first row twice and refuses
        an environment whose two resets differ, and each episode's reset is compared with its
        prompt's messages (a mismatch is ours: tool_reset_mismatch)
    reward(row, messages) -> a number: the environment scores its episodes (the dataset's
        default reward is then unused; a --reward_fn you set is added to it)
    close(): called on a per-episode instance when its episode ends (after reward; a close that
        raises leaves the episode unscored, tool_errors), or when its rollout failed
    stop: stop strings that end an assistant turn, kept in its text (e.g. ["</calc>"]); at most
        4 (vLLM's VLLM_MAX_STOP_STRINGS), checked at start-up
    call_time: the seconds one call may need; a tool_timeout below it is refused at start-up
    tools: Python functions (type hints, a docstring with Args) or JSON schemas, rendered by the
        chat template (apply_chat_template(tools=...)). With --tool_call_parser (hermes,
        llama3_json, ...: vLLM's parsers) the policy's turns are read in the model's own format:
        messages[-1] carries "tool_calls", and without a step method the functions answer them
        (tool_calls.answer_calls: one {"role": "tool", "name", "tool_call_id", "content"} each)

A per-episode instance is made, and reset(row), by its episode's first call, in the one
worker process that serves every call of that episode (CallPool's pin), so state on self
lasts the episode and is never shared; at the episode's end, however it ended, reward and
close run on it. An instance named directly is shared and its calls go to any free worker.

Text in, messages out: the trainer owns tokenization. The reward (--reward_fn) sees the
policy's final turn as the completion and the whole conversation, ending with that turn, as
example["messages"].

    check(): optional, run once at start-up on an instance where the calls run (a tool worker; the
        trainer with tool_workers=0); raise when the environment cannot run there (PythonTool: one
        cell in the sandbox), and the run stops in one line before training

The calls run in worker processes (worker_pool.CallPool) under tool_timeout. Whose each failure
is, and how it is counted, is one table, faults.FAULTS (docs/operations.md): a ToolError, or a tool
function's exception, is the policy's (an "error: ..." tool message, tool_bad_calls: it learns from
it); any other exception of step, raising tool_calls.Unavailable, a constructor or reset that
raises, a reset whose messages are not its prompt's, a timeout, a worker that dies is ours: the
episode ends there unscored (its group leaves the batch), as do the other episodes whose
per-episode instances lived in that worker (tool_lost), and the step's first one is printed.
A message longer than tool_output_max_tokens is cut there (to a bounded number of characters
first, then tokens). The worker is an ordinary process in a process group of its own, ended
with its children on a timeout or a crash: it keeps a tool from stopping the run; it does not
contain code that means harm.

The environment's messages enter the episode as the chat template's rendering of just those
messages after an assistant turn (chat.ChatTokens), with loss mask 0; the policy's turns stay as
sampled. A reply that leaves no room for another turn in the token budget ends the episode
before it. Start-up checks that the template writes the same text after an assistant turn
whatever that turn and the earlier ones held; a template that rewrites earlier turns when it
renders a whole conversation (Qwen3's drops past reasoning) is accepted, and the episode keeps
what was sampled (docs/data.md says where that differs from the template's rendering).

Its door: train.py:choose_player makes Environment, the run's player, when --environment is set;
data.py reads its first messages, tools and chat (reset, tools, chat), generator.py starts and closes
it, and rollout.py calls play, as it calls every player. worker_pool.py's forkserver preloads
envs/calls.py by name, in every pool (a missing module is skipped). The calls themselves run in envs/calls.py.
"""

import concurrent.futures
import contextlib
import itertools
import os
import time

from infra import faults
from envs import tool_calls
from envs.chat import ChatTokens
from envs.calls import Calls, close, first_messages, mismatch, per_episode
from episodes import Episode, settle, take_turn, turn_seed
from infra.faults import Refused
from infra.user_code import load_object
from infra.worker_pool import CallPool


def default_reset(row):
    prompt = row["prompt"]
    return prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


MAX_STOP_STRINGS = int(os.environ.get("VLLM_MAX_STOP_STRINGS", "4"))  # what a vLLM request takes (vLLM 0.32: 4)


def check_needs(spec, probe, stop, cfg):
    """What an environment asks of the run against its settings, before anything starts: its stop
    strings (a request vLLM would refuse at the first turn) and the seconds one call may need
    (`call_time`: a tool_timeout below it kills calls that were going to answer)."""
    if not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"environment={spec!r}: stop={stop!r} must be a list of non-empty strings")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"environment={spec!r} has {len(stop)} stop strings and vLLM takes at most "
                         f"{MAX_STOP_STRINGS} a request (VLLM_MAX_STOP_STRINGS); keep the ones that end a call")
    need = getattr(probe, "call_time", None)
    if need is not None and (isinstance(need, bool) or not isinstance(need, (int, float)) or need <= 0):
        raise ValueError(f"environment={spec!r}: call_time={need!r} must be a positive number of seconds")
    if need is not None and cfg.tool_workers and cfg.tool_timeout < need:
        raise ValueError(f"environment={spec!r} needs up to {need:g} s a call (its call_time) and tool_timeout="
                         f"{cfg.tool_timeout:g} would cut its calls off; set --tool_timeout {need:g} or more")


class Environment:
    """An --environment on the trainer's side, the player of its episodes (episodes.Player): its first
    messages, stop strings and tools, its calls in worker processes (each episode's in one worker),
    and the tokens of its replies."""

    multi_turn = True

    def __init__(self, spec, tokenizer, cfg):
        obj = load_object(spec, "environment", "environment")
        self.factory = per_episode(obj)
        try:
            probe = obj() if self.factory else obj  # stop, tools and the reset of the prompts are read from it
        except Exception as e:  # noqa: BLE001 - user code may raise anything
            raise ValueError(f"environment={spec!r}: {getattr(obj, '__name__', obj)}() raised {type(e).__name__}: {e}; "
                             "a class or factory must build an environment with no arguments") from None
        tools = list(getattr(probe, "tools", None) or ())
        if not callable(getattr(probe, "step", None)) and not (tool_calls.functions(tools) and cfg.tool_call_parser):
            raise ValueError(f"environment={spec!r} has no step(row, messages) method" + (
                ", and its tools are called only in a format a parser reads: set --tool_call_parser (hermes for "
                "Qwen, llama3_json for Llama-3.1, ...)" if tool_calls.functions(tools) else "")
                + "; see envs/environment.py")
        try:
            self.tools = tool_calls.schemas(tools) or None
        except ValueError as e:
            raise ValueError(f"environment={spec!r}: {e}") from None
        self.make, self.probe, self.stop = obj, probe, list(getattr(probe, "stop", ()))
        check_needs(spec, probe, self.stop, cfg)
        self.scores = callable(getattr(probe, "reward", None))  # the environment scores its episodes
        self.name = spec
        self.chat = ChatTokens(tokenizer, self.tools)
        self.parser = tool_calls.Parser(cfg.tool_call_parser, tokenizer, self.tools) if cfg.tool_call_parser else None
        self.reasoning = tool_calls.Reasoning(cfg.reasoning_parser, tokenizer, self.chat.generation_prompt()) \
            if cfg.reasoning_parser else None
        self.spec, self.cfg, self.tokenizer, self.pool = spec, cfg, tokenizer, None
        self.deterministic = False  # its reset gave the same messages twice for a row (reset)
        self.keys, self.started = itertools.count(), set()  # episode keys; those whose instance exists (factory)
        # no token spans more characters than the vocabulary's longest string: a reply is cut to
        # that many characters per token it may keep before it is tokenized (bounded work per reply)
        self.max_chars = cfg.tool_output_max_tokens * max(map(len, tokenizer.get_vocab()))

    def start(self):
        """Start the worker processes (rank 0, which plays the episodes), and run the environment's
        check() in one of them: an environment that cannot run there (PythonTool's sandbox without
        bwrap, or where it cannot make namespaces) stops the run before training, in one line."""
        self.pool = CallPool(Calls(self.spec), self.cfg.tool_workers, self.cfg.tool_timeout, kind="tool",
                             check=None, fallback=None, preload=["envs.calls"])
        if callable(getattr(self.probe, "check", None)):
            _, failed = self.pool.map([(None, False, "check", None, None)])
            if failed:
                self.close()
                raise ValueError(f"environment={self.spec!r} cannot run here: {failed[0][2]}")

    def play(self, client, rows, n, seed, temperature):
        """n episodes of each row, each at its own pace: an episode whose turn is back is answered (with
        the others back by then) and its next turn sent while others still generate, so the server's
        batch stays full. Every turn is a request of its own, the first turns too (one request of n would
        hold all n episodes until the longest first turn ends); turn t of episode k is seeded
        turn_seed(seed, t, len(rows) * n, k), the same first-turn seeds as episodes.Completions. Returns
        the episodes and the round's counts; "tool_failures" lists the failed calls as (kind, why)."""
        cfg = self.cfg
        episodes = [Episode(k, row, cfg.response_length, list(row["messages"]))  # its first messages (data.py)
                    for k, row in enumerate(r for r in rows for _ in range(n))]
        for e in episodes:
            e.key, e.needs_reward = next(self.keys), not self.scores or bool(cfg.reward_fn)

        def send(e):
            return client.submit(e.ids, 1, e.budget, temperature, cfg.top_p,
                                 turn_seed(seed, e.turns, len(episodes), e.k), self.stop)

        started, failures, tools = time.perf_counter(), [], 0.0
        pending = {send(e): e for e in episodes}
        try:
            while pending:
                done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                back = sorted(((pending.pop(f), f.result()[0]) for f in done), key=lambda p: p[0].k)
                for e, out in back:
                    take_turn(e, out, self.tokenizer)
                    e.messages.append(self.message(e.completion, e.turns - 1))
                going = [e for e, _ in back if not e.done and e.turns < cfg.episode_turns]
                if going:
                    t = time.perf_counter()
                    try:
                        replies, lost = self.reply(going)
                    except ValueError as e:  # an answer the policy would never see (chat.ChatTokens.check_roles)
                        raise Refused(str(e)) from None
                    going = take_replies(going, replies)
                    failures, tools = failures + lost, tools + time.perf_counter() - t
                    pending.update((send(e), e) for e in going)
        except BaseException as e:  # a request failed (a dead server), or a stop: episodes.settle, and the
            settle(pending, e)  # episodes' instances are closed
            with contextlib.suppress(Exception):  # cleanup on the way out: the error that got us here goes on
                self.discard(episodes)
            raise
        generating, t = time.perf_counter() - started - tools, time.perf_counter()
        failures += self.score(episodes)
        return episodes, dict(time_generate=generating, time_tools=tools + time.perf_counter() - t,
                              turns=sum(e.turns for e in episodes), tool_calls=sum(e.tool_calls for e in episodes),
                              tool_failures=failures)

    def score(self, episodes):
        """The environment's reward of each episode the infrastructure did not lose, on its instance,
        which is then closed. Every failure here is ours (faults.FAULTS): it leaves its episode unscored.
        Returns them as (kind, why); a reward's are counted with the reward's (rollout.score)."""
        playing = [e for e in episodes if e.failure is None]
        self.discard([e for e in episodes if e.failure is not None])
        rewards, failed = self.finish(playing)
        for e, r in zip(playing, rewards):
            e.env_reward = r
        for i, kind, why in failed:  # a reward that raised, hung or crashed; a close that failed; an instance gone
            e = playing[i]
            reward = kind.startswith("reward_")
            if e.failure is None:  # the first of its failures says why
                e.failure = f"the environment's reward: {why}" if reward else f"its environment ({kind}): {why}"
            e.reward_failed = e.reward_failed or (kind if reward else None)
        for e in playing if self.scores else ():
            if e.env_reward is None and e.failure is None:
                e.failure = "the environment gave no reward"
        return [(kind, f"episode {playing[i].k}: {why}") for i, kind, why in failed if not kind.startswith("reward_")]

    def reset(self, row):
        """The first messages of the row's episodes (rendered into its prompt once, at load time). A
        per-episode environment resets an instance of its own for the row, closed at once: none
        stays open in the trainer (an OpenEnv adapter's reset builds an environment). The first row
        is reset twice, and an environment whose two resets differ is refused here, in one line:
        unseeded, it would draw one state for the prompt and another in each episode."""
        if not callable(getattr(self.probe, "reset", None)):
            return default_reset(row)
        messages = self.reset_once(row)
        if not self.deterministic:
            why = mismatch(self.reset_once(row), messages, "its first reset gave")
            if why:
                raise ValueError(f"environment={self.spec!r} is not deterministic: for the same row its {why}")
            self.deterministic = True
        self.chat.check_first(messages, self.spec)
        return messages

    def reset_once(self, row):
        try:
            instance = self.make() if self.factory else self.probe
            try:
                return first_messages(instance, row)
            finally:
                if self.factory:
                    close(instance)
        except Exception as e:  # noqa: BLE001 - user code may raise anything: the run stops here, in one line
            raise ValueError(f"environment={self.spec!r}: making or resetting it for a prompt raised "
                             f"{type(e).__name__}: {e}; fix the environment (envs/environment.py)") from None

    def message(self, text, turn):
        """The policy's turn as an assistant message: its text, and with a tool_call_parser its calls.
        With a reasoning_parser the reasoning is "reasoning_content", and only the text after it is
        read for calls: a call the policy wrote while thinking is not made."""
        reasoning, content = self.reasoning.split(text) if self.reasoning else (None, text)
        message = self.parser.message(content, turn) if self.parser else {"role": "assistant", "content": content}
        return dict(message, reasoning_content=reasoning) if reasoning is not None else message

    def call(self, episodes, what):
        """Calls(what) for each episode, each in its own worker; returns the values and the
        failures as (index, kind, why)."""
        tasks = [(e.key, e.key not in self.started, what, e.row, e.messages) for e in episodes]
        values, failures = self.pool.map(tasks, pin=[e.key for e in episodes] if self.factory else None)
        if self.factory and what == "step":  # their instances exist now
            self.started.update(e.key for e in episodes)
        elif self.factory:  # "finish" and "close" closed them
            self.started.difference_update(e.key for e in episodes)
        return values, failures

    def truncate(self, message):
        text = message["content"]  # counted as ChatTokens.ids tokenizes it: a control-token string is text
        ids = self.tokenizer(text[:self.max_chars], add_special_tokens=False, split_special_tokens=True)["input_ids"]
        if len(ids) <= self.cfg.tool_output_max_tokens and len(text) <= self.max_chars:
            return message
        return dict(message, content=self.tokenizer.decode(ids[:self.cfg.tool_output_max_tokens]) + " [cut]")

    def reply(self, episodes):
        """The environment's reply to each episode's last turn: for each, its reply messages (each cut
        to tool_output_max_tokens) and their token ids as the chat template renders them, None when
        the episode ends there, or a str when the failure is ours (why: the episode ends unscored);
        and the calls that failed, as (kind, why), kind a row of faults.FAULTS, which decides whose
        each is: the policy's are told to it as an "error: ..." tool message and the episode goes on.
        play appends them (take_replies)."""
        replies, asked = [None] * len(episodes), []
        for i, e in enumerate(episodes):  # a call the parser could not read is answered here
            unread = self.parser.unread(e.messages[-1]) if self.parser else None
            if unread:
                replies[i] = ([{"role": "tool", "content": f"error: {unread}"}], "tool_bad_calls", None)
            else:
                asked.append(i)
        values, failures = self.call([episodes[i] for i in asked], "step")
        for i, value in zip(asked, values):
            replies[i] = value
        for i, what, why in failures:  # the pool's: a call past tool_timeout, a worker that died
            replies[asked[i]] = ([], f"tool_{what}", why)
        out, failed = [], []
        for e, (reply, kind, why) in zip(episodes, replies):
            if kind == "tool_bad_calls":
                why = f"the policy's call was answered {reply[0]['content']!r}"
            if kind:
                failed.append((kind, f"episode {e.k}: {why}"))
            if faults.ours(kind):
                out.append(f"its environment call failed ({kind}): {why}")
                continue
            reply = [self.truncate(m) for m in reply]
            self.chat.check_roles(reply, self.spec)  # a role the template drops stops the run, in one line
            out.append((reply, self.chat.ids(reply, e.sample.token_ids[-1] if e.eos else None)) if reply else None)
        return out, failed

    def finish(self, episodes):
        """At the episodes' end: each one's reward from the environment (None when it has no reward
        method) and its instance closed. Returns the rewards and the failures as (index, kind, why),
        every one ours (faults.FAULTS): "finish" that raised, hung or crashed (reward_* with a reward
        method, whose call it is; tool_* without one: the close's), a close that raised after the
        reward ("tool_errors"), an instance gone with an earlier worker ("tool_lost")."""
        if not (self.factory or self.scores):
            return [None] * len(episodes), []
        values, failures = self.call(episodes, "finish")
        # what the pool saw fail in "finish" is the reward's, or without one the close's
        failed = [(i, f"{'reward' if self.scores else 'tool'}_{what}", why) for i, what, why in failures]
        failed += [(i, v[1], v[2]) for i, v in enumerate(values) if v and v[1]]
        return [v[0] if v else None for v in values], sorted(failed)

    def discard(self, episodes):
        """Close the instances of episodes that will not be scored (their rollout failed); quiet."""
        if self.factory and episodes:
            self.call([e for e in episodes if e.key in self.started], "close")

    def close(self):
        if self.pool:
            self.pool.close()


def take_replies(episodes, replies):
    """Append each episode's reply (Environment.reply: messages and their token ids) with mask 0;
    returns the episodes still going. No reply ends an episode, and so does one that leaves no room
    for another turn (the conversation, and the sample, end with the policy's turn)."""
    going = []
    for e, reply in zip(episodes, replies):
        if isinstance(reply, str):  # the infrastructure lost the episode: it ends unscored
            e.done, e.failure = True, reply
            continue
        if reply is None or len(reply[1]) >= e.budget:
            e.done, e.cut = True, reply is not None
            continue
        e.messages += reply[0]
        e.tool_calls += 1
        e.add(reply[1], None, sampled=False)
        going.append(e)
    return going
