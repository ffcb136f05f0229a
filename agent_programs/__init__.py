"""Agents that are programs (--agent, --agent_cmd), an optional concept in one folder: runner.py
(the programs in worker processes, the player of their episodes), gateway.py (the OpenAI-compatible
endpoint they call the policy through) and trace.py (what it records of what vLLM sampled). It uses
envs/ (the chat template's tokens, tool-call parsing). `rm -r agent_programs` leaves a trainer that
runs everything but agents; a plain run imports none of it.

Its door: train.py:choose_player makes runner.Agents, the run's player (episodes.Player), when
--agent or --agent_cmd is set. From there it is a player like the others: rollout.py calls its play,
and its episodes say which the reward must score (Episode.needs_reward).
"""
