"""Multi-turn episodes (envs.environment.Environment.play) against a scripted server: the tokens
appended turn by turn are the chat template's rendering of the final conversation, only the
policy's tokens reach the loss, tools that hang, crash or raise become error messages, and
budgets cut episodes with ids, mask and logprobs aligned. test_smollm2.py runs the calculator
on SmolLM2 with the real vLLM server."""

import concurrent.futures
import copy
import os
from episodes import Completions
from dataclasses import replace
import re
import threading

import pytest
import torch

import packing
from config import Config
from envs.chat import ChatTokens
from envs.environment import Environment
from loss import grpo_loss
from infra.policy import sequence_logprobs
from episodes import Sample
from helpers import documented, IM_END, ScriptedClient, with_prompts


# Qwen2.5's way with tool results: user turns of <tool_response> blocks (consecutive ones merged)
QWEN2_STYLE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class Adder:
    """A lowercase calculator for the character tokenizer: <calc>a+b</calc> -> the sum. The row's
    "tool" picks a misbehaving tool: hang, crash or raise."""

    stop = ["</calc>"]

    def reset(self, row):
        return [{"role": "system", "content": "add with <calc>a+b</calc>."}, {"role": "user", "content": row["prompt"]}]

    def step(self, row, messages):
        import os
        import time

        call = re.search(r"<calc>(\d+)\+(\d+)</calc>", messages[-1]["content"])
        if call is None:
            return []
        if row.get("tool") == "hang":
            time.sleep(60)
        if row.get("tool") == "crash":
            os._exit(3)
        if row.get("tool") == "raise":
            raise ValueError("boom")
        return [{"role": "tool", "content": str(int(call.group(1)) + int(call.group(2))) * row.get("repeat", 1)}]


adder = Adder()


@pytest.fixture(params=["chatml", "qwen2_style"])
def tokenizer(request, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    if request.param == "qwen2_style":
        tok.chat_template = QWEN2_STYLE
    return tok


def episodes_of(tokenizer, script, rows, workers=0, **kw):
    cfg = Config(environment="test_multiturn:adder", tool_workers=workers, tool_timeout=5.0, max_prompt_length=200,
                 **{"response_length": 256, "max_turns": 4, "num_samples_per_prompt_rollout": 2, **kw})
    env = Environment(cfg.environment, tokenizer, cfg)
    env.start()
    try:
        with_prompts(env, tokenizer, rows)
        client = ScriptedClient(tokenizer, script)
        episodes, stats = env.play(client, rows, cfg.num_samples_per_prompt_rollout, 0, cfg.temperature)
    finally:
        env.close()
    return episodes, stats, client


def test_episode_tokens_are_the_templates_rendering_of_the_conversation(tokenizer):
    """Sampled turns and the environment's rendered messages, appended as tokens, equal the chat
    template's rendering of the final conversation; mask 1 exactly on what was sampled."""
    episodes, stats, client = episodes_of(tokenizer, ["<calc>2+3</calc>", "so <calc>5+10</calc> then", "it is 15."],
                                          [dict(prompt="what is 2+3+10?")])
    for e in episodes:
        assert e.turns == 3 and e.tool_calls == 2 and not e.cut and e.completion == "it is 15."
        assert e.messages[-1] == {"role": "assistant", "content": "it is 15."}  # the environment ended it there
        rendered = tokenizer(tokenizer.apply_chat_template(e.messages, tokenize=False),
                             add_special_tokens=False)["input_ids"]
        assert e.ids + tokenizer("\n", add_special_tokens=False)["input_ids"] == rendered
        s = e.sample
        sampled = [t for t, m in zip(s.token_ids, s.mask) if m]
        # the first turn ended on its stop string, the second on <|im_end|> (the template's closing follows
        # each), the last on <|im_end|>
        assert sampled == sum((tokenizer(t, add_special_tokens=False)["input_ids"] + [IM_END] * (i > 0)
                               for i, t in enumerate(client.script)), [])
        assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.mask) if not m) and all(
            lp < 0 for lp, m in zip(s.logprobs, s.mask) if m)
        assert [m["content"] for m in e.messages if m["role"] == "tool"] == ["5", "15"]
    # one request per episode from the first turn on, each later one extending the episode
    assert [turn for turn, _ in client.requests] == [0, 0, 1, 1, 2, 2]
    assert stats["tool_failures"] == []


class HeldBack(ScriptedClient):
    """Holds the first turns of the last row back until another episode has sent its second turn
    (or 10 s have passed: `late`)."""

    def __init__(self, tokenizer, script, last_prompt):
        super().__init__(tokenizer, script)
        self.last_prompt, self.held, self.late, self.lock = last_prompt, [], False, threading.Lock()

    def submit(self, prompt_ids, n, max_tokens, temperature=1.0, top_p=1.0, seed=None, stop=()):
        answer = super().submit(prompt_ids, n, max_tokens, temperature, top_p, seed, stop)
        if list(prompt_ids) == self.last_prompt:
            self.held.append((concurrent.futures.Future(), answer))
            timer = threading.Timer(10.0, self.release, args=(True,))
            timer.daemon = True
            timer.start()
            return self.held[-1][0]
        if self.requests[-1][0] == 1:
            self.release(False)
        return answer

    def release(self, late):
        with self.lock:
            for held, answer in self.held:
                if not held.done():
                    self.late = self.late or late
                    held.set_result(answer.result())


