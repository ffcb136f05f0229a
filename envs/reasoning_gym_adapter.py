"""Environments others wrote: a reasoning-gym dataset (`reasoning-gym`:
`reasoning_gym.create_dataset(name, size=, seed=)`, items of question, answer and metadata,
`dataset.score_answer(answer, entry)`), by its name, with no glue:

    --environment envs.reasoning_gym_adapter:leg_counting --dataset copy ...

Any name of reasoning-gym's registry is a name of this module (a class made for it on first use; a
name it does not know is refused at load, in one line). One turn an episode: the first messages are
reasoning-gym's own system prompt (SYSTEM_PROMPTS["default"]: think, then the answer in
<answer>...</answer>) and the item's question; the reward is the dataset's score_answer of what the
policy wrote in the answer tags (reasoning_gym.utils.extract_answer; none: its score of None, 0).

The items are procedural, drawn from a seed, so the rows only pick seeds, as for TextArena's games:
the item is item 0 of the dataset made with the row's "seed" if it has one, else the seed `reset`
is given (the row's, from the trainer: envs/calls.row_seed, a hash of the row), the same at the
prompt's render and in every episode of the row. Any dataset gives rows (`--dataset copy`: 340
prompts, 340 items); a .jsonl of {"prompt": "", "seed": n} names the items. A dataset's settings
(difficulty, ...) are a subclass's `config`:

    # legs.py: --environment legs.py:Legs
    from envs.reasoning_gym_adapter import ReasoningGym
    class Legs(ReasoningGym):
        name, config = "leg_counting", dict(min_animals=2, max_animals=4)

An environment rather than a dataset and a reward: one flag names the task, its prompts and its
reward, which read the same item, and no file of rows has to be written first.

Its doors: none; --environment names it (infra/user_code.load_object reads the name as an attribute).
"""

import functools

import reasoning_gym
from reasoning_gym.factory import DATASETS
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

from envs.calls import row_seed  # the row's "seed", else a hash of the row: the trainer's rule


class ReasoningGym:
    """One reasoning-gym item per episode (a per-episode environment): name is the dataset's, config
    its settings."""

    name, config = None, {}

    def reset(self, row, seed=None):
        seed = row_seed(row) if seed is None else seed
        self.dataset = reasoning_gym.create_dataset(self.name, size=1, seed=seed, **self.config)
        self.entry = self.dataset[0]
        return [{"role": "system", "content": SYSTEM_PROMPTS["default"]},
                {"role": "user", "content": self.entry["question"]}]

    def step(self, row, messages):
        return []  # one turn: the answer is scored by reward

    def reward(self, row, messages):
        return float(self.dataset.score_answer(extract_answer(messages[-1]["content"]), self.entry))


@functools.cache
def dataset(name):
    """The per-episode class of one reasoning-gym dataset."""
    return type(name, (ReasoningGym,), {"name": name, "__doc__": f"reasoning-gym's {name}, one item an episode."})


def __getattr__(name):
    """`envs.reasoning_gym_adapter:<name>`: the class of a registered reasoning-gym dataset (PEP 562)."""
    if name.startswith("_") or name not in DATASETS:
        raise AttributeError(name)
    return dataset(name)
