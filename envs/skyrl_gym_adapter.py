"""Environments others wrote: a SkyRL-Gym environment (`skyrl-gym`: `skyrl_gym.make(env_id,
env_config=, extras=)`, a text environment with `init(prompt) -> (messages, metadata)` and
`step(text) -> {"observations", "reward", "done", "metadata"}`), by its id, with no glue:

    --environment envs.skyrl_gym_adapter:gsm8k --dataset math ...
    --environment envs.skyrl_gym_adapter:gsm8k_multi_turn --max_turns 5 --dataset gsm8k.jsonl ...

Any id of SkyRL-Gym's registry is a name of this module (a class made for it on first use; an id
it does not know is refused at load, in one line). SkyRL's environments read their task from the
row, as SkyRL's datasets write it: the row is the environment's `extras`, whose "reward_spec"
({"method": "rule", "ground_truth": ...}) is, when the row has none, {"method": "rule",
"ground_truth": row["answer"]}, so a dataset with an answer column runs as it is; the row's
"env_config", if any, is the environment's `env_config` (an OmegaConf config, as SkyRL gives it:
the search and SQL environments read theirs, `db_path`, `search_url`, ...). Each episode: `make`, then `init(prompt)`, whose messages are the first ones (the row's
prompt, for gsm8k); each policy turn is one `step(text)`, whose observations come back until it
says done. The episode's reward is the sum of its steps' (SkyRL's turn-level rewards); a run that
max_turns or the token budget ended first has its last turn stepped at the end, so that the
environment scores it. The environments draw nothing at random: the same row gives the same first
messages, at the prompt's render and in every episode.

Its doors: none; --environment names it (infra/user_code.load_object reads the id as an attribute).
"""

import functools

import skyrl_gym
from omegaconf import OmegaConf
from skyrl_gym.envs.registration import registry


def prompt_messages(prompt):
    return prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


class SkyRLGym:
    """One SkyRL-Gym environment per episode (a per-episode environment); env_id is set by the class
    this module makes for each id."""

    env_id = None

    def reset(self, row, seed=None):  # seed: SkyRL's environments take their task from the row
        extras = dict(row, extra_info=row.get("extra_info") or {},
                      reward_spec=row.get("reward_spec") or {"method": "rule", "ground_truth": row.get("answer")})
        self.env = skyrl_gym.make(self.env_id, env_config=OmegaConf.create(row.get("env_config") or {}),
                                  extras=extras)
        self.rewards, self.done, self.seen = [], False, 0
        messages, _ = self.env.init(prompt_messages(row["prompt"]))
        return [{"role": m["role"], "content": m["content"]} for m in messages]

    def step(self, row, messages):
        self.seen = sum(m["role"] == "assistant" for m in messages)
        out = self.env.step(messages[-1]["content"])
        self.rewards.append(float(out["reward"] or 0.0))
        self.done = bool(out["done"])
        return [] if self.done else list(out["observations"] or [])

    def reward(self, row, messages):
        if not self.done and sum(m["role"] == "assistant" for m in messages) > self.seen:
            self.step(row, messages)  # max_turns or the budget ended it: the environment scores the last turn
        return sum(self.rewards)

    def close(self):
        close = getattr(getattr(self, "env", None), "close", None)
        if callable(close):
            close()


@functools.cache
def environment(env_id):
    """The per-episode class of one SkyRL-Gym id."""
    return type(env_id, (SkyRLGym,), {"env_id": env_id, "__doc__": f"SkyRL-Gym's {env_id}, one an episode."})


def __getattr__(name):
    """`envs.skyrl_gym_adapter:<id>`: the class of a registered SkyRL-Gym id (PEP 562)."""
    if name.startswith("_") or name not in registry:
        raise AttributeError(name)
    return environment(name)
