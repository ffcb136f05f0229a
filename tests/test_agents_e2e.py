"""Agent programs end to end, on the tiny model and real vLLM CPU servers: the gateway (agent_programs/gateway.py)
records exactly what the server sampled, for a plain OpenAI-client agent and for the OpenAI Agents
SDK's Runner; train.py trains with an --agent (async, LoRA, an EMA reference, resume) and with an
--agent_cmd whose faults are counted, and stops in one line when the command fails every episode.
The tiny model samples random text, so tool calls are rare: these tests are about the plumbing."""

import asyncio
import concurrent.futures
import importlib.util
import os
import re
import subprocess
import sys

import openai
import pytest

from agent_programs import gateway
from infra import vllm_server
from config import Config
from helpers import command, flags, metrics, prompt_logprobs, run, serve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SDK_AGENT = os.path.join(ROOT, "examples", "agents_sdk_agent.py")
PORT = 8063
ATOL = 1e-3  # float32 server, the same weights: its sampling logprobs and its prompt logprobs agree


def chat_agent(base_url, api_key):
    """A plain OpenAI-client agent, no tools: a question, then "next" after each reply, twice.
    Returns the text of each reply as the agent got it."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "system", "content": "be brief."}, {"role": "user", "content": "say something."}]
    got = []
    for turn in range(3):
        reply = client.chat.completions.create(model="any", messages=messages, max_tokens=8)
        got.append(reply.choices[0].message.content)
        messages.append({"role": "assistant", "content": got[-1]})
        if turn < 2:
            messages.append({"role": "user", "content": "next"})
    return got


def runs(mask):
    """The (start, end) of each run of 1s in a mask."""
    out = []
    for i, m in enumerate(mask):
        if m and (i == 0 or not mask[i - 1]):
            out.append([i, i + 1])
        elif m:
            out[-1][1] = i + 1
    return [tuple(r) for r in out]


def check_logprobs(client, sample):
    """The server's own logprobs of the recorded tokens, where they were sampled (mask 1), are the
    recorded ones (sampled at temperature 1, where vLLM's sampling logprobs are the model's)."""
    s = sample
    assert len(s.token_ids) == len(s.mask) == len(s.logprobs) and any(s.mask)
    (scored,) = prompt_logprobs(client, [s.prompt_ids + s.token_ids])
    at = len(s.prompt_ids) - 1  # score's list starts at the sequence's second token
    sampled = [(i, lp) for i, (m, lp) in enumerate(zip(s.mask, s.logprobs)) if m]
    diff = max(abs(scored[at + i] - lp) for i, lp in sampled)
    assert diff < ATOL, (diff, sampled[:5], [scored[at + i] for i, _ in sampled[:5]])
    assert all(lp == 0.0 for m, lp in zip(s.mask, s.logprobs) if not m)


# the server of the gateway test below, and "the user's" of the agent command's runs (they push their weights first)
SERVED = Config(agent="tests/agent.py:solve", max_turns=4, max_prompt_length=384, response_length=128,
                vllm_startup_timeout=400, vllm_request_timeout=60, vllm_max_retries=1, vllm_enforce_eager=True)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    _, client = serve(tiny_model_dir, str(tmp_path_factory.mktemp("server")), PORT, SERVED)
    yield client
    vllm_server.stop_server(client.proc)


@pytest.mark.slow
def test_gateway_samples_are_what_the_server_sampled(server, tiny_model_dir):
    """One vLLM server, the gateway in this process: three plain OpenAI-client agents at once (three
    calls each, every call extending the last) and the Agents SDK's calculator agent. Each episode's
    sample is one sequence (no restart) of its first prompt, its sampled turns (mask 1) with the new
    user turns between them (mask 0); the text each agent got is the recorded turn's; and the
    server's own logprobs of the recorded tokens are the recorded logprobs, at temperature 1."""
    from transformers import AutoTokenizer

    from envs import tool_calls
    from envs.chat import ChatTokens

    # the Agents SDK's prompt (its instructions are the calculator's system message) is ~300 characters
    # agent= (never loaded here) makes the episodes multi-turn: max_turns calls each
    cfg, client = SERVED, server
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    plain = gateway.Gateway(tok, cfg)
    sdk = gateway.Gateway(tok, cfg, parser=tool_calls.Parser("hermes", tok, None))
    try:
        plain.client = sdk.client = client
        keys = [plain.open(f"e{k}", 1.0, lambda t, k=k: 1000 + 10 * k + t) for k in range(3)]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda uk: chat_agent(*uk), keys))
        first = ChatTokens(tok).prompt_ids([{"role": "system", "content": "be brief."},
                                            {"role": "user", "content": "say something."}])
        for (_, key), texts in zip(keys, got):
            trace = plain.close(key)
            s = trace.sample
            assert trace.failure is None and trace.calls == 3 and trace.overrides == 0
            assert s.prompt_ids == first and s.restarts == () and s.versions == (0, 0, 0)
            turns = runs(s.mask)
            assert len(turns) == 3, s.mask  # each call continued the sample: 3 sampled turns, new turns between
            assert turns[0][0] == 0 and len(s.token_ids) <= cfg.response_length
            for (a, b), text in zip(turns, texts):  # the agent got the text of what was recorded
                assert 1 <= b - a <= 8
                ids = s.token_ids[a:b]
                assert text == tok.decode(ids[:-1] if ids[-1] == tok.eos_token_id else ids, skip_special_tokens=False)
            for (_, b), (a, _) in zip(turns, turns[1:]):  # between the turns: the template's "next" turn, as is
                assert "<|im_start|>user\nnext<|im_end|>\n<|im_start|>assistant\n" in tok.decode(s.token_ids[b:a])
            check_logprobs(client, s)
        # the three episodes were seeded apart: they sampled differently
        assert len({tuple(t) for t in got}) == 3

        # the OpenAI Agents SDK's Runner, as it is (tools, its own temperature), through the gateway
        spec = importlib.util.spec_from_file_location("agents_sdk_agent", SDK_AGENT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        url, key = sdk.open("sdk", 1.0, lambda t: 2000 + t)
        assert asyncio.run(module.solve({"prompt": "What is 2 + 3?", "answer": "5"}, url, key)) is None
        trace = sdk.close(key)
        assert trace.failure is None and trace.calls >= 1, trace.failure
        assert trace.overrides >= 1  # it asked for temperature 0.7: the trainer's 1.0 was kept
        assert "hat is 2 + 3?" in tok.decode(trace.sample.prompt_ids)  # the tiny tokenizer drops capitals
        check_logprobs(client, trace.sample)
        # a call in flight is ended by the id it was sent with (Gateway.close, for a program that timed out):
        # the engine paused, the request waits, and the abort ends it there, whatever its length
        client.pause()
        try:
            waiting = client.submit(first, 1, 100, 1.0, 1.0, seed=1, request_id="a-call-in-flight")
            assert not concurrent.futures.wait([waiting], timeout=2).done and client.abort(["a-call-in-flight"])
            out = waiting.result(timeout=30)[0]
        finally:
            client.resume()
        assert out["finish_reason"] == "abort" and out["token_ids"] == []
    finally:
        for g in (plain, sdk):
            g.shutdown()


AGENT_RUN = ["--dataset", "calc", "--agent", "examples/calculator_agent.py:solve", "--tool_call_parser", "hermes",
             "--max_prompt_length", "512",  # the agent's prompt: ~440 characters, a token each for the tiny tokenizer
             "--response_length", "32", "--max_turns", "2", "--num_unique_prompts_rollout", "2",
             "--num_samples_per_prompt_rollout", "2", "--agent_workers", "2", "--async_steps", "1",
             "--truncated_importance_sampling_ratio_cap", "2.0",  # async_steps wants a correction of staleness
             "--lora_rank", "8", "--load_ref_policy", "true", "--alpha", "0.5", "--checkpoint_state_freq", "2",
             "--filter_zero_std_samples", "false"]  # a group whose rewards agree trains too (its KL term)


@pytest.mark.slow
def test_train_with_an_agent_program_async_lora_ema_and_resume(tiny_model_dir, tmp_path):
    """examples/calculator_agent.py:solve plays every episode through the gateway, generation one step
    ahead, LoRA adapters with an EMA reference adapter (beta 0.1, ref_policy_update_freq 1, alpha 0.5):
    every step trains, no episode is lost, the server's logprobs are the trainer's; the run resumes
    from its last checkpoint to a 4th step, where the server, serving the resumed adapter, agrees again.
    A reward on the parity of the answer's length (the tiny model never answers right) gives groups
    advantages, so the adapter moves and the EMA reference lags it (kl > 0)."""
    (tmp_path / "r.py").write_text("def reward(prompt, completion, example):\n"
                                   "    return float(len(completion) % 2)\n")
    run_flags = AGENT_RUN + ["--reward_fn", f"{tmp_path}/r.py:reward", "--learning_rate", "1e-2"]
    out = run(command("train.py", 1) + flags(tiny_model_dir, tmp_path, 3, *run_flags))
    assert out.returncode == 0, out.stderr[-4000:]
    assert f"examples/calculator_agent.py:solve's return + {tmp_path}/r.py:reward" in out.stdout, out.stdout[-3000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3], rows

    def check(r):
        assert {r[f"agent_{k}"] for k in ("errors", "timeouts", "crashes", "refused", "idle")} == {0}, r
        assert r["unscored_groups"] == 0 and r["turns"] >= 1 and r["response_length"] > 0, r
        # every step trains; the sync check (over the tokens the current weights sampled) holds
        assert r["trained_tokens"] > 0 and r["vllm_logp_diff_max"] < 1e-4, r
    for r in rows:
        check(r)
    # step 1 was sampled by the start weights, the next ones one step ahead, by the weights before
    assert rows[0]["staleness_mean"] == 0 and all(0 <= r["staleness_mean"] <= 1 for r in rows)
    assert rows[0]["vllm_logp_diff_max"] > 0  # the check compared something (all samples fresh)
    assert any(r["reward_std"] > 0 for r in rows) and any(r["kl"] > 0 for r in rows[1:]), rows
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step_00000002", "step_00000003"]

    out = run(command("train.py", 1) + flags(tiny_model_dir, tmp_path, 4, *run_flags))
    assert out.returncode == 0, out.stderr[-4000:]
    assert "resumed from " in out.stdout and "step_00000003 (step 3)" in out.stdout, out.stdout[-3000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4], rows
    check(rows[-1])
    # the resumed run's first batch is sampled by the resumed adapter, which the trainer's logprobs match
    assert rows[-1]["staleness_mean"] == 0 and rows[-1]["vllm_logp_diff_max"] > 0 and rows[-1]["kl"] > 0, rows[-1]


# An --agent_cmd in plain Python (urllib, no openai package): it asks the policy once through
# OPENAI_BASE_URL with OPENAI_API_KEY, then, by the episode's number (Agents.play keys episode k
# "...-k"; rows are k // 2), of every 6: hangs (k % 6 == 0: past agent_timeout), exits with code 1
# (1: an error), kills its worker's process group (2: a crash, the worker with it), or prints a
# line and its reward, 1 for an answer of even length (3, 4, 5). So groups 0 and 1 are unscored,
# group 2 is scored.
FAULTY = r'''
import json, os, signal, sys, time, urllib.request

row = json.load(sys.stdin)
base, key = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]
prompt = row["prompt"] if isinstance(row["prompt"], str) else row["prompt"][-1]["content"]
body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": prompt}], "max_tokens": 8}).encode()
request = urllib.request.Request(base + "/chat/completions", body, {"Content-Type": "application/json",
                                                                    "Authorization": "Bearer " + key})
answer = json.load(urllib.request.urlopen(request, timeout=60))["choices"][0]["message"]["content"]
k = int(key.rsplit("-", 1)[1]) % 6
if k == 0:
    time.sleep(120)
if k == 1:
    sys.exit("no luck on episode 1")
if k == 2:  # the worker set up its own process group (worker_pool.work): end it, and this with it
    leader = open(f"/proc/{os.getpgrp()}/cmdline", "rb").read()
    if b"forkserver" not in leader and b"multiprocessing" not in leader:
        sys.exit(f"not in a worker's process group: {leader!r}")
    os.killpg(os.getpgrp(), signal.SIGKILL)
print("thinking it over")
print(1 if len(answer) % 2 == 0 else 0)
'''

CMD_RUN = ["--max_prompt_length", "128", "--response_length", "16", "--num_unique_prompts_rollout", "3",
           "--num_samples_per_prompt_rollout", "2", "--agent_workers", "2", "--agent_timeout", "30",
           "--checkpoint_state_freq", "100"]


@pytest.mark.slow
def test_an_agent_command_trains_and_faults_are_counted(server, tiny_model_dir, tmp_path):
    """A command that hangs, fails or crashes on some episodes: those are counted (agent_timeouts,
    agent_errors, agent_crashes) and their groups leave the batch; the run goes on, the others scored
    by the number the command printed last. A command that fails on every episode stops the run at
    step 1 in one line naming the agent's failure."""
    (tmp_path / "agent.py").write_text(FAULTY)
    good = tmp_path / "good"
    out = run(command("train.py", 1) + flags(tiny_model_dir, good, 2, *CMD_RUN, "--unscored_stop", "1.0",
                                             "--agent_cmd", f"{sys.executable} {tmp_path / 'agent.py'}",
                                             url=server.urls[0]))
    assert out.returncode == 0, out.stderr[-4000:]
    assert "'s return (None: copy_reward)" in out.stdout, out.stdout[-3000:]
    rows = metrics(good)
    assert [r["step"] for r in rows] == [1, 2], rows
    for r in rows:
        assert (r["agent_timeouts"], r["agent_errors"], r["agent_crashes"]) == (1, 1, 1), r
        assert r["agent_refused"] == r["agent_idle"] == 0, r
        assert (r["unscored_episodes"], r["unscored_groups"], r["turns"]) == (3, 2, 1.0), r
        # the rewards the command printed, of episodes 3, 4 and 5 (3's group is unscored: the crash's)
        assert round(3 * r["reward_mean"], 6) in (0, 1, 2, 3) and r["reward_errors"] == 0, r
    said = [line for line in out.stdout.splitlines() if "episode(s) could not be scored" in line]  # a step's line
    assert len(said) == 2 and "3 of 6 episode(s)" in said[0] and "2 of 3 group(s)" in said[0], said
    assert "no answer after agent_timeout=30" in said[0], said
    # the hung commands were ended with their workers' process groups, not left sleeping
    assert subprocess.run(["pgrep", "-f", str(tmp_path / "agent.py")], capture_output=True).returncode == 1

    (tmp_path / "fails.py").write_text("import sys\nsys.stdin.read()\nsys.exit('the tool server is down')\n")
    bad = tmp_path / "bad"
    out = run(command("train.py", 1) + flags(tiny_model_dir, bad, 2, *CMD_RUN, "--agent_cmd",
                                             f"{sys.executable} {tmp_path / 'fails.py'}", url=server.urls[0]))
    assert out.returncode == 1, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and re.fullmatch(
        r"error: step 1: 3 of 3 groups left the batch with episodes that could not be scored \(more than "
        r"unscored_stop=0.5 of them\); first: the agent: RuntimeError: "
        r"agent_cmd exited with code 1: the tool server is down", lines[0]), out.stderr[-3000:]
    assert metrics(bad) == [] and not os.path.exists(bad / "out" / "final")
