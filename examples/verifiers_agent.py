"""A verifiers environment (verifiers 0.4, `verifiers.v1`) played as an agent command: one episode of
the row through verifiers' own stack, its reward the environment's. Nothing in it knows the trainer
but the agent command's contract (the row as JSON on stdin, the endpoint in OPENAI_BASE_URL and
OPENAI_API_KEY, the reward printed last).

verifiers pins openai<3 and mcp==2.0.0, which the trainer's environment does not satisfy (the OpenAI
Agents SDK needs openai 3), so it runs in an environment of its own, the way verifiers' docs install
it; `uv` comes with it, since verifiers prepares its harness program with `uv sync --script`
(fetching that program's packages from the package index on first use):

    python3 -m venv .venv-verifiers && .venv-verifiers/bin/pip install "verifiers==0.4.0" uv
    .venv/bin/python train.py --agent_cmd ".venv-verifiers/bin/python examples/verifiers_agent.py" \\
        --dataset calc ...

The environment: a verifiers Taskset of the trainer's rows, each a Task whose reward is verifiers'
own `verify_boxed_math_answer` (as its GSM8K tasksets score), played by the built-in `null` harness
(verifiers' plain chat program) in its local subprocess runtime, driven as `vf-eval` drives one:
`load_environment`, `serving()`, `run_slot()`. A published environment package plugs in the same way,
by its taskset id. verifiers starts its harness in a session of its own, out of reach of the
trainer's kill at `agent_timeout`: the rollout's own timeout (ROLLOUT_TIMEOUT) stays below it.
"""

import asyncio
import json
import os
import shutil
import sys
import types
import uuid

import verifiers.v1 as vf
from verifiers.v1.env import RunSlot

TASKSET = "trainer_rows"  # the module verifiers imports a taskset by (made below)
ROLLOUT_TIMEOUT = 240  # seconds; the trainer's agent_timeout is 300 by default
SYSTEM = "Give the final answer as \\boxed{number}."


class RowData(vf.TaskData):
    answer: str


class RowTask(vf.Task[RowData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return vf.verify_boxed_math_answer(trace.last_reply, self.data.answer)


class RowsConfig(vf.TasksetConfig):
    rows: list[dict] = []


class RowsTaskset(vf.Taskset[RowTask, RowsConfig]):
    def load(self):
        for row in self.config.rows:
            yield RowTask(RowData(prompt=row["prompt"], answer=str(row["answer"]), system_prompt=SYSTEM),
                          self.config.task)


sys.modules[TASKSET] = types.ModuleType(TASKSET)
sys.modules[TASKSET].RowsTaskset, sys.modules[TASKSET].__all__ = RowsTaskset, ["RowsTaskset"]
if shutil.which("uv") is None:  # the uv installed beside verifiers, when none is on PATH
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")


async def solve(row, base_url, api_key):
    # verifiers reads the key from a variable it is told the name of; its runtime keeps every variable
    # named *API_KEY* out of the harness program's environment
    key_var = f"EPISODE_API_KEY_{uuid.uuid4().hex}"
    os.environ[key_var] = api_key
    env = vf.load_environment(vf.SingleAgentEnvConfig(
        taskset=RowsConfig(id=TASKSET, rows=[{"prompt": row["prompt"], "answer": row["answer"]}]),
        agent=vf.AgentConfig(harness={"id": "null"}, runtime=vf.SubprocessConfig(), max_turns=1,
                             timeout={"rollout": ROLLOUT_TIMEOUT})))
    context = vf.ModelContext(model="policy", client=vf.EvalClientConfig(base_url=base_url, api_key_var=key_var))
    async with env.serving():
        episode = await env.run_slot(RunSlot(next(iter(env.taskset))), context)
    (trace,) = episode.traces
    if not episode.ok:  # raised: the trainer counts the run (agent_errors) and never trains on it
        errors = [(e.type, e.message) for e in episode.errors + trace.errors]
        raise RuntimeError(f"the verifiers episode failed: {errors}")
    if trace.is_timeout or trace.stop_condition == "agent_timeout":  # verifiers would score it 0.0
        raise TimeoutError(f"the verifiers rollout timed out ({trace.stop_condition})")
    return trace.reward


if __name__ == "__main__":
    print(asyncio.run(solve(json.load(sys.stdin), os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"])))
