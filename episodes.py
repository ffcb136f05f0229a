"""Episodes: the scored, grouped completions the trainer learns from, made on rank 0.

`rollout_batch` is one step's batch: prompts -> vLLM completions (each labelled with the
weight version that sampled it) -> rewards -> group advantages. `Rollouts` hands them to
the loop, made on demand (async_steps=0: the synchronous loop, exact and debuggable), or
up to async_steps steps ahead on a thread while the trainer trains, so generation and
training overlap (the server is its own process; the thread only waits on HTTP).
"""

import threading
import time

import torch
from tqdm import tqdm

from data import stop_token_ids
from loss import group_advantages
from rewards import has_answer_format

SAMPLES_SHOWN = 4  # (prompt, completion, reward) triples a step logs every log_samples_freq steps


def completion_text(tokenizer, sample):
    """What the reward sees: the completion decoded with its special tokens (a policy that
    pads its answer with them pays for it), without the end-of-sequence token that ended it:
    the tokenizer's or another of the model's (VLLMClient.generate marks it in "eos"; a sample
    without the mark is judged by data.stop_token_ids)."""
    ids = sample["token_ids"]
    ended = sample["eos"] if "eos" in sample else (sample["finish_reason"] == "stop" and ids
                                                   and ids[-1] in stop_token_ids(tokenizer, tokenizer.name_or_path))
    if ids and ended:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)


def evaluate(cfg, client, eval_rows, pool, tokenizer):
    """Greedy decoding on held-out prompts; the task's mean reward (format_reward not included)."""
    if not eval_rows:
        return None
    out = client.generate([r["prompt_ids"] for r in eval_rows], n=1, max_tokens=cfg.response_length, temperature=0.0)
    texts = [completion_text(tokenizer, g[0]) for g in out]
    rewards, _, _ = pool.score([r["prompt_text"] for r in eval_rows], texts, eval_rows)
    return sum(rewards) / len(rewards)