def test_an_episode_goes_on_while_others_still_generate(tokenizer):
    """The first row's episodes get their tool answers and send their second turns while the
    second row's first turn is still generating: no turn waits for the slowest episode's."""
    rows = [dict(prompt="what is 2+3?"), dict(prompt="what is 4+5?")]
    cfg = Config(environment="test_multiturn:adder", tool_workers=0, max_prompt_length=200, response_length=256,
                 max_turns=3, num_samples_per_prompt_rollout=2)
    env = Environment(cfg.environment, tokenizer, cfg)
    env.start()
    with_prompts(env, tokenizer, rows)
    client = HeldBack(tokenizer, ["<calc>2+3</calc>", "it is 5."], rows[1]["prompt_ids"])
    episodes, stats = env.play(client, rows, 2, 0, cfg.temperature)
    assert not client.late and [e.turns for e in episodes] == [2] * 4
    first = rows[0]["prompt_ids"]  # row 0's second turns go out before row 1's first turns are back
    assert [(t, p[:len(first)] == first) for t, p in client.requests][:6] == [(0, True)] * 2 + [(0, False)] * 2 + [
        (1, True)] * 2


def test_budgets_cut_episodes_with_ids_mask_and_logprobs_aligned(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    script = ["<calc>2+3</calc>"] * 4
    episodes, _, _ = episodes_of(tok, script, [dict(prompt="add", repeat=1)], max_turns=2)
    assert all(e.turns == 2 and e.tool_calls == 1 and not e.cut for e in episodes)  # max_turns
    episodes, _, _ = episodes_of(tok, script, [dict(prompt="add", repeat=40)], response_length=40)
    for e in episodes:  # the tool's 40-char answer does not fit: the episode ends on the policy's turn
        s = e.sample
        assert e.cut and e.turns == 1 and e.tool_calls == 0 and len(s.token_ids) == len(s.mask) == len(s.logprobs)
        assert 0 < len(s.token_ids) < 40 and all(s.mask) and e.messages[-1] == {"role": "assistant",
                                                                                "content": "<calc>2+3</calc>"}
    episodes, _, _ = episodes_of(tok, script, [dict(prompt="add", repeat=40)], tool_output_max_tokens=6)
    assert all(e.messages[3]["content"] == "555555 [cut]" for e in episodes)  # cut to 6 tokens


@pytest.mark.subprocess
def test_tools_that_hang_crash_or_raise_end_their_episodes_unscored(tiny_model_dir):
    """In worker processes: a tool that hangs, kills its worker or raises something other than
    ToolError is ours (faults.FAULTS): its episode ends there, unscored, counted; the others go on."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [dict(prompt="a", tool="hang"), dict(prompt="b", tool="crash"), dict(prompt="c", tool="raise"),
            dict(prompt="d")]
    episodes, stats, _ = episodes_of(tok, ["<calc>2+3</calc>", "done."], rows, workers=2,
                                     num_samples_per_prompt_rollout=2)
    why = {e.row.get("tool"): e.failure for e in episodes}
    assert why[None] is None and all(e.turns == 2 and e.completion == "done." for e in episodes[6:])
    assert why["hang"] == "its environment call failed (tool_timeouts): no answer after tool_timeout=5.0s"
    assert why["crash"].startswith("its environment call failed (tool_crashes): the tool's process died (exit code 3)")
    assert why["raise"] == "its environment call failed (tool_errors): ValueError: boom"
    assert sorted(kind for kind, _ in stats["tool_failures"]) == ["tool_crashes"] * 2 + ["tool_errors"] * 2 + \
        ["tool_timeouts"] * 2
    assert all(e.turns == 1 and e.messages[-1]["role"] == "assistant" for e in episodes[:6])  # nothing told


@pytest.mark.parametrize("spec,fragment", [("envs.calculator:OPS", "has no step(row, messages) method"),
                                           ("envs.calculator:arithmetic",
                                            "must build an environment with no arguments"),
                                           ("envs.calculator:nope", "has no environment 'nope'"),
                                           ("envs.calculator:calculator_tool", "has no step(row, messages) method, "
                                            "and its tools are called only in a format a parser reads: set "
                                            "--tool_call_parser")])
def test_a_wrong_environment_is_refused_in_one_line(tiny_model_dir, spec, fragment):
    from transformers import AutoTokenizer

    with pytest.raises(ValueError, match=re.escape(fragment)):
        Environment(spec, AutoTokenizer.from_pretrained(tiny_model_dir), Config(environment=spec))


def test_a_template_that_drops_earlier_answers_is_refused(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = ("{% for m in messages %}{% if m.role != 'assistant' or loop.last %}<|im_start|>{{ m.role }}\n"
                         "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # drops earlier answers
    with pytest.raises(ValueError, match="drops an assistant turn that a tool message follows"):
        ChatTokens(tok)


def multi_turn_samples(seed):
    """Samples whose token_ids alternate policy spans (mask 1) and environment spans (mask 0)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(6):
        spans = [(1, 3 + i), (0, 2 + i % 3), (1, 2), (0, 4), (1, 1 + i % 2)][:1 + 2 * (i % 3)]
        mask = [m for m, n in spans for _ in range(n)]
        logprobs = [-float(j % 5 + 1) / 4 if m else 0.0 for j, m in enumerate(mask)]
        out.append(Sample(torch.randint(3, 64, (2 + i,), generator=g).tolist(),
                          torch.randint(3, 64, (len(mask),), generator=g).tolist(), logprobs, mask,
                          adv=torch.randn(1, generator=g).item()))
    return out


def packed_loss(model, samples, cfg, ref):
    """The packed path: collate (the loss mask), then the policy's and reference's logprobs, then grpo_loss."""
    b = packing.collate(samples)
    logp = sequence_logprobs(model, b["input_ids"], b["mask"], 1.0, position_ids=b["position_ids"])[0]
    with torch.no_grad():
        ref_logp = sequence_logprobs(ref, b["input_ids"], b["mask"], 1.0, position_ids=b["position_ids"])[0]
    tis = torch.exp(logp.detach() - b["vllm_logp"]).clamp(max=2.0)
    return grpo_loss(logp, logp.detach(), b["adv"], b["seq_ids"], float(b["mask"].sum()), cfg, ref_logp=ref_logp,
                     tis_weight=tis)[0]


def by_hand_loss(model, samples, cfg, ref):
    """Each sample alone, every token after the prompt scored, then only the policy's kept: the
    same objective on hand-picked tokens."""
    logp, ref_logp, vllm, adv, seq = [], [], [], [], []
    for i, s in enumerate(samples):
        ids = torch.tensor([s.prompt_ids + s.token_ids])
        after = torch.zeros(1, ids.shape[1] - 1, dtype=torch.bool)
        after[0, len(s.prompt_ids) - 1:] = True
        keep = torch.tensor(s.mask, dtype=torch.bool)
        logp.append(sequence_logprobs(model, ids, after, 1.0)[0][keep])
        with torch.no_grad():
            ref_logp.append(sequence_logprobs(ref, ids, after, 1.0)[0][keep])
        vllm += [lp for lp, m in zip(s.logprobs, s.mask) if m]
        adv += [s.adv] * int(keep.sum())
        seq += [i] * int(keep.sum())
    logp, ref_logp = torch.cat(logp), torch.cat(ref_logp)
    tis = torch.exp(logp.detach() - torch.tensor(vllm)).clamp(max=2.0)
    return grpo_loss(logp, logp.detach(), torch.tensor(adv), torch.tensor(seq), float(len(adv)), cfg,
                     ref_logp=ref_logp, tis_weight=tis)[0]


@pytest.mark.parametrize("loss_fn", ["dapo", "gspo"])
def test_only_policy_tokens_reach_the_loss_and_its_gradients(tiny_model_dir, loss_fn):
    """Policy term, ratios, TIS weights, the k3 KL, GSPO's sequence ratio and the token count see
    only mask-1 tokens; environment tokens are context. Changing a mask-0 token's logprob field
    changes nothing; changing a mask-1 token, or a mask-0 token's id, changes the loss."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.01 * torch.randn_like(p))
    cfg = Config(loss_fn=loss_fn, beta=0.1, kl_estimator="k3", truncated_importance_sampling_ratio_cap=2.0)
    samples = multi_turn_samples(0)
    assert packing.micro_batches(samples, Config(num_samples_per_prompt_rollout=6, max_tokens_per_micro_batch=4096),
                                 1, 0)[0][1] == sum(sum(s.mask) for s in samples)  # the denominator: policy tokens
    loss = packed_loss(model, samples, cfg, ref)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    hand = by_hand_loss(model, samples, cfg, ref)
    hand.backward()
    torch.testing.assert_close(loss, hand, rtol=1e-5, atol=1e-6)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6)
    model.zero_grad()
    env_at = samples[1].mask.index(0)
    changed = copy.deepcopy(samples)
    changed[1].logprobs[env_at] = -7.0  # not the policy's: no term reads it
    assert packed_loss(model, changed, cfg, ref).item() == loss.item()
    changed[1].token_ids[env_at] = (changed[1].token_ids[env_at] + 1) % 64  # context of what follows
    assert packed_loss(model, changed, cfg, ref).item() != loss.item()
    changed = copy.deepcopy(samples)
    changed[1].token_ids[0] = (changed[1].token_ids[0] + 1) % 64
    assert packed_loss(model, changed, cfg, ref).item() != loss.item()


@pytest.mark.subprocess
def test_the_documented_environment_runs(tiny_model_dir, tmp_path):
    """docs/data.md's "Writing an environment", as written, in a file: three guesses, two hints,
    and its reward of the last guess over the turns taken."""
    from transformers import AutoTokenizer

    from rollout import score
    from infra.worker_pool import RewardPool

    (tmp_path / "guess.py").write_text(documented("Guess"))
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = Config(environment=f"{tmp_path}/guess.py:guess", tool_workers=1, response_length=256, max_turns=6,
                 max_prompt_length=200, num_samples_per_prompt_rollout=2)
    env = Environment(cfg.environment, tok, cfg)
    env.start()
    (row,) = with_prompts(env, tok, [dict(prompt="guess", answer="42")])
    try:
        episodes, stats = env.play(ScriptedClient(tok, ["50", "25", "42"]), [row], 2, 0, cfg.temperature)
    finally:
        env.close()
    assert [m["content"] for m in episodes[0].messages[1:]] == ["50", "lower", "25", "higher", "42"]
    rewards, _ = score(RewardPool(f"{tmp_path}/guess.py:reward", workers=0), episodes)
    assert rewards == [1 / 3, 1 / 3] and stats["tool_failures"] == []


def play_file(tmp_path, code, spec, tok, script, rows, workers=0, **kw):
    """rows played by the environment `spec` of a file holding `code`, against a scripted server;
    returns the episodes, the play's counts and the environment (closed)."""
    (tmp_path / "env.py").write_text(code)
    cfg = Config(environment=f"{tmp_path}/env.py:{spec}", tool_workers=workers, tool_timeout=20.0,
                 max_prompt_length=200, **{"response_length": 256, "max_turns": 6, "num_samples_per_prompt_rollout": 2,
                                           **kw})
    env = Environment(cfg.environment, tok, cfg)
    env.start()
    try:
        with_prompts(env, tok, rows)
        episodes, stats = env.play(ScriptedClient(tok, script), rows, cfg.num_samples_per_prompt_rollout, 0, cfg.temperature)
    finally:
        env.close()
    return episodes, stats, env


@pytest.mark.parametrize("max_turns", range(1, 7))
def test_the_documented_guess_pays_a_right_last_guess_for_every_max_turns(tiny_model_dir, tmp_path, max_turns):
    """A right guess on the last allowed turn pays 1 / max_turns: the conversation the reward sees
    ends with the policy's final turn also when max_turns ended the episode."""
    from transformers import AutoTokenizer

    from rollout import score
    from infra.worker_pool import RewardPool

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    script = ["50"] * (max_turns - 1) + ["42"]
    episodes, stats, env = play_file(tmp_path, documented("Guess"), "guess", tok, script,
                                     [dict(prompt="guess", answer="42")], max_turns=max_turns)
    assert all(e.messages[-1] == {"role": "assistant", "content": "42"} for e in episodes)
    rewards, counts = score(RewardPool(f"{tmp_path}/env.py:reward", workers=0), episodes)
    assert rewards == [1 / max_turns] * 2 and sum(counts.values()) == 0


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.subprocess)])
def test_a_stateful_environment_keeps_its_state_per_episode(tiny_model_dir, tmp_path, workers):
    """docs/data.md's Board, named by its class: each episode's instance keeps its own board, in
    the worker that serves every call of the episode, and scores the episode; rewards from a
    shared board would mix the episodes' letters and misses."""
    from transformers import AutoTokenizer

    from rollout import score

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [dict(prompt="w", answer="ab"), dict(prompt="w", answer="abc"), dict(prompt="w", answer="xa")]
    episodes, stats, env = play_file(tmp_path, documented("Board"), "Board", tok, ["a", "b", "x", "c"], rows, workers,
                                     max_turns=4, num_samples_per_prompt_rollout=3)
    assert env.factory and env.scores and stats["tool_failures"] == []
    # ab: a, b (done, no miss); abc: a, b, x (a miss), c; xa: a, b (a miss), x (done)
    assert [e.turns for e in episodes] == [2] * 3 + [4] * 3 + [3] * 3
    assert [e.env_reward for e in episodes] == [1.0] * 3 + [0.5] * 3 + [0.5] * 3
    assert score(None, episodes)[0] == [e.env_reward for e in episodes]  # no --reward_fn: the environment's
    episodes, _, _ = play_file(tmp_path, documented("Board"), "Board", tok, ["a", "b", "x"], rows[1:2], workers,
                               max_turns=3)
    assert [e.env_reward for e in episodes] == [0.0, 0.0]  # max_turns: reward plays the unseen "x", a miss


