"""The fault matrix: every row of faults.FAULTS, made to happen on purpose, for a shared and a
per-episode environment, in the trainer (workers=0) and in worker processes, against a scripted
server. Each cell plays one step of two prompts (the first's episodes fail, the second's do not) and
asserts whose failure it was: the policy's is told to it as a tool message and its group trains; ours
leaves its episodes unscored and its group out of the batch, and nothing of it reaches a sample.
Cells that cannot happen are skipped by name: a timeout or a crash needs a worker, a reset per
episode or an instance to lose needs a per-episode environment, an agent program always runs in a
worker and has no environment. The counts are the metric each row names."""

import os

import pytest

from config import Config
from envs.environment import Environment
from infra.faults import FAULTS, OURS, POLICY
from helpers import IM_END, ScriptedClient, with_prompts
from rollout import sample_groups
from infra.worker_pool import RewardPool

ENV = '''
import os, signal, time
from envs.tool_calls import Starved, ToolError, Unavailable


class Faulty:
    """Answers <calc> with "ok"; the row's "fault" picks how its calls fail."""

    stop = ["</calc>"]

    def reset(self, row):
        if row.get("fault") == "tool_resets":
            raise RuntimeError("reset broke")
        if row.get("fault") == "tool_reset_mismatch":  # set after the prompt's rendering: another board
            return [{"role": "user", "content": row["prompt"] + " (another board)"}]
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, row, messages):
        turn = sum(m["role"] == "assistant" for m in messages)  # the policy's turns so far
        fault = row.get("fault") if turn == (2 if row.get("fault") == "tool_lost" else 1) else None
        if "<calc>" not in messages[-1]["content"]:
            return []
        if fault == "tool_bad_calls":
            raise ToolError("no such expression")
        if fault == "tool_errors":
            raise ValueError("the environment broke")
        if fault == "tool_unavailable":
            raise Unavailable("the sandbox did not start")
        if fault == "tool_starved":
            raise Starved("the code ran past 5 s, 4.2 s of it waiting for a CPU")
        if fault == "tool_timeouts":
            time.sleep(60)
        if fault in ("tool_crashes", "tool_lost"):
            os.kill(os.getpid(), signal.SIGKILL)
        return [{"role": "tool", "content": "ok"}]

    def reward(self, row, messages):
        fault = row.get("fault")
        if fault == "reward_errors":
            raise KeyError("solution")
        if fault == "reward_timeouts":
            time.sleep(60)
        if fault == "reward_crashes":
            os.kill(os.getpid(), signal.SIGKILL)
        return 1.0 if row.get("good") else 0.5


faulty = Faulty()


class Plain(Faulty):
    """No reward of its own: the TRL reward alone scores its episodes."""

    reward = None


plain = Plain()


def trl_reward(completions, fault=(None,), **kwargs):  # a column, as TRL passes it: one value per completion
    return [None if fault[0] == "reward_none" else 1.0]
'''

PROGRAM = '''
import os, signal, time, openai


def solve(row, base_url, api_key):
    fault = row["fault"]
    if fault == "agent_idle":
        return None
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    try:
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}],
                                       **(dict(tools=tools) if fault == "agent_refused" else {}))
    except openai.APIStatusError:
        return None  # the program gave up on a call the gateway refused: still ours
    if fault == "agent_policy_failures":
        from agent_programs import PolicyFailed

        raise PolicyFailed("still calling tools at its last turn")
    if fault == "agent_errors":
        raise RuntimeError("the agent broke")
    if fault == "agent_timeouts":
        time.sleep(60)
    if fault == "agent_crashes":
        os.kill(os.getpid(), signal.SIGKILL)
    return 1.0 if row.get("good") else 0.5
'''

SCRIPT = ["<calc>1+1</calc>", "<calc>2+2</calc>", "done"]
KINDS = ["shared", "per-episode"]


