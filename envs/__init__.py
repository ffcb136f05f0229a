"""Multi-turn environments (--environment), one concept a file: the runner on the trainer's side
(environment.py), the calls in the tool workers (calls.py), the built-in calculator
(calculator.py), the Python tool (python_tool.py) and its sandbox (sandbox.py, sandbox_process.py),
and OpenEnv environments (openenv_adapter.py). Its door: startup.py's load_inputs imports
envs.environment when --environment is set; worker_pool.py's forkserver also preloads envs.calls
by name in every pool (a plain run's reward workers too; skipped where it is missing). A regular
package, so that no other `envs` on the path can stand in for it; it imports nothing.
"""
