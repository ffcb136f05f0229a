"""Agent programs (agent_programs/runner.py) in real worker processes against a scripted server: the
episodes they play through the gateway, their rewards, and the runs that raise, hang, crash,
never call the model or are refused, each counted and never trained on. test_agents_e2e.py runs
them with the real vLLM server and train.py."""

import math

import pytest
import torch

from agent_programs.runner import Agents
from config import Config
from helpers import IM_END, ScriptedClient
from rollout import score, sample_groups
from infra.worker_pool import RewardPool

PROGRAMS = '''
import os, threading, time, openai

def solve(row, base_url, api_key):
    mode = row["mode"]
    if mode == "idle":
        return None
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    if mode == "late":  # a call from a thread left running after the run returned: refused, not recorded
        client.chat.completions.create(model="any-name", messages=messages, temperature=0.3)
        late = lambda: (time.sleep(2.0), client.chat.completions.create(model="x", messages=messages))
        threading.Thread(target=late, daemon=True).start()
        return None
    for turn in range(2):
        reply = client.chat.completions.create(model="any-name", messages=messages, temperature=0.3)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        if mode == "raise" and turn == 1:
            raise RuntimeError("the agent broke")
        if mode == "hang":
            time.sleep(60)
        if mode == "crash":
            os._exit(3)
    return 0.75 if mode == "reward" else None

async def solve_async(row, base_url, api_key):
    return solve(row, base_url, api_key)
'''
MODES = ["ok", "reward", "raise", "hang", "crash", "idle", "late"]


def agents(tmp_path, tiny_model_dir, fn="solve", **overrides):
    from transformers import AutoTokenizer

    (tmp_path / "programs.py").write_text(PROGRAMS)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = Config(**dict(dict(agent=f"{tmp_path / 'programs.py'}:{fn}", agent_workers=3, agent_timeout=10.0,
                             max_prompt_length=64, response_length=40, max_turns=3, num_samples_per_prompt_rollout=2),
                        **overrides))
    a = Agents(cfg, tok)
    a.start()
    return cfg, tok, a


def rows(tok):
    out = []
    for mode in MODES:
        prompt = f"say {mode}"
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        out.append(dict(prompt=prompt, answer="ab", mode=mode, prompt_text=text, prompt_ids=tok(text)["input_ids"]))
    return out


def exact_reward(prompt, completion, example):
    return 1.0 if completion == "cd" and example["messages"][-1]["content"] == "cd" else 0.25


