"""A step's batch (rollout.rollout_batch): disjoint sampling seeds, whole groups, and DAPO's
dynamic sampling (active_sampling) refilling the groups the zero-std filter drops. The
server is replaced by a scripted one here so that which groups survive is known exactly;
test_vllm.py checks the seeds against a real vLLM server."""

import concurrent.futures

import pytest

from episodes import Completions
from config import Config
from data import PromptSampler
from rollout import rollout_batch
from infra.worker_pool import RewardPool


class ScriptedServer:
    """Answers like VLLMClient.submit. Prompt k's group is all "a" (every reward 1, zero
    std) when k is in `agree`, else half "a", half "b". Records each request's seed."""

    def __init__(self, tokenizer, agree):
        self.a, self.b = tokenizer.convert_tokens_to_ids(["a", "b"])
        self.agree, self.seeds = agree, []

    def submit(self, ids, n, max_tokens, temperature=1.0, top_p=1.0, seed=None, stop=()):
        self.seeds.append(seed)
        future = concurrent.futures.Future()
        future.set_result([dict(token_ids=[self.a if ids[0] in self.agree or j % 2 else self.b], logprobs=[-0.5],
                                finish_reason="length", text="", version=0) for j in range(n)])
        return future


def rows(n):
    return [dict(prompt_ids=[k], prompt_text=str(k), answer="a") for k in range(n)]


def reward(prompt, completion, example):
    return float(completion == example["answer"])


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def groups_of(samples, n):
    return [samples[i:i + n] for i in range(0, len(samples), n)]


def test_filtered_groups_are_refilled_until_the_batch_is_full(tokenizer):
    cfg = Config(num_unique_prompts_rollout=4, num_samples_per_prompt_rollout=2, active_sampling=True,
                 active_sampling_max_rounds=3, seed=3)
    agree = {0, 1, 2, 3, 4, 5}  # prompts 0-5 carry no signal
    server = ScriptedServer(tokenizer, agree)
    order = [r["prompt_ids"][0] for r in PromptSampler(rows(12), seed=0).next_batch(12)]  # the sampler's order
    signal = [i for i, k in enumerate(order) if k not in agree]
    rounds = signal[3] // 4  # the extra rounds until the 4th prompt with signal (4 prompts a round)
    samples, m = rollout_batch(cfg, server, PromptSampler(rows(12), seed=0), 7, RewardPool(reward, workers=0), tokenizer,
                               Completions(cfg, tokenizer))
    assert len(samples) == 8 and m["active_sampling_missing_groups"] == 0 and m["active_sampling_rounds"] == rounds
    assert [g[0].prompt_ids[0] for g in groups_of(samples, 2)] == [order[i] for i in signal[:4]]
    assert all(g[0].prompt_ids == g[1].prompt_ids for g in groups_of(samples, 2))  # whole groups
    assert m["filtered_groups"] == sum(k in agree for k in order[:4 * (rounds + 1)])
    assert m["prompts_seen"] == 4 * (rounds + 1)
    block = 4 * 2  # each round's requests use seeds base .. base + prompts x samples - 1
    # prompt i of round r: base + i * 2 (vLLM seeds its sample j with the request's seed + j)
    assert server.seeds == [3 * 2 ** 32 + (7 * 4 + r) * block + i * 2 for r in range(rounds + 1) for i in range(4)]


def test_refills_stop_after_max_rounds(tokenizer):
    cfg = Config(num_unique_prompts_rollout=2, num_samples_per_prompt_rollout=2, active_sampling=True,
                 active_sampling_max_rounds=2)
    server = ScriptedServer(tokenizer, agree=set(range(100)))  # nothing ever has signal
    samples, m = rollout_batch(cfg, server, PromptSampler(rows(20), 0), 1, RewardPool(reward, workers=0), tokenizer,
                               Completions(cfg, tokenizer))
    assert samples == [] and m["active_sampling_rounds"] == 2 and m["active_sampling_missing_groups"] == 2
    assert len(server.seeds) == 3 * 2 and m["filtered_groups"] == 6  # 3 rounds of 2 requests


def test_without_active_sampling_one_round(tokenizer):
    cfg = Config(num_unique_prompts_rollout=2, num_samples_per_prompt_rollout=2)
    server = ScriptedServer(tokenizer, agree={0})
    sampler = PromptSampler(rows(2), 0)
    samples, m = rollout_batch(cfg, server, sampler, 1, RewardPool(reward, workers=0), tokenizer,
                               Completions(cfg, tokenizer))
    assert len(server.seeds) == 2 and len(samples) == 2 and m["filtered_groups"] == 1  # one round, 2 prompts
    assert "active_sampling_rounds" not in m


