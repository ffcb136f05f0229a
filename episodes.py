"""Episodes, played on rank 0: an `Episode` is one sample in the making, a `Sample` what a finished
one is to the trainer, and a player plays a round of them. Three players, one chosen at start-up
(train.choose_player), all called the same way by rollout.py:

    episodes, stats = player.play(client, rows, n, seed, temperature)

- `Completions` (here): one turn, a prompt and its completion; the reward scores it.
- envs.environment.Environment (--environment): turns with an environment's replies between them.
- agent_programs.runner.Agents (--agent, --agent_cmd): a program plays, through the gateway.

A player returns n episodes of each row, episode k from row k // n, in order; each says whether the
reward must score it (needs_reward) and carries the player's own reward, if any (env_reward), or why
it could not be played (failure: ours, faults.FAULTS). stats are the round's numbers: rollout.py sums
them over a step's rounds (turns and tool_calls become means per episode).

An episode is token-in, token-out and append-only: each turn sends the episode's ids so far to
vLLM and appends the ids it sampled (mask 1, with their logprobs); what an environment says between
turns is appended with mask 0. Nothing is re-tokenized, so the trainer scores exactly the tokens
that were sampled.

The seeds: every request of a run has seeds of its own. Round r of step t starts at round_seed (a
block of turns x prompts x n seeds each), turn u of episode k at turn_seed within it, and vLLM seeds
sample j of a request seeded s with s + j (vllm/v1/engine/parallel_sampling.py); max_seed is the
largest run seed for which all of them fit vLLM's int64.
"""

import concurrent.futures
import dataclasses
import time
from typing import Optional, Protocol

from infra.model_files import stop_token_ids


# --- the record that crosses from the rollout (rollout.py) to the trainer (packing.py, update.py)


@dataclasses.dataclass
class Sample:
    """One episode as the trainer sees it (the record rollout.py hands packing.py and update.py).
    token_ids are every token after the prompt: the policy's (mask 1) and the environment's or the
    template's (mask 0, in the forward pass as context, out of every loss term). logprobs are the sampler's, 0.0 where mask is 0."""
    prompt_ids: list
    token_ids: list
    logprobs: list
    mask: Optional[list] = None  # None: every token sampled (a one-turn episode)
    adv: float = 0.0
    reward: float = 0.0
    versions: tuple = (0,)  # weight version of each turn's request
    staleness: int = 0  # weight updates since the oldest of them (drop_stale)
    valid: bool = True  # False: packing's filler, no tokens in the loss
    # where in token_ids a new sequence starts, positions from 0 and attending to nothing before it:
    # an agent's call that did not continue its episode's conversation (agent_programs/trace.py)
    restarts: tuple = ()
    # per policy token (the mask's order), what the reference put on it before packing: a teacher's
    # ref_logp, ref_head_ids and ref_head_logp (distill/teacher.py); packing.REFERENCE_TOKENS
    ref: Optional[dict] = None

    def __post_init__(self):
        if self.mask is None:
            self.mask = [1] * len(self.token_ids)
        if not len(self.mask) == len(self.logprobs) == len(self.token_ids):
            raise ValueError(f"a sample has {len(self.token_ids)} tokens, {len(self.mask)} mask entries and "
                             f"{len(self.logprobs)} logprobs; they must align")

    @property
    def version(self):  # the oldest weights that sampled any of it
        return min(self.versions)

    @property
    def policy_tokens(self):
        return sum(self.mask)


# --- episodes in the making, and the players