CRASHY = '''
import os


class Counter:
    """Counts its steps; a row with crash=True kills its worker at the second step."""

    def reset(self, row):
        self.steps = 0
        return [{"role": "user", "content": "count"}]

    def step(self, row, messages):
        self.steps += 1
        if row.get("crash") and self.steps == 2:
            os._exit(3)
        return [{"role": "user", "content": str(self.steps)}]
'''


@pytest.mark.subprocess
def test_a_per_episode_environment_whose_worker_dies_ends_its_episodes(tiny_model_dir, tmp_path):
    """Two workers; episodes 0, 2 live in worker 0 and 1, 3 in worker 1. Episodes 0 and 1 kill
    their workers at their second step: those two are crashes, and 2 and 3, whose instances died
    with them, are lost; all four end there, counted, and the run goes on."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    episodes, stats, _ = play_file(tmp_path, CRASHY, "Counter", tok, ["x"] * 6, [dict(prompt="c", crash=True),
                                                                                 dict(prompt="c")], workers=2)
    assert sorted(kind for kind, _ in stats["tool_failures"]) == ["tool_crashes"] * 2 + ["tool_lost"] * 2
    assert [e.turns for e in episodes] == [2] * 4 and all(e.done for e in episodes)
    assert [[m["content"] for m in e.messages[1:]] for e in episodes] == [["x", "1", "x"]] * 4


def test_the_first_environment_failure_of_a_step_is_printed(tiny_model_dir, capsys):
    """A step's first failing environment call is printed; the policy's bad calls (ToolError) are
    counted apart and not printed."""
    from transformers import AutoTokenizer

    from rollout import sample_groups
    from infra.worker_pool import RewardPool

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = Config(environment="envs.calculator:calculator", tool_workers=0, max_prompt_length=300, response_length=64,
                 max_turns=2, num_samples_per_prompt_rollout=2)
    pool = RewardPool("rewards:number_reward", workers=0)
    for spec, tool, script in [("envs.calculator:calculator", None, "<calc>2+</calc>"),
                               ("test_multiturn:adder", "raise", "<calc>2+3</calc>")]:
        env = Environment(spec, tok, cfg)
        env.start()
        rows = [dict(prompt="q", answer="5", tool=tool)]
        with_prompts(env, tok, rows)
        _, m = sample_groups(replace(cfg, unscored_stop=1.0), ScriptedClient(tok, [script, "x"]), rows, 0, 7, pool,
                             tok, env)
        out = capsys.readouterr().out
        if tool is None:  # the calculator's answer to a bad expression: the policy's bad call
            assert m["tool_bad_calls"] == 2 and m["tool_errors"] == 0 and "failed" not in out
        else:  # ours: unscored, and the run stops (unscored_stop)
            assert m["tool_errors"] == 2 and m["tool_bad_calls"] == 0 and m["unscored_groups"] == 1
            assert "step 7: 2 environment call(s) failed; first: episode 0: ValueError: boom" in out


def test_a_long_reply_is_cut_before_it_is_tokenized(tiny_model_dir):
    """A 1 MB tool reply: the tokenizer sees at most tool_output_max_tokens times the vocabulary's
    longest string, not the megabyte."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = Config(environment="envs.calculator:calculator", tool_output_max_tokens=6)
    env = Environment(cfg.environment, tok, cfg)
    seen = []
    encode = env.tokenizer.__class__.__call__
    env.tokenizer = type("Counting", (), {"__call__": lambda self, text, **kw: seen.append(len(text)) or encode(tok, text, **kw),
                                          "decode": lambda self, ids: tok.decode(ids)})()
    assert env.truncate({"role": "tool", "content": "5" * 1_000_000})["content"] == "555555 [cut]"
    assert seen and max(seen) <= 6 * max(map(len, tok.get_vocab()))


