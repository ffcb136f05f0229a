"""The record that crosses from the rollout (rollout.py) to the trainer (packing.py, update.py):
one episode's tokens, which of them the policy sampled, their logprobs and its advantage."""

import dataclasses
from typing import Optional


@dataclasses.dataclass
class Sample:
    """One episode as the trainer sees it. token_ids are every token after the prompt: the
    policy's (mask 1) and the environment's or the template's (mask 0, in the forward pass as
    context, out of every loss term). logprobs are the sampler's, 0.0 where mask is 0."""
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