def completion_text(tokenizer, out):
    """What the reward (and an environment) sees of one turn: its sampled tokens decoded with
    their special tokens (a policy that pads its answer with them pays for it), without the
    end-of-sequence token that ended it: the tokenizer's or another of the model's
    (VLLMClient.submit marks it in "eos"; a turn without the mark is judged by
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

    def __init__(self, k, row, budget, messages=None):
        self.k, self.row, self.budget, self.done, self.cut, self.eos = k, row, budget, False, False, False
        self.sample = Sample(list(row["prompt_ids"]), [], [], [], versions=())
        self.messages = messages  # the conversation so far (an environment's, an agent's); None: one turn
        self.completion, self.turns, self.tool_calls = "", 0, 0
        self.key, self.env_reward = None, None  # the environment's key for its calls, and its reward
        self.failure = None  # why the infrastructure could not play or score it: then it is never trained on
        self.reward_failed = None  # how its reward failed (a reward_* row of faults.FAULTS), if that is why
        self.needs_reward = True  # whether the reward (--reward_fn, the dataset's) scores it; its player says

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


def take_turn(e, out, tokenizer):
    """Append one sampled turn (mask 1, its logprobs) to episode e."""
    e.add(out["token_ids"], out["logprobs"], True, out["version"])
    e.completion, e.eos, e.turns = completion_text(tokenizer, out), out.get("eos", False), e.turns + 1
    e.done = e.cut = out["finish_reason"] == "length" or e.budget <= 0  # cut by the token budget


class Player(Protocol):
    """What plays a round of episodes (this module's docstring says how); train.choose_player picks one."""

    multi_turn: bool  # episodes of several turns: a step logs their turns and tool calls
    scores: bool  # it gives its episodes a reward of its own (Episode.env_reward)
    name: str  # what plays, for the start-up line

    def start(self) -> None: ...  # its processes, on rank 0 before the first step

    def play(self, client, rows: list, n: int, seed: Optional[int], temperature: float) -> tuple[list, dict]: ...

    def close(self) -> None: ...


class Completions:
    """The plain player: one turn an episode, a prompt and its completion, scored by the reward. A
    row's n episodes are one request of n samples (episode k seeded turn_seed(seed, 0, len(rows) * n, k))."""

    multi_turn, scores, name = False, False, "completions"

    def __init__(self, cfg, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer

    def start(self):
        pass

    def play(self, client, rows, n, seed, temperature):
        cfg, started = self.cfg, time.perf_counter()
        episodes = [Episode(k, row, cfg.response_length) for k, row in enumerate(r for r in rows for _ in range(n))]
        futures = [client.submit(row["prompt_ids"], n, cfg.response_length, temperature, cfg.top_p,
                                 turn_seed(seed, 0, len(episodes), i * n), ()) for i, row in enumerate(rows)]
        for i, f in enumerate(futures):  # a failed request raises here, once every request has ended
            for e, out in zip(episodes[i * n:(i + 1) * n], wait_all(futures, f)):
                take_turn(e, out, self.tokenizer)
        return episodes, dict(time_generate=time.perf_counter() - started)

    def close(self):
        pass


def wait_all(futures, f):
    """f's result; when it failed, the other requests are settled first (settle)."""
    try:
        return f.result()
    except BaseException as e:
        settle(futures, e)
        raise


def settle(futures, error):
    """Requests left when a batch ends early. A failed request (an Exception: a dead server): the others end
    first, so that none is left behind for a restarted server to meet. A stop (infra/ranks.py's Stop,
    KeyboardInterrupt): those not sent are cancelled and none is waited for; the server goes with the run, and
    torchrun kills a rank that takes longer than its grace after a SIGTERM."""
    if isinstance(error, Exception):
        concurrent.futures.wait(futures)
    else:
        for f in futures:
            f.cancel()


def seed_block(cfg):
    """The seeds a round may take: turns x prompts x n."""
    return cfg.episode_turns * cfg.num_unique_prompts_rollout * cfg.num_samples_per_prompt_rollout


def round_seed(cfg, step, rnd, seed=None):
    """The first seed of round rnd (active sampling) of step `step`: seed * 2**32, then a seed_block
    for every round of every step before it. seed: the run's (cfg.seed) unless given."""
    first = (cfg.seed if seed is None else seed) * 2**32
    return first + (step * (cfg.active_sampling_max_rounds + 1) + rnd) * seed_block(cfg)


def turn_seed(seed, turn, episodes, k):
    """The seed of turn `turn` of episode k in a round of `episodes` episodes whose first seed is
    `seed` (None: unseeded, as evaluation is)."""
    return None if seed is None else seed + turn * episodes + k


def max_seed(cfg) -> int:
    """The largest run seed whose every request seed, the last step's last round's last one
    included, fits vLLM's int64 (Config refuses a seed above it)."""
    last = round_seed(cfg, cfg.num_training_steps, cfg.active_sampling_max_rounds, seed=0) + seed_block(cfg) - 1
    return (2**63 - 1 - last) // 2**32
