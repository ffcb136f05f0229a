"""Multi-turn environments (--environment), one concept a file: the player on the trainer's side
(environment.py), the calls in the tool workers (calls.py), the chat template's tokens of their
messages (chat.py), native tool calls (tool_calls.py), the built-in calculator (calculator.py), the
Python tool (python_tool.py) and its sandbox (sandbox.py, sandbox_process.py), and OpenEnv
environments (openenv_adapter.py). agent_programs/ uses chat.py and tool_calls.py.

Its door: train.py:choose_player makes envs.environment.Environment, the run's player, when
--environment is set; worker_pool.py's forkserver also preloads envs.calls by name in every pool (a
plain run's reward workers too; skipped where it is missing). A regular package, so that no other
`envs` on the path can stand in for it; it imports nothing.
"""
