"""Environments others wrote: a TextArena game (`textarena`: `ta.make(env_id)`, `reset(num_players,
seed)`, `get_observation()`, `step(action) -> (done, info)`, `close() -> rewards`), single-player,
by its id, with no glue:

    --environment envs.textarena_adapter:GuessTheNumber-v0 --max_turns 10 --dataset copy ...

Any id of TextArena's registry is a name of this module (a class made for it on first use; an
id it does not know is refused at load, in one line). Each episode: `ta.make(id)`, then
`reset(num_players=1, seed=...)`, whose first observation is the first user message; each
policy turn is one `step(text)`, and what the game added to the observation since the last one
the policy read comes back as a user message, until the game says done. The episode's reward is
the game's (player 0's of `close()`); a game that max_turns or the token budget ended first has
its last turn stepped at the end, so that the game judges it, and one still undecided then earns
0.0 (TextArena has no reward for an unfinished game).

The game is drawn from its seed, so the rows only pick seeds: the row's "seed" if it has one, else
the seed `reset` is given (the row's, from the trainer: envs/calls.row_seed, a hash of the row), the same at the load-time render of the prompt and in every episode of the row, so the policy
plays the board it was shown. Any dataset gives rows (`--dataset copy`: 340 prompts, 340
games); a .jsonl of {"prompt": "", "seed": n} names the games.

Its doors: none; --environment names it (infra/user_code.load_object reads the id as an attribute).
"""

import functools

import textarena as ta
from textarena.envs.registration import ENV_REGISTRY

from envs.calls import row_seed  # the row's "seed", else a hash of the row: the trainer's rule


def render(observation):
    """An observation as text: TextArena's wrapped games give a string, its "-raw" ids a list of
    (sender, message, kind) entries."""
    if isinstance(observation, str):
        return observation
    return "\n".join(str(entry[1]) if isinstance(entry, (tuple, list)) and len(entry) > 1 else str(entry)
                     for entry in observation)


class TextArena:
    """One single-player TextArena game per episode (a per-episode environment); env_id is set by
    the class this module makes for each id."""

    env_id = None

    def reset(self, row, seed=None):
        self.env, self.done, self.seen = ta.make(self.env_id), False, 0
        self.env.reset(num_players=1, seed=row_seed(row) if seed is None else seed)
        self.read = ""  # what the policy has read of the game's observation
        return [{"role": "user", "content": self.observe()}]

    def observe(self):
        """What the game added to its observation since the policy last read it: the wrapped games
        repeat the whole history in each observation, which the conversation already holds."""
        _, observation = self.env.get_observation()
        text = render(observation)
        new = text[len(self.read):] if text.startswith(self.read) else text
        self.read = text
        return new.strip() or text.strip()

    def step(self, row, messages):
        self.seen = sum(m["role"] == "assistant" for m in messages)
        done, _ = self.env.step(messages[-1]["content"])
        self.done = bool(done)
        return [] if self.done else [{"role": "user", "content": self.observe()}]

    def reward(self, row, messages):
        if not self.done and sum(m["role"] == "assistant" for m in messages) > self.seen:
            self.step(row, messages)  # max_turns or the budget ended it: the game judges the last turn
        if not self.done:
            return 0.0
        rewards = self.env.close()
        rewards = rewards[0] if isinstance(rewards, tuple) else rewards  # (rewards, game_info) since 0.7
        return float((rewards or {}).get(0, 0.0))


@functools.cache
def game(env_id):
    """The per-episode class of one TextArena id."""
    return type(env_id, (TextArena,), {"env_id": env_id, "__doc__": f"TextArena's {env_id}, one game an episode."})


def __getattr__(name):
    """`envs.textarena_adapter:<id>`: the class of a registered TextArena id (PEP 562)."""
    if name.startswith("_") or name not in ENV_REGISTRY:
        raise AttributeError(name)
    return game(name)