def test_an_environment_file_that_does_not_load_is_refused_in_one_line(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    (tmp_path / "bad.py").write_text("class Env:\n    def step(self, row, messages)\n        return []\n")
    with pytest.raises(ValueError, match=r"does not load: SyntaxError \(line 2\).*; fix the file"):
        Environment(f"{tmp_path}/bad.py:Env", AutoTokenizer.from_pretrained(tiny_model_dir), Config())


# --- no episode is trained on a reward it did not earn

ONE_CRASH = '''
import os


class Steps:
    """Rewards the steps it answered. The first instance anywhere to reach its second step kills
    its worker (a file made with O_EXCL decides which, in whichever worker it runs)."""

    def reset(self, row):
        self.steps = 0
        return [{"role": "user", "content": "count"}]

    def step(self, row, messages):
        self.steps += 1
        if self.steps == 2:
            try:
                os.close(os.open(row["flag"], os.O_CREAT | os.O_EXCL))
                os._exit(3)
            except FileExistsError:
                pass
        return [{"role": "user", "content": str(self.steps)}]

    def reward(self, row, messages):
        return float(self.steps)
'''


@pytest.mark.subprocess
def test_an_episode_whose_instance_died_with_another_episodes_worker_is_not_trained_on(tiny_model_dir, tmp_path,
                                                                                          capsys):
    """Two workers hold episodes 0, 2 and 1, 3; rows A (episodes 0, 1) and B (2, 3). One call kills its
    worker: that episode, and the one whose instance lived in the same worker (the other row's, as
    the pinning pairs them), cannot be scored. Before, the lost one was scored 0 beside a sibling
    that earned 3 (advantages -0.707 and +0.707); now both groups leave the batch, counted apart
    from the policy's failures, and the first is printed."""
    from transformers import AutoTokenizer

    from rollout import sample_groups

    (tmp_path / "env.py").write_text(ONE_CRASH)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = Config(environment=f"{tmp_path}/env.py:Steps", tool_workers=2, tool_timeout=20.0, max_prompt_length=200,
                 response_length=256, max_turns=4, num_samples_per_prompt_rollout=2, filter_zero_std_samples=False,
                 unscored_stop=1.0)
    env = Environment(cfg.environment, tok, cfg)
    env.start()
    try:
        rows = with_prompts(env, tok, [dict(prompt="a", flag=str(tmp_path / "flag")),
                                       dict(prompt="b", flag=str(tmp_path / "flag"))])
        samples, m = sample_groups(cfg, ScriptedClient(tok, ["x"] * 4), rows, 0, 5, None, tok, env)
    finally:
        env.close()
    assert samples == [] and m["unscored_episodes"] == 2 and m["unscored_groups"] == 2
    assert m["tool_crashes"] == 1 and m["reward_errors"] == 0 and sorted(m["rewards"].tolist()) == [3.0, 3.0]
    assert "2 of 4 episode(s) could not be scored, and 2 of 2 group(s) left the batch with them; first: episode" in \
        capsys.readouterr().out


CLOSES = '''
import os


class Closing:
    """Answers once, rewards 1, and records its close in a file (the row's "log"); a row with
    "bad_close" raises in close."""

    def reset(self, row):
        return [{"role": "user", "content": "go"}]

    def step(self, row, messages):
        return [{"role": "user", "content": "ok"}]

    def reward(self, row, messages):
        return 1.0

    def close(self):
        with open(os.environ.get("CLOSE_LOG", "/dev/null"), "a") as f:
            f.write("closed\\n")
        if os.environ.get("BAD_CLOSE"):
            raise OSError("the disk is gone")
'''


def test_a_close_that_raises_leaves_its_episode_unscored(tiny_model_dir, tmp_path, monkeypatch):
    """The environment's own code raised (faults.FAULTS: tool_errors, ours): its episodes are unscored,
    as for a step that raises, and every instance is still closed."""
    from transformers import AutoTokenizer

    from rollout import score

    monkeypatch.setenv("BAD_CLOSE", "1")
    monkeypatch.setenv("CLOSE_LOG", str(tmp_path / "log"))
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    episodes, stats, env = play_file(tmp_path, CLOSES, "Closing", tok, ["x", "y"], [dict(prompt="p")], max_turns=2)
    assert all(e.failure.startswith("its environment (tool_errors): close() raised OSError") for e in episodes)
    assert all(r != r for r in score(None, episodes)[0])
    assert [kind for kind, _ in stats["tool_failures"]] == ["tool_errors", "tool_errors"]
    assert "close() raised OSError: the disk is gone" in stats["tool_failures"][0][1]
    # a prompt's rendering at load time closes the instances it reset: the first row's two (its reset is
    # checked twice at start-up), and 2 episodes
    assert (tmp_path / "log").read_text().count("closed") == 4


def test_a_failed_play_closes_its_episodes(tiny_model_dir, tmp_path, monkeypatch):
    """The server dies at the second turn: play raises, and every episode's instance is closed
    (none left with its sandbox or scratch directory)."""
    import concurrent.futures

    from transformers import AutoTokenizer

    from envs import calls
    from infra.faults import VLLMError

    monkeypatch.setenv("CLOSE_LOG", str(tmp_path / "log"))
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    class Dying(ScriptedClient):
        def submit(self, prompt_ids, *args, **kw):
            if len(self.requests) >= 2:
                future = concurrent.futures.Future()
                future.set_exception(VLLMError("the server died"))
                self.requests.append(None)
                return future
            return super().submit(prompt_ids, *args, **kw)

    (tmp_path / "env.py").write_text(CLOSES)
    cfg = Config(environment=f"{tmp_path}/env.py:Closing", tool_workers=0, max_prompt_length=200, response_length=256,
                 max_turns=3, num_samples_per_prompt_rollout=2)
    env = Environment(cfg.environment, tok, cfg)
    env.start()
    rows = with_prompts(env, tok, [dict(prompt="p")])
    (tmp_path / "log").write_text("")
    with pytest.raises(VLLMError):
        env.play(Dying(tok, ["x", "y", "z"]), rows, 2, 0, cfg.temperature)
    assert calls.INSTANCES == {} and (tmp_path / "log").read_text().count("closed") == 2


class FakeObservation:
    def __init__(self, reward, done, text="obs"):
        self.reward, self.done, self.text = reward, done, text


class FakeOpenEnvEnvironment:
    """An OpenEnv-shaped environment: each step pays 1 and is never done; what it was given is kept."""

    def __init__(self):
        self.actions = []

    def reset(self):
        return FakeObservation(0.0, False, "start")

    def step(self, action):
        self.actions.append(action)
        return FakeObservation(1.0, False)


def fake_openenv():
    from envs.openenv_adapter import OpenEnv
    from envs.tool_calls import ToolError

    class Fake(OpenEnv):
        def make(self, row):
            return FakeOpenEnvEnvironment()

        def action(self, text, tool_calls=None):
            if text == "refused":
                raise ToolError("not an action")
            return (text, tool_calls)

        def observe(self, observation):
            return observation.text
    return Fake()


def test_openenv_steps_each_turn_once_when_an_earlier_one_was_refused():
    """Turn 1 refused (a ToolError), turn 2 stepped (reward 1), then the budget ends the episode:
    the reward is 1.0; it was 2.0, from stepping turn 2 again. A last turn that max_turns kept
    from the environment is stepped by reward, once."""
    from envs.tool_calls import ToolError

    env, row = fake_openenv(), {}
    messages = env.reset(row) + [{"role": "assistant", "content": "refused"}]
    with pytest.raises(ToolError):
        env.step(row, messages)
    messages += [{"role": "tool", "content": "error: not an action"}, {"role": "assistant", "content": "fine"}]
    env.step(row, messages)  # its observation did not fit the budget: the episode ends on this turn
    assert env.reward(row, messages) == 1.0 and env.env.actions == [("fine", None)]
    env = fake_openenv()
    messages = env.reset(row) + [{"role": "assistant", "content": "refused"}]
    with pytest.raises(ToolError):
        env.step(row, messages)
    messages += [{"role": "tool", "content": "error: not an action"}, {"role": "assistant", "content": "last"}]
    assert env.reward(row, messages) == 1.0 and env.env.actions == [("last", None)]  # max_turns ended it here


def test_openenv_gets_the_parsed_tool_calls():
    env, row = fake_openenv(), {}
    calls = [{"id": "c00000000", "type": "function", "function": {"name": "look", "arguments": {"at": "door"}}}]
    env.reset(row)
    env.step(row, [{"role": "assistant", "content": "", "tool_calls": calls}])
    assert env.env.actions == [("", calls)]


def test_a_reward_that_fails_on_every_sample_stops_the_run_in_one_line(tiny_model_dir):
    """A reward written for another signature raises on every sample: the step stops the run naming the
    exception, where it used to score 0 everywhere and train nothing, exit 0."""
    from transformers import AutoTokenizer

    from data import PromptSampler
    from infra.faults import Refused
    from rollout import rollout_batch
    from infra.worker_pool import RewardPool

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = Config(response_length=8, num_samples_per_prompt_rollout=2, num_unique_prompts_rollout=1)
    rows = [dict(prompt="q", answer="5", prompt_text="q", prompt_ids=tok("q")["input_ids"])]
    pool = RewardPool("test_multiturn:needs_a_list", workers=0)
    with pytest.raises(Refused, match=r"step 3: 1 of 1 groups left the batch with episodes that could not be "
                                      r"scored \(more than unscored_stop=0.5 of them\); "
                                      r"first: the reward: TypeError: completions must be a list"):
        rollout_batch(cfg, ScriptedClient(tok, ["5"]), PromptSampler(rows, 0), 3, pool, tok, Completions(cfg, tok))
    samples, m = rollout_batch(replace(cfg, unscored_stop=1.5), ScriptedClient(tok, ["5"]), PromptSampler(rows, 0), 3,
                               pool, tok, Completions(cfg, tok))
    assert samples == [] and m["unscored_groups"] == 1 and m["reward_errors"] == 2


class Batches:
    """Hands out the given batches of rows in order, as PromptSampler.next_batch would."""

    def __init__(self, batches):
        self.batches, self.position = list(batches), 0

    def next_batch(self, n):
        self.position += n
        return self.batches.pop(0)


def test_the_stop_rule_counts_the_groups_of_the_whole_step(tiny_model_dir):
    """With active sampling the rule weighs every round of the step: round 0 loses none of its 4 groups,
    round 1 loses 3 of its 4. That is 3 of 8, under unscored_stop=0.5: the step goes on (a rule per
    round stopped it), and with one more group lost, 5 of 8, it stops."""
    from transformers import AutoTokenizer

    from infra.faults import Refused
    from rollout import rollout_batch
    from infra.worker_pool import RewardPool

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = Config(response_length=8, num_samples_per_prompt_rollout=2, num_unique_prompts_rollout=4,
                 active_sampling=True, active_sampling_max_rounds=1)  # every group has std 0: round 1 is played
    row = lambda bad: dict(prompt="q", answer="x", bad=bad, prompt_text="q", prompt_ids=tok("q")["input_ids"])  # noqa: E731
    pool = RewardPool("test_multiturn:fails_when_bad", workers=0)
    rounds = [[row(False)] * 4, [row(True)] * 3 + [row(False)]]
    _, m = rollout_batch(cfg, ScriptedClient(tok, ["5"]), Batches(rounds), 1, pool, tok, Completions(cfg, tok))
    assert m["unscored_groups"] == 3 and m["active_sampling_rounds"] == 1
    rounds = [[row(True)] + [row(False)] * 3, [row(True)] * 4]
    with pytest.raises(Refused, match=r"step 1: 5 of 8 groups left the batch"):
        rollout_batch(cfg, ScriptedClient(tok, ["5"]), Batches(rounds), 1, pool, tok, Completions(cfg, tok))


def fails_when_bad(prompt, completion, example):
    if example["bad"]:
        raise ValueError("a bad row")
    return 1.0


def needs_a_list(prompt, completion, example):
    raise TypeError("completions must be a list")


SCRATCH = '''
import os
import shutil
import tempfile


class Scratch:
    """Makes a scratch directory per episode (logged to the row's "log"), removed by close; a row
    with "crash" kills its worker at the first step."""

    def reset(self, row):
        self.dir = tempfile.mkdtemp()
        with open(row["log"], "a") as f:
            f.write(self.dir + "\\n")
        return [{"role": "user", "content": "go"}]

    def step(self, row, messages):
        if row.get("crash"):
            os._exit(3)
        return [{"role": "user", "content": "ok"}]

    def close(self):
        shutil.rmtree(self.dir)
'''


@pytest.mark.subprocess
def test_a_replaced_worker_leaves_no_scratch_of_its_episodes(tiny_model_dir, tmp_path):
    """A worker killed mid-call cannot close the instances it held: what they made in its temporary
    directory goes with it when it is replaced (it used to stay, a sandbox's scratch included)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    log = tmp_path / "dirs"
    (tmp_path / "env.py").write_text(SCRATCH)
    cfg = Config(environment=f"{tmp_path}/env.py:Scratch", tool_workers=2, tool_timeout=20.0, max_prompt_length=200,
                 response_length=256, max_turns=3, num_samples_per_prompt_rollout=2)
    env = Environment(cfg.environment, tok, cfg)
    env.start()
    try:
        rows = with_prompts(env, tok, [dict(prompt="a", log=str(log), crash=True), dict(prompt="b", log=str(log))])
        log.write_text("")  # the directories of the episodes, not of the prompts' rendering
        episodes, stats = env.play(ScriptedClient(tok, ["x"] * 3), rows, 2, 0, cfg.temperature)
        made = log.read_text().split()
        assert len(made) >= 4 and sum(kind == "tool_crashes" for kind, _ in stats["tool_failures"]) == 2
        assert [d for d in made if os.path.exists(d)] == []  # the pool is still up: gone with their workers
    finally:
        env.close()


FAILING_REWARDS = '''
import time


class Slow:
    """A shared environment whose reward hangs past tool_timeout."""

    def reset(self, row):
        return [{"role": "user", "content": "go"}]

    def step(self, row, messages):
        return []

    def reward(self, row, messages):
        time.sleep(30)
        return 1.0


slow = Slow()


class SlowEp(Slow):
    pass


class Raise(Slow):
    def reward(self, row, messages):
        if row["bad"]:
            raise RuntimeError("env reward broke")
        return float(len(messages))


raiser = Raise()


def bad_fn(prompt, completion, example):
    if example["bad"]:
        raise RuntimeError("reward_fn broke")
    return 0.0
'''


def failing_rewards(tmp_path, tok, spec, rows, workers=1, pool=None, **kw):
    """One step's batch of rows (rollout_batch), against a scripted server."""
    from data import PromptSampler
    from rollout import rollout_batch

    (tmp_path / "env.py").write_text(FAILING_REWARDS)
    cfg = Config(environment=f"{tmp_path}/env.py:{spec}", tool_workers=workers, tool_timeout=5.0, max_prompt_length=200,
                 response_length=64, max_turns=1, num_samples_per_prompt_rollout=2, num_unique_prompts_rollout=len(rows),
                 **kw)
    env = Environment(cfg.environment, tok, cfg)
    env.start()
    try:
        sampler = PromptSampler(with_prompts(env, tok, rows), 0)
        return rollout_batch(cfg, ScriptedClient(tok, ["x"]), sampler, 1, pool, tok, env)
    finally:
        env.close()


@pytest.mark.subprocess
@pytest.mark.parametrize("spec", ["slow", "SlowEp"])
def test_an_environments_reward_that_hangs_is_a_reward_timeout(tiny_model_dir, tmp_path, spec):
    """Shared or per episode, a reward that hangs is the reward's timeout (it was called "lost with its
    worker", counted nowhere, and never stopped the run)."""
    from transformers import AutoTokenizer

    from infra.faults import Refused

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(Refused, match=r"1 of 1 groups left the batch with episodes that could not be scored "
                                      r"\(more than unscored_stop=0.5 of them\); first: the "
                                      r"environment's reward: no answer after tool_timeout=5.0s"):
        failing_rewards(tmp_path, tok, spec, [dict(prompt="p")])
    _, m = failing_rewards(tmp_path, tok, spec, [dict(prompt="p")], unscored_stop=2.0)
    assert m["reward_timeouts"] == 2 and m["unscored_episodes"] == 2 and m["tool_lost"] == 0
    assert m["reward_mean"] is None and m["reward_std"] is None  # JSON null, never NaN


def test_a_sample_whose_two_rewards_fail_counts_once(tiny_model_dir, tmp_path):
    """Half the samples fail both the environment's reward and --reward_fn: 2 of 4 unscored, not a stop
    (the two failures of one sample used to be counted as two samples)."""
    from transformers import AutoTokenizer

    from infra.worker_pool import RewardPool

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    (tmp_path / "env.py").write_text(FAILING_REWARDS)
    pool = RewardPool(f"{tmp_path}/env.py:bad_fn", workers=0, fallback=float("nan"))
    samples, m = failing_rewards(tmp_path, tok, "raiser", [dict(prompt="p", bad=True), dict(prompt="q", bad=False)],
                                 workers=0, pool=pool, reward_fn=f"{tmp_path}/env.py:bad_fn",
                                 filter_zero_std_samples=False)
    assert m["unscored_episodes"] == 2 and m["unscored_groups"] == 1 and len(samples) == 2
    # the environment's reward failed on two samples; --reward_fn is not asked about an episode already lost
    assert m["reward_errors"] == 2


def test_openenv_a_last_turn_action_refuses_is_the_policys_mistake():
    """max_turns 1: reward steps the only turn, and action refuses it (a ToolError): the episode earns
    what its steps earned (0), where it used to be an unscored episode that could stop the run."""
    env, row = fake_openenv(), {}
    messages = env.reset(row) + [{"role": "assistant", "content": "refused"}]
    assert env.reward(row, messages) == 0.0 and env.env.actions == []


@pytest.mark.parametrize("stop,lost,stops", [(0.5, 2, False), (0.5, 3, True), (0.0, 1, True), (1.0, 3, False),
                                             (1.0, 4, True), (1.5, 4, False)])
def test_the_stop_rule_at_its_edges(stop, lost, stops):
    """More than unscored_stop of the step's groups; 1 (the old default) still stops a step that lost every
    group, and only that; above 1 never stops."""
    from infra.faults import Refused
    from rollout import check_lost

    rounds = [dict(unscored_groups=lost, groups=4, first_unscored="the reward: KeyError")]
    if stops:
        with pytest.raises(Refused, match=rf"step 2: {lost} of 4 groups left the batch"):
            check_lost(2, rounds, Config(unscored_stop=stop))
    else:
        check_lost(2, rounds, Config(unscored_stop=stop))
