"""Episodes, played on rank 0: an `Episode` is one sample in the making, and `play` plays n episodes
of each prompt against the vLLM server and, with an --environment, its replies, turn after turn.

An episode is token-in, token-out and append-only: each turn sends the episode's ids so far
to vLLM and appends the ids it sampled (mask 1, with their logprobs); the environment's
answer is appended as the chat template's rendering of its new messages (mask 0). Nothing is
re-tokenized, so the trainer scores exactly the tokens that were sampled. Episodes go at
their own pace: one whose turn is back gets its answer and sends its next turn while others
still generate, so the server's batch stays full. Without an environment an episode is one
turn: a prompt and its completion.

Used by: rollout.py (play, for a step's batch and for evaluation); agent_programs.py (Episode: an
--agent plays its own); agent_trace.py (completion_text); Refused stops the run in generator.py and
train.py.
"""

import concurrent.futures
import contextlib
import time

from model_files import stop_token_ids
from sample import Sample


def completion_text(tokenizer, out):
    """What the reward (and an environment) sees of one turn: its sampled tokens decoded with
    their special tokens (a policy that pads its answer with them pays for it), without the
    end-of-sequence token that ended it: the tokenizer's or another of the model's
    (VLLMClient.generate marks it in "eos"; a turn without the mark is judged by
    model_files.stop_token_ids)."""
    ids = out["token_ids"]
    ended = out["eos"] if "eos" in out else (out["finish_reason"] == "stop" and ids
                                             and ids[-1] in stop_token_ids(tokenizer, tokenizer.name_or_path))
    if ids and ended:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)


class Episode:
    """An episode while it is played: its Sample, its conversation (with an environment) and
    what its last turn said."""

    def __init__(self, k, row, budget):
        self.k, self.row, self.budget, self.done, self.cut, self.eos = k, row, budget, False, False, False
        self.sample = Sample(list(row["prompt_ids"]), [], [], [], versions=())
        self.messages = []  # with an environment, the conversation so far (play)
        self.completion, self.turns, self.tool_calls = "", 0, 0
        self.key, self.env_reward = None, None  # the environment's key for its calls, and its reward
        self.failure = None  # why the infrastructure could not play or score it: then it is never trained on
        self.reward_failed = None  # how its reward failed (a reward_* row of faults.FAULTS), if that is why
        self.needs_reward = False  # an agent's episode that its program left to the reward (agent_programs.py)

    def add(self, ids, logprobs, sampled, version=None):
        if sampled and len(logprobs) != len(ids):
            raise ValueError(f"the server returned {len(ids)} token ids and {len(logprobs)} logprobs for one turn")
        s = self.sample
        s.token_ids += ids
        s.logprobs += logprobs if sampled else [0.0] * len(ids)
        s.mask += [int(sampled)] * len(ids)
        if version is not None:
            s.versions += (version,)
        self.budget -= len(ids)

    @property
    def ids(self):
        return self.sample.prompt_ids + self.sample.token_ids