@pytest.mark.subprocess
@pytest.mark.parametrize("fn", ["solve", "solve_async"])
def test_programs_play_score_and_fail_apart(tmp_path, tiny_model_dir, fn):
    cfg, tok, a = agents(tmp_path, tiny_model_dir, fn)
    client = ScriptedClient(tok, ["ab", "cd", "ef"], IM_END)
    try:
        episodes, stats = a.play(client, rows(tok), 2, 1000, 1.0)
        by = {m: episodes[2 * i:2 * i + 2] for i, m in enumerate(MODES)}
        assert stats["agent_errors"] == 2 and stats["agent_timeouts"] == 2 and stats["agent_crashes"] == 2
        assert stats["agent_idle"] == 2 and stats["agent_refused"] == 0
        assert stats["agent_overrides"] == 4 + 4 + 4 + 2 + 2 + 2  # temperature=0.3 on every call made
        assert [e.turns for e in by["late"]] == [1, 1] and not any(e.failure for e in by["late"])
        for e in by["ok"] + by["reward"]:  # two calls, the second continuing the first: one sequence
            s = e.sample
            assert e.failure is None and e.turns == 2 and s.restarts == ()
            assert tok.decode(s.prompt_ids) == e.row["prompt_text"]  # the first call's prompt
            first, second = tok("ab")["input_ids"] + [IM_END], tok("cd")["input_ids"] + [IM_END]
            between = tok("\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
            assert s.token_ids == first + between + second
            assert s.mask == [1] * len(first) + [0] * len(between) + [1] * len(second)
            assert [round(x, 6) for x, m in zip(s.logprobs, s.mask) if m] == \
                [round(-0.1 * (j + 1), 6) for j in range(len(first))] * 2
            assert client.requests[0][1] == s.prompt_ids or any(p == s.prompt_ids for _, p in client.requests)
        for m in ("raise", "hang", "crash", "idle"):
            assert all(e.failure for e in by[m]), m
        assert "RuntimeError: the agent broke" in by["raise"][0].failure
        assert by["idle"][0].failure == "the agent never called the model"
        pool = RewardPool(exact_reward, workers=0, fallback=float("nan"))
        rewards, _ = score(pool, episodes)
        assert rewards[2:4] == [0.75, 0.75]  # the program's own number
        assert rewards[0:2] == [1.0, 1.0]  # None: the reward scored the final turn, "cd", and the conversation
        assert all(math.isnan(r) for r in rewards[4:12])
    finally:
        a.close()


@pytest.mark.subprocess
def test_a_reward_fn_is_added_to_a_returned_reward_and_failed_groups_leave(tmp_path, tiny_model_dir):
    cfg, tok, a = agents(tmp_path, tiny_model_dir, reward_fn=f"{__file__}:exact_reward", num_unique_prompts_rollout=7,
                        unscored_stop=1.0)
    try:
        pool = RewardPool(exact_reward, workers=0, fallback=float("nan"))
        samples, stats = sample_groups(cfg, ScriptedClient(tok, ["ab", "cd"], IM_END), rows(tok), 7, 1, pool,
                                       tok, a)
        # ok: 1 (the reward of "cd"); reward: 0.75 + 1; late: 0.25 ("ab"); the other four groups unscored and gone
        assert stats["unscored_groups"] == 4 and stats["unscored_episodes"] == 8
        assert sorted(stats["rewards"].tolist()) == [0.25, 0.25, 1.0, 1.0, 1.75, 1.75]
        assert len(samples) == 0  # the kept groups have equal rewards within: filtered as zero-std
        assert stats["filtered_groups"] == 3
        assert all(not math.isnan(s.adv) for s in samples)
    finally:
        a.close()


@pytest.mark.subprocess
def test_a_prompt_over_the_budget_is_refused_and_unscored(tmp_path, tiny_model_dir):
    cfg, tok, a = agents(tmp_path, tiny_model_dir, max_prompt_length=8)
    try:
        episodes, stats = a.play(ScriptedClient(tok, ["ab"], IM_END), rows(tok)[:1], 2, None, 0.0)
        assert stats["agent_refused"] == 2 and stats["agent_errors"] == 0  # the program saw HTTP 400 and raised
        assert all(e.failure.startswith("the gateway: the agent's first prompt is") for e in episodes)
        assert all("max_prompt_length=8" in e.failure for e in episodes)
        assert all(torch.tensor(e.sample.token_ids).numel() == 0 for e in episodes)
    finally:
        a.close()


def test_a_run_ends_its_episode_at_the_gateway(tmp_path, tiny_model_dir):
    """Program (what a worker runs) posts /end when the run returns, or raises: a call a thread of
    it makes later is refused, not recorded."""
    from transformers import AutoTokenizer

    from agent_programs.runner import Program
    from agent_programs.gateway import Gateway

    (tmp_path / "programs.py").write_text(PROGRAMS)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    g = Gateway(tok, Config(agent="x.py:f", max_prompt_length=64, response_length=40, max_turns=3))
    g.client = ScriptedClient(tok, ["ab", "cd"], IM_END)
    try:
        for mode in ("late", "raise"):
            url, key = g.open(mode, 1.0, lambda t: None)
            program = Program(f"{tmp_path / 'programs.py'}:solve", None, 5.0)
            try:
                program(dict(rows(tok)[0], mode=mode), url, key)
            except RuntimeError:
                assert mode == "raise"
            assert g.traces[key].closed, mode
            late = g.traces[key].calls
            import time

            time.sleep(3.0)  # the late thread's call (2 s after the run returned) is refused
            assert g.close(key).calls == late == (1 if mode == "late" else 2)
    finally:
        g.shutdown()


@pytest.mark.parametrize("expression", ["1" + "0" * 400 + " / 3", "1" + "0" * 400, "2" * 2000 + " * " + "3" * 2000,
                                        "1e308 * 10", "9**9**9", "-" * 5000 + "1"])
def test_the_calculator_agent_answers_an_overflow_as_the_policys_error(expression):
    """examples/calculator_agent.py: a policy-written expression too large (or too deep) to compute is
    the tool's answer "error: ...", as a malformed one is, never an exception that ends the run (and
    leaves the episode unscored)."""
    import os

    from helpers import ROOT
    from infra.user_code import load_object

    calculate = load_object(os.path.join(ROOT, "examples", "calculator_agent.py:calculate"), "agent")
    assert calculate(expression).startswith("error: ")
    assert (calculate("214 + 659"), calculate("7 / 2")) == ("873", "3.5")


def test_the_smolagents_example_raises_the_failure_smolagents_returns_as_its_answer(monkeypatch):
    """examples/smolagents_agent.py: at max_steps smolagents makes one more call, for the final answer,
    and returns that call's exception as text (provide_final_answer): the example raises it (the run
    counted, never trained on) instead of scoring it 0; a real answer is scored against the row's."""
    import os

    import smolagents

    from helpers import ROOT
    from infra.user_code import load_object

    solve = load_object(os.path.join(ROOT, "examples", "smolagents_agent.py:solve"), "agent")
    calls = []

    def generate(model, messages, stop_sequences=None, tools_to_call_from=None, **kwargs):
        calls.append(bool(tools_to_call_from))  # a step offers the tools; the final-answer call does not
        if not tools_to_call_from and fail:
            raise ConnectionError("the gateway went away")
        return smolagents.ChatMessage(role="assistant", content="5" if not tools_to_call_from else "thinking")

    monkeypatch.setattr(smolagents.OpenAIServerModel, "generate", generate)
    row = {"prompt": "What is 2 + 3?", "answer": "5"}
    fail = True
    with pytest.raises(RuntimeError, match="the gateway went away"):
        solve(row, "http://127.0.0.1:1/v1", "key")
    assert calls == [True, True, False]  # two steps, then the final-answer call
    fail = False
    assert (solve(row, "http://127.0.0.1:1/v1", "key"), solve(dict(row, answer="6"), "http://127.0.0.1:1/v1", "key")) \
        == (1.0, 0.0)


class Endless(ScriptedClient):
    """A server whose every request runs for minutes (a long answer on a slow machine) unless aborted:
    then it ends at once, with finish_reason "abort", as vLLM's /abort_requests ends it."""

    def __init__(self, tok):
        super().__init__(tok, ["ab"], IM_END)
        self.running, self.named = {}, []

    def submit(self, prompt_ids, n, max_tokens, temperature=1.0, top_p=1.0, seed=None, stop=(), server=None,
               request_id=None):
        import concurrent.futures
        import threading

        future, answer = concurrent.futures.Future(), super().submit(prompt_ids, n, max_tokens).result()
        self.running[request_id], _ = future, self.named.append(request_id)
        timer = threading.Timer(300, lambda: future.done() or future.set_result(answer))
        timer.daemon = True
        timer.start()
        return future

    def abort(self, request_ids):
        super().abort(request_ids)
        for r in request_ids:
            if r in self.running and not self.running[r].done():
                self.running[r].set_result([dict(token_ids=[5], logprobs=[-0.1], finish_reason="abort", eos=False,
                                                 version=0, text="")])
        return True


@pytest.mark.subprocess
def test_agent_timeout_bounds_the_step_its_call_in_flight_aborted(tmp_path, tiny_model_dir):
    """A program killed at agent_timeout while its call is sampled: the call is aborted at the server (by
    the id it was sent with), the step goes on at once, and the episode is unscored, nothing of the
    aborted call recorded. Before: the step waited for the call to run to the episode's response_length."""
    import time

    cfg, tok, a = agents(tmp_path, tiny_model_dir, agent_timeout=3.0)
    client = Endless(tok)
    try:
        started = time.perf_counter()
        episodes, stats = a.play(client, [r for r in rows(tok) if r["mode"] == "ok"], 2, 0, 1.0)
        took = time.perf_counter() - started
    finally:
        a.close()
    assert took < 3.0 + 30.0, took  # agent_timeout, the kill and one abort for both (a loaded machine): not 300 s
    assert stats["agent_timeouts"] == 2 and all(e.failure and e.sample.token_ids == [] for e in episodes)
    assert set(client.aborted) == set(client.named) and len(client.named) == 2


FAILING = '''
from agent_programs import PolicyFailed


def said_so(row, base_url, api_key):
    raise PolicyFailed("no answer", reward=row.get("reward"))


async def max_turns(row, base_url, api_key):
    from agents.exceptions import MaxTurnsExceeded

    raise MaxTurnsExceeded("Max turns (2) exceeded")


def broke(row, base_url, api_key):
    raise RuntimeError("the agent broke")
'''


@pytest.mark.parametrize("fn,row,why,reward", [
    ("said_so", {}, "PolicyFailed: no answer", None), ("said_so", {"reward": 0.5}, "PolicyFailed: no answer", 0.5),
    ("max_turns", {}, "MaxTurnsExceeded: Max turns (2) exceeded", None)])
def test_a_program_that_raises_the_policys_failure_returns_it(tmp_path, fn, row, why, reward):
    """In the worker, Program turns the policy's failure (faults.POLICY_EXCEPTIONS) into a value, its
    reward the one given; any other exception goes on to the pool, as ours."""
    from agent_programs.runner import Failed, Program

    (tmp_path / "failing.py").write_text(FAILING)
    out = Program(f"{tmp_path}/failing.py:{fn}", None, 1.0)(row, "http://127.0.0.1:9", "key")  # /end: refused
    assert isinstance(out, Failed) and (out.why, out.reward) == (why, reward)
    with pytest.raises(RuntimeError, match="the agent broke"):
        Program(f"{tmp_path}/failing.py:broke", None, 1.0)({}, "http://127.0.0.1:9", "key")
