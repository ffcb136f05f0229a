r"""A verifiers environment (verifiers 0.4, `verifiers.v1`) played as an agent command: one episode of
the row through verifiers' own stack, its reward the environment's. Nothing in it knows the trainer
but the agent command's contract (the row as JSON on stdin, the endpoint in OPENAI_BASE_URL and
OPENAI_API_KEY, the reward printed last).

verifiers pins openai<3 and mcp==2.0.0, which the trainer's environment does not satisfy (the OpenAI
Agents SDK needs openai 3), so it runs in an environment of its own, the way verifiers' docs install
it; `uv` comes with it, since verifiers prepares its harness program with `uv sync --script`
(fetching that program's packages from the package index on first use):

    python3 -m venv .venv-verifiers && .venv-verifiers/bin/pip install "verifiers==0.4.0" uv
    .venv/bin/python scripts/prepare_smollm2.py    # models/smollm2-135m-instruct, once
    .venv/bin/python train.py --agent_cmd ".venv-verifiers/bin/python examples/verifiers_agent.py" \
        --model_name_or_path models/smollm2-135m-instruct --dataset calc --math_digits 2 \
        --max_prompt_length 128 --response_length 128 --num_unique_prompts_rollout 2 \
        --num_samples_per_prompt_rollout 4 --num_training_steps 3 --filter_zero_std_samples false \
        --output_dir output/verifiers

The environment: a verifiers Taskset of the trainer's rows, each a Task whose reward is verifiers'
own `verify_boxed_math_answer` (as its GSM8K tasksets score) on a box that holds a plain number (math-
verify would accept \boxed{214 + 659} for 873: the policy must compute, not box the question), played
by the built-in `null` harness (verifiers' plain chat program) in its local subprocess runtime, driven
as `vf-eval` drives one: `load_environment`, `serving()`, `run_slot()`. A published environment package
plugs in the same way, by its taskset id. verifiers starts its harness in a session of its own, out
of reach of the trainer's kill at `agent_timeout`: the whole episode has a deadline of its own,
EPISODE_TIMEOUT seconds (240 unless set), which must stay below the run's `agent_timeout`.
"""

import asyncio
import json
import os
import re
import shutil
import sys
import types
import uuid

import verifiers.v1 as vf
from verifiers.v1.env import RunSlot

TASKSET = "trainer_rows"  # the module verifiers imports a taskset by (made below)
EPISODE_TIMEOUT = float(os.environ.get("EPISODE_TIMEOUT", 240))  # below agent_timeout (300 unless set)
NUMBER = re.compile(r"\\boxed\{\s*-?\d+(\.\d+)?\s*\}")  # a box that holds a plain number
SYSTEM = "Give the final answer as \\boxed{number}."


class RowData(vf.TaskData):
    answer: str


class RowTask(vf.Task[RowData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        boxes = re.findall(r"\\boxed\{[^{}]*\}", trace.last_reply or "")
        if not boxes or not NUMBER.fullmatch(boxes[-1]):
            return 0.0
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
        agent=vf.AgentConfig(harness={"id": "null"}, runtime=vf.SubprocessConfig(), max_turns=1),
        timeout={"episode": EPISODE_TIMEOUT}))
    context = vf.ModelContext(model="policy", client=vf.EvalClientConfig(base_url=base_url, api_key_var=key_var))
    async with env.serving():
        episode = await env.run_slot(RunSlot(next(iter(env.taskset))), context)
    # raised, not returned: the trainer counts the run (agent_errors) and never trains on it
    errors = [(e.type, e.message) for e in episode.errors + [e for t in episode.traces for e in t.errors]]
    if not episode.ok or len(episode.traces) != 1:
        raise RuntimeError(f"the verifiers episode failed: {errors}")
    (trace,) = episode.traces
    if episode.is_timeout or trace.is_timeout or trace.stop_condition == "agent_timeout":  # verifiers scores 0.0
        raise TimeoutError(f"the verifiers episode timed out ({trace.stop_condition}): {errors}")
    return trace.reward


if __name__ == "__main__":
    print(asyncio.run(solve(json.load(sys.stdin), os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"])))
