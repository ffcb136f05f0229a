"""Agents that are programs (--agent, --agent_cmd), an optional concept in one folder: runner.py
(the programs in worker processes, the player of their episodes), gateway.py (the OpenAI-compatible
endpoint they call the policy through) and trace.py (what it records of what vLLM sampled). It uses
envs/ (the chat template's tokens, tool-call parsing). `rm -r agent_programs` leaves a trainer that
runs everything but agents; a plain run imports none of it.

Its door: train.py:choose_player makes runner.Agents, the run's player (episodes.Player), when
--agent or --agent_cmd is set. From there it is a player like the others: rollout.py calls its play,
and its episodes say which the reward must score (Episode.needs_reward).
"""


class PolicyFailed(Exception):
    """Raised by an --agent function: the policy failed here (it never stopped calling tools, it gave
    arguments no tool takes, ...). The episode is the policy's mistake (faults: agent_policy_failures):
    scored and trained on, as if the function had returned `reward`; None, the default, leaves the
    conversation as it stands to the reward (--reward_fn, or the dataset's). Any other exception is ours:
    the episode is unscored. The frameworks' own limits count as this (faults.POLICY_EXCEPTIONS)."""

    def __init__(self, why="the policy failed", reward=None):
        super().__init__(why)
        self.reward = reward