def env_cell(tmp_path, tok, fault, kind, workers, **kw):
    """One step of two prompts with an --environment; the first prompt's episodes meet `fault`."""
    (tmp_path / "env.py").write_text(ENV)
    name = "plain" if fault == "reward_none" else "faulty"
    spec = f"{tmp_path}/env.py:{name if kind == 'shared' else name.capitalize()}"
    reward_fn = f"{tmp_path}/env.py:trl_reward" if fault == "reward_none" else None
    cfg = Config(environment=spec, tool_workers=workers, tool_timeout=6.0, max_prompt_length=200, response_length=256,
                 max_turns=3, num_samples_per_prompt_rollout=2, num_unique_prompts_rollout=2, unscored_stop=1.0,
                 filter_zero_std_samples=False, reward_fn=reward_fn, **kw)
    env = Environment(spec, tok, cfg)
    env.start()
    pool = RewardPool(reward_fn or "rewards:copy_reward", workers=workers, timeout=6.0, fallback=float("nan"))
    try:
        rows = with_prompts(env, tok, [dict(prompt="a", answer="x"), dict(prompt="b", answer="x", good=True)])
        rows[0]["fault"] = fault  # after the prompts' rendering, which resets too
        return sample_groups(cfg, ScriptedClient(tok, SCRIPT), rows, 0, 1, pool, tok, env)
    finally:
        pool.close()
        env.close()


def agent_cell(tmp_path, tok, fault):
    from agent_programs.runner import Agents

    (tmp_path / "agent.py").write_text(PROGRAM)
    cfg = Config(agent=f"{tmp_path}/agent.py:solve", agent_workers=2, agent_timeout=6.0, max_prompt_length=64,
                 response_length=40, num_samples_per_prompt_rollout=2, num_unique_prompts_rollout=2, unscored_stop=1.0,
                 filter_zero_std_samples=False)
    agents = Agents(cfg, tok)
    agents.start()
    rows = []
    for i, prompt in enumerate(["a", "b"]):
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        rows.append(dict(prompt=prompt, answer="x", fault=fault if i == 0 else None, good=i == 1, prompt_text=text,
                         prompt_ids=tok(text)["input_ids"]))
    pool = RewardPool("rewards:copy_reward", workers=0, fallback=float("nan"))
    try:
        return sample_groups(cfg, ScriptedClient(tok, ["ab"], IM_END), rows, 0, 1, pool, tok, agents)
    finally:
        agents.close()


def cells():
    for fault, (whose, _) in FAULTS.items():
        if fault.startswith("agent_"):
            yield pytest.param(fault, "agent", 2, marks=pytest.mark.subprocess, id=f"{fault}-agent-worker")
            continue
        for kind in KINDS:
            for workers in (0, 2):
                if workers == 0 and fault in ("tool_timeouts", "tool_crashes", "tool_lost", "reward_timeouts",
                                              "reward_crashes"):
                    continue  # in the trainer there is no timeout and no worker to die
                if kind == "shared" and fault in ("tool_resets", "tool_reset_mismatch", "tool_lost"):
                    continue  # a shared environment has no instance per episode (its reset runs at load time)
                marks = [pytest.mark.subprocess] if workers else []
                yield pytest.param(fault, kind, workers, marks=marks,
                                   id=f"{fault}-{kind}-{'worker' if workers else 'in-process'}")