def play(cfg, client, rows, n, seed, tokenizer, env=None, temperature=None):
    """n episodes of each row, played turn by turn, each at its own pace: an episode whose turn is
    back is answered by the environment (with the others back by then) and its next turn is sent,
    while other episodes still generate. With an environment every turn is a request of its own,
    the first turns too (one request of n would hold all n episodes until the longest first turn
    ends); without one, an episode's only turn is one of its row's n samples in one request. Turn t
    of episode k (row k // n) is seeded seed + t * len(rows) * n + k: the same first-turn seeds
    either way, as vLLM seeds sample j of a request seeded s with s + j. Returns the episodes and the
    seconds spent waiting on generation and in the environment. An --agent plays its own (agent_programs.py)."""
    if callable(getattr(env, "play", None)):
        return env.play(client, rows, n, seed, cfg.temperature if temperature is None else temperature)
    episodes = [Episode(k, row, cfg.response_length) for k, row in enumerate(r for r in rows for _ in range(n))]
    for e in episodes if env else ():
        e.messages = list(e.row["messages"])  # the environment's first messages (data.tokenize_rows)
        e.key = env.new_key()
    temperature = cfg.temperature if temperature is None else temperature
    turns, stop, failures, tools = cfg.episode_turns if env else 1, env.stop if env else (), [], 0.0

    def send(ids, k, budget, s):
        return client.submit(ids, k, budget, temperature, cfg.top_p, None if seed is None else seed + s, stop)

    started, finished = time.perf_counter(), False
    if env:
        pending = {send(e.row["prompt_ids"], 1, cfg.response_length, e.k): [e] for e in episodes}
    else:
        pending = {send(row["prompt_ids"], n, cfg.response_length, i * n): episodes[i * n:(i + 1) * n]
                   for i, row in enumerate(rows)}
    try:
        while pending:
            done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
            back = sorted(((e, out) for f in done for e, out in zip(pending.pop(f), f.result())),
                          key=lambda p: p[0].k)
            for e, out in back:
                take_turn(e, out, tokenizer, env)
            going = [e for e, _ in back if not e.done and e.turns < turns]
            if going:
                t = time.perf_counter()
                try:
                    replies, lost = env.reply(going)
                except ValueError as e:  # an answer the policy would never see (chat.ChatTokens.check_roles)
                    raise Refused(str(e)) from None
                going = take_replies(going, replies)
                failures, tools = failures + lost, tools + time.perf_counter() - t
                for e in going:
                    pending[send(e.ids, 1, e.budget, e.turns * len(episodes) + e.k)] = [e]
        finished = True
    finally:  # a request failed (a dead server): the others end before the error goes on, none left behind,
        concurrent.futures.wait(pending)  # and the episodes' instances are closed
        if env and not finished:
            with contextlib.suppress(Exception):  # cleanup on the way out: the error that got us here goes on
                env.discard(episodes)
    timing = dict(time_generate=time.perf_counter() - started - tools)
    t = time.perf_counter()
    failures += finish(episodes, env) if env else []
    return episodes, dict(timing, time_tools=tools + time.perf_counter() - t, tool_failures=failures)


def finish(episodes, env):
    """The environment's reward of each episode the infrastructure did not lose, on its instance,
    which is then closed. Every failure here is ours (faults.FAULTS): it leaves its episode unscored.
    Returns them as (kind, why); a reward's are counted with the reward's (rollout.score)."""
    playing = [e for e in episodes if e.failure is None]
    env.discard([e for e in episodes if e.failure is not None])
    rewards, failed = env.finish(playing)
    for e, r in zip(playing, rewards):
        e.env_reward = r
    for i, kind, why in failed:  # a reward that raised, hung or crashed; a close that failed; an instance gone
        e = playing[i]
        reward = kind.startswith("reward_")
        if e.failure is None:  # the first of its failures says why
            e.failure = f"the environment's reward: {why}" if reward else f"its environment ({kind}): {why}"
        e.reward_failed = e.reward_failed or (kind if reward else None)
    return [(kind, f"episode {playing[i].k}: {why}") for i, kind, why in failed if not kind.startswith("reward_")]


def take_turn(e, out, tokenizer, env):
    """Append one sampled turn (mask 1, its logprobs) to episode e; with an environment, to its
    conversation too, however the episode ends."""
    e.add(out["token_ids"], out["logprobs"], True, out["version"])
    e.completion, e.eos, e.turns = completion_text(tokenizer, out), out.get("eos", False), e.turns + 1
    e.done = e.cut = out["finish_reason"] == "length" or e.budget <= 0  # cut by the token budget
    if env:
        e.messages.append(env.message(e.completion, e.turns - 1))


def take_replies(episodes, replies):
    """Append each episode's reply (envs.environment.Environment.reply: messages and their token ids)
    with mask 0; returns the episodes still going. No reply ends an episode, and so does one
    that leaves no room for another turn (the conversation, and the sample, end with the
    policy's turn)."""
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


class Refused(RuntimeError):
    """A step that cannot go on (too many episodes unscored, an environment's answer the policy would
    never see): the run stops, on every rank, in one line (Generator.batch, train.py)."""