@pytest.mark.parametrize("credit", [2 / 3, 0.1])
def test_groups_of_equal_partial_credit_are_filtered(tokenizer, credit):
    """Partial credit that float32 cannot represent: a group all scored 2/3 (or 0.1) has no signal
    and is dropped; unfiltered, its samples carry advantage exactly 0."""
    score = lambda prompt, completion, example: credit * (completion == example["answer"])  # noqa: E731
    cfg = Config(num_unique_prompts_rollout=2, num_samples_per_prompt_rollout=8)
    samples, m = rollout_batch(cfg, ScriptedServer(tokenizer, agree={0}), PromptSampler(rows(2), 0), 1,
                               RewardPool(score, workers=0), tokenizer, Completions(cfg, tokenizer))
    assert m["filtered_groups"] == 1 and len(samples) == 8 and {s.prompt_ids[0] for s in samples} == {1}
    cfg = Config(num_unique_prompts_rollout=2, num_samples_per_prompt_rollout=8, filter_zero_std_samples=False)
    samples, m = rollout_batch(cfg, ScriptedServer(tokenizer, agree={0}), PromptSampler(rows(2), 0), 1,
                               RewardPool(score, workers=0), tokenizer, Completions(cfg, tokenizer))
    assert m["filtered_groups"] == 0 and [s.adv for s in samples if s.prompt_ids[0] == 0] == [0.0] * 8


def test_request_seeds_leave_room_for_every_sample(tokenizer):
    """vLLM gives sample j of a request with seed s the seed s + j: prompt i must get
    base + i * n, or neighbouring prompts share n - 1 of their n streams."""
    cfg = Config(num_samples_per_prompt_rollout=8)
    server = ScriptedServer(tokenizer, agree=set())
    Completions(cfg, tokenizer).play(server, rows(3), 8, 100, 1.0)
    streams = [set(range(seed, seed + 8)) for seed in server.seeds]
    assert server.seeds == [100, 108, 116]
    assert all(not (a & b) for i, a in enumerate(streams) for b in streams[i + 1:])


def test_a_step_logs_each_reward_function_apart(tokenizer, tmp_path):
    """--reward_fn with two functions: the step's reward is their sum, and each one's mean and std are
    logged apart, as TRL names them (rewards/NAME/mean)."""
    (tmp_path / "r.py").write_text("def is_a(prompt, completion, example):\n    return float(completion == 'a')\n\n"
                                   "def always(prompt, completion, example):\n    return 1.0\n")
    cfg = Config(num_unique_prompts_rollout=2, num_samples_per_prompt_rollout=2,
                 reward_fn=f"{tmp_path}/r.py:is_a,{tmp_path}/r.py:always")
    samples, m = rollout_batch(cfg, ScriptedServer(tokenizer, agree=set()), PromptSampler(rows(2), 0), 1,
                               RewardPool(cfg.reward_fn, workers=0), tokenizer, Completions(cfg, tokenizer))
    assert (m["rewards/is_a/mean"], m["rewards/always/mean"], m["rewards/always/std"]) == (0.5, 1.0, 0.0)
    assert m["reward_mean"] == 1.5 and len(samples) == 4


def test_the_logged_completion_is_the_text_the_reward_saw(tokenizer, tmp_path):
    """samples.jsonl's completion is what the reward was given (no end-of-sequence text), so a logged reward
    can be recomputed from it; the episode is every token as trained, the end token included."""
    eos = tokenizer.eos_token_id

    class Ending(ScriptedServer):
        def submit(self, ids, n, max_tokens, temperature=1.0, top_p=1.0, seed=None, stop=()):
            future = concurrent.futures.Future()
            future.set_result([dict(token_ids=[self.a, eos], logprobs=[-0.5, -0.1], finish_reason="stop", eos=True,
                                    text="", version=0) for _ in range(n)])
            return future

    cfg = Config(num_unique_prompts_rollout=2, num_samples_per_prompt_rollout=2, log_samples_freq=1,
                 filter_zero_std_samples=False)
    _, m = rollout_batch(cfg, Ending(tokenizer, agree=set()), PromptSampler(rows(2), 0), 1,
                         RewardPool(f"{__name__}:reward", workers=0), tokenizer, Completions(cfg, tokenizer))
    assert m["samples"] and all(s["completion"] == "a" and s["reward"] == reward(None, s["completion"], dict(answer="a"))
                                and s["episode"] == "a" + tokenizer.decode([eos]) for s in m["samples"]), m["samples"]