@pytest.mark.parametrize("fault,kind,workers", list(cells()))
def test_every_failure_is_attributed_once(tiny_model_dir, tmp_path, fault, kind, workers):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    samples, m = agent_cell(tmp_path, tok, fault) if kind == "agent" else \
        env_cell(tmp_path, tok, fault, kind, workers)
    others = {k: v for k, v in m.items() if k in FAULTS and k != fault and v}
    # Two workers, episodes pinned k % 2: the first prompt's episodes 0 and 1 fail in workers 0 and 1, and
    # where that kills a worker after the second prompt's episodes 2 and 3 made their instances there
    # (at their second step, or at the reward), those are lost with it: counted as lost, unscored too.
    killed = {"tool_lost": "tool_crashes", "reward_timeouts": fault, "reward_crashes": fault}
    if kind == "per-episode" and workers and fault in killed:
        assert m[killed[fault]] == 2 and m["tool_lost"] == 2 and len(others) == 1, m
        assert samples == [] and m["unscored_groups"] == 2 and m["unscored_episodes"] == 4, m
        return
    assert m[fault] == 2 and others == {}, m  # the two episodes of the first prompt, and nothing else
    told = ["error:" in tok.decode(s.token_ids) for s in samples]
    if FAULTS[fault][0] == POLICY:
        assert len(samples) == 4 and m["unscored_groups"] == 0 and m["unscored_episodes"] == 0, m
        # told to the policy, and trained on; an agent's failure is its program's to tell (agent_programs.PolicyFailed)
        assert told == ([False] * 4 if kind == "agent" else [True, True, False, False])
    else:
        assert FAULTS[fault][0] == OURS
        assert len(samples) == 2 and m["unscored_groups"] == 1 and m["unscored_episodes"] == 2, m
        assert told == [False, False] and [s.reward for s in samples] == [1.0, 1.0]  # the second prompt's


def test_the_docs_table_is_the_code_table():
    """docs/operations.md's "Whose failure is it" lists every row of faults.FAULTS, with whose it is."""
    import re

    text = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "operations.md")).read()
    rows = re.findall(r"^\| `(\w+)` \| (the policy|ours) \| (.+) \|$", text, re.M)
    assert [(k, w) for k, w, _ in rows] == [(k, "the policy" if w == POLICY else "ours") for k, (w, _) in FAULTS.items()]


CHECKED = '''
class Instance:
    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, row, messages):
        return []

    def check(self):
        raise RuntimeError("no GPU here")


def factory():
    return Instance()
'''


@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=pytest.mark.subprocess)])
@pytest.mark.parametrize("name", ["Instance", "factory"])
def test_an_environment_that_cannot_run_here_is_refused_at_start(tiny_model_dir, tmp_path, workers, name):
    """check() runs on an instance, as the episodes' (a class's method, a factory's product), where the
    calls run: its failure is one line, before any episode."""
    from transformers import AutoTokenizer

    (tmp_path / "env.py").write_text(CHECKED)
    cfg = Config(environment=f"{tmp_path}/env.py:{name}", tool_workers=workers, max_prompt_length=200)
    env = Environment(cfg.environment, AutoTokenizer.from_pretrained(tiny_model_dir), cfg)
    with pytest.raises(ValueError, match=r"^environment=.* cannot run here: RuntimeError: no GPU here$"):
        env.start()


@pytest.mark.subprocess
def test_a_sandbox_that_cannot_start_stops_the_run_before_training(tiny_model_dir, tmp_path):
    """bwrap that cannot make namespaces (as in a container that forbids them): train.py with the Python
    tool stops at start-up in one line naming the fix, before any step; before, each episode's tool
    message was the sandbox's failure, trained on as the policy's mistake."""
    import subprocess
    import sys

    from helpers import ENV, ROOT

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "bwrap").write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    (fake / "bwrap").chmod(0o755)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--model_name_or_path", tiny_model_dir,
                          "--output_dir", str(tmp_path / "out"), "--environment", "envs.python_tool:PythonTool",
                          "--max_prompt_length", "400", "--num_training_steps", "2", "--tool_workers", "1"],
                         env=dict(ENV, PATH=f"{fake}:{ENV['PATH']}"), capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith("error: environment='envs.python_tool:PythonTool' cannot run "
                                                     "here: ") and "bwrap: No permissions" in errors[0], errors
    assert "namespaces" in errors[0]
    log = tmp_path / "out" / "metrics.jsonl"  # step 0 (what the run read) at most: no step ran
    assert not log.exists() or all('"step": 0' in line for line in log.read_text().splitlines())