def sample_groups(cfg, client, rows, seed, step, pool, tokenizer, show=False):
    """One generation round: num_samples_per_prompt_rollout completions of each row, scored by
    `pool` (a RewardPool), with group advantages. Returns the samples of the groups kept and
    the round's counts; with show=True a few (prompt, completion, reward) as "samples"."""
    t0 = time.perf_counter()
    groups = client.generate([r["prompt_ids"] for r in rows], n=cfg.num_samples_per_prompt_rollout,
                             max_tokens=cfg.response_length, temperature=cfg.temperature, top_p=cfg.top_p, seed=seed)
    t1 = time.perf_counter()
    flat = [(row, s) for row, g in zip(rows, groups) for s in g]
    texts = [completion_text(tokenizer, s) for _, s in flat]
    rewards, failures, first_failure = pool.score([r["prompt_text"] for r, _ in flat], texts, [r for r, _ in flat])
    if first_failure:
        counts = ", ".join(f"{k}={v}" for k, v in failures.items() if v)
        tqdm.write(f"step {step}: {sum(failures.values())} reward(s) scored 0 ({counts}); first: {first_failure}")
    if cfg.format_reward:
        rewards = [r + cfg.format_reward * has_answer_format(t) for r, t in zip(rewards, texts)]
    shown = range(0, len(flat), max(1, len(flat) // SAMPLES_SHOWN))[:SAMPLES_SHOWN] if show else []  # different groups
    rewards = torch.tensor(rewards)
    adv, std = group_advantages(rewards, cfg.num_samples_per_prompt_rollout, cfg.advantage_normalization_type)
    # std is exactly 0 for a group whose rewards are all equal (max == min), also at 2/3 or 0.1
    keep = (std > 0) if cfg.filter_zero_std_samples else torch.ones_like(std, dtype=torch.bool)
    samples = [dict(prompt_ids=r["prompt_ids"], token_ids=s["token_ids"], logprobs=s["logprobs"], adv=a,
                    version=s["version"])
               for (r, s), a, k in zip(flat, adv.tolist(), keep.tolist()) if k]
    lengths = torch.tensor([len(s["token_ids"]) for _, s in flat], dtype=torch.float)
    return samples, dict(rewards=rewards, lengths=lengths, **failures, time_generate=t1 - t0,
                         time_score=time.perf_counter() - t1, stops=sum(s["finish_reason"] == "stop" for _, s in flat),
                         filtered_groups=int((~keep).sum().item()) // cfg.num_samples_per_prompt_rollout,
                         samples=[dict(step=step, prompt=flat[i][0]["prompt_text"], completion=texts[i],
                                       reward=rewards[i].item()) for i in shown])


def rollout_batch(cfg, client, sampler, step, pool, tokenizer):
    """Rank 0: prompts -> vLLM completions -> rewards (scored by `pool`) -> group advantages.
    With active_sampling (DAPO's dynamic sampling) the groups the zero-std filter drops are
    refilled from new prompts, a whole batch of prompts per round, for at most
    active_sampling_max_rounds more rounds; groups beyond the batch are discarded.
    Returns the samples to train on and the step's rollout metrics (rewards, lengths and
    counts over every round; times summed); every log_samples_freq steps they carry a few
    (prompt, completion, reward) of the first round as "samples"."""
    prompts, n = cfg.num_unique_prompts_rollout, cfg.num_samples_per_prompt_rollout
    # Disjoint sampling seeds: vLLM seeds sample j of a request seed + j, so the request of
    # prompt i gets base + i * n (rollout.py), and every step and round its own block of seeds.
    seed = lambda r: cfg.seed * 2 ** 32 + (step * (cfg.active_sampling_max_rounds + 1) + r) * prompts * n  # noqa: E731
    show = bool(cfg.log_samples_freq) and step % cfg.log_samples_freq == 0
    samples, stats = sample_groups(cfg, client, sampler.next_batch(prompts), seed(0), step, pool, tokenizer, show)
    rounds = [stats]
    while cfg.active_sampling and len(samples) < prompts * n and len(rounds) <= cfg.active_sampling_max_rounds:
        more, stats = sample_groups(cfg, client, sampler.next_batch(prompts), seed(len(rounds)), step, pool,
                                    tokenizer)
        samples += more[:prompts * n - len(samples)]  # whole groups: both counts are multiples of n
        rounds.append(stats)
    rewards, lengths = torch.cat([r["rewards"] for r in rounds]), torch.cat([r["lengths"] for r in rounds])
    total = lambda key: sum(r[key] for r in rounds)  # noqa: E731
    m = dict(reward_mean=rewards.mean().item(), reward_std=rewards.std().item(), response_length=lengths.mean().item(),
             reward_errors=total("reward_errors"), reward_timeouts=total("reward_timeouts"),
             reward_crashes=total("reward_crashes"), stop_frac=total("stops") / len(lengths),
             filtered_groups=total("filtered_groups"), time_generate=total("time_generate"),
             time_score=total("time_score"), prompts_seen=sampler.position, response_tokens=lengths.sum().item())
    if rounds[0]["samples"]:
        m["samples"] = rounds[0]["samples"]
    if cfg.active_sampling:  # extra rounds run, and groups still missing after them
        m.update(active_sampling_rounds=len(rounds) - 1, active_sampling_missing_groups=prompts - len(samples) // n)
    return samples, m


def drop_stale(samples, version, max_staleness):
    """Label each sample with its staleness (weight updates since the weights that sampled it;
    0 in the synchronous loop) and drop those older than max_staleness. Whole groups share a
    version (one request each), so a group is kept or dropped together."""
    for s in samples:
        s["staleness"] = version - s["version"]
    kept = [s for s in samples if s["staleness"] <= max_staleness]
    return kept, dict(staleness_mean=sum(s["staleness"] for s in samples) / max(len(samples), 1),
                      stale_dropped=len(samples) - len(kept))


class Rollouts:
    """Batches for steps first..last from make(step). With ahead=k > 0 a thread makes
    batch j as soon as the trainer has taken batch j - k, so the batches of the next k steps
    are generated while the current one trains; with ahead=0, get(step) makes it in place.
    An exception in make() is raised by get() for that step, and the thread stops there."""

    def __init__(self, make, first, last, ahead):
        self.make, self.ahead, self.last, self.taken, self.ready = make, ahead, last, first - 1, {}
        self.cond, self.closed, self.thread = threading.Condition(), False, None
        if ahead:
            self.thread = threading.Thread(target=self.produce, args=(first,), daemon=True)
            self.thread.start()

    def produce(self, j):
        while j <= self.last:
            with self.cond:
                self.cond.wait_for(lambda: self.closed or j <= self.taken + self.ahead)
                if self.closed:
                    return
            try:
                out = self.make(j)
            except Exception as e:  # noqa: BLE001 - handed to the trainer, which decides
                out = e
            with self.cond:
                self.ready[j] = out
                self.cond.notify_all()
            if isinstance(out, Exception):
                return
            j += 1

    def get(self, step):
        """The batch for `step` (steps are taken in order); waits for it if it is not made yet."""
        if not self.ahead:
            self.taken = step
            return self.make(step)
        with self.cond:
            self.cond.wait_for(lambda: step in self.ready)
            out = self.ready.pop(step)
            self.taken = step
            self.cond.notify_all()
        if isinstance(out, Exception):
            raise out
        return out

    def close(self):
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if self.thread:  # a request in flight may take up to vllm_request_timeout; the thread is a daemon
            self.thread.join(timeout=10)
