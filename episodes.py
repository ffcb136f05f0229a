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

from loss import group_advantages
from rewards import has_answer_format

SAMPLES_SHOWN = 4  # (prompt, completion, reward) triples a step logs every log_samples_freq steps


def completion_text(tokenizer, sample):
    """What the reward sees: the completion decoded with its special tokens (a policy that
    pads its answer with them pays for it), without the stop token that ended it."""
    ids = sample["token_ids"]
    if sample["finish_reason"] == "stop" and ids and ids[-1] == tokenizer.eos_token_id:
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


def rollout_batch(cfg, client, sampler, step, pool, tokenizer):
    """Rank 0: prompts -> vLLM completions -> rewards (scored by `pool`, a RewardPool) ->
    group advantages. Returns the samples to train on and the step's rollout metrics; every
    log_samples_freq steps the metrics carry a few (prompt, completion, reward) as "samples"."""
    t0 = time.perf_counter()
    rows = sampler.next_batch(cfg.num_unique_prompts_rollout)
    groups = client.generate([r["prompt_ids"] for r in rows], n=cfg.num_samples_per_prompt_rollout,
                             max_tokens=cfg.response_length, temperature=cfg.temperature, top_p=cfg.top_p,
                             seed=cfg.seed * 1_000_003 + step * 1_000)
    m = {"time_generate": time.perf_counter() - t0}
    t1 = time.perf_counter()
    flat = [(row, s) for row, g in zip(rows, groups) for s in g]
    texts = [completion_text(tokenizer, s) for _, s in flat]
    rewards, failures, first_failure = pool.score([r["prompt_text"] for r, _ in flat], texts, [r for r, _ in flat])
    if first_failure:
        counts = ", ".join(f"{k}={v}" for k, v in failures.items() if v)
        tqdm.write(f"step {step}: {sum(failures.values())} reward(s) scored 0 ({counts}); first: {first_failure}")
    if cfg.format_reward:
        rewards = [r + cfg.format_reward * has_answer_format(t) for r, t in zip(rewards, texts)]
    if cfg.log_samples_freq and step % cfg.log_samples_freq == 0:
        shown = range(0, len(flat), max(1, len(flat) // SAMPLES_SHOWN))[:SAMPLES_SHOWN]  # from different groups
        m["samples"] = [dict(step=step, prompt=flat[i][0]["prompt_text"], completion=texts[i], reward=rewards[i])
                        for i in shown]
    rewards = torch.tensor(rewards)
    adv, std = group_advantages(rewards, cfg.num_samples_per_prompt_rollout, cfg.advantage_normalization_type)
    keep = (std > 0) if cfg.filter_zero_std_samples else torch.ones_like(std, dtype=torch.bool)
    samples = [dict(prompt_ids=r["prompt_ids"], token_ids=s["token_ids"], logprobs=s["logprobs"], adv=a,
                    version=s["version"])
               for (r, s), a, k in zip(flat, adv.tolist(), keep.tolist()) if k]
    lengths = torch.tensor([len(s["token_ids"]) for _, s in flat], dtype=torch.float)
    m.update(reward_mean=rewards.mean().item(), reward_std=rewards.std().item(), response_length=lengths.mean().item(),
             **failures, stop_frac=sum(s["finish_reason"] == "stop" for _, s in flat) / len(flat),
             filtered_groups=int((~keep).sum().item()) // cfg.num_samples_per_prompt_rollout,
             time_score=time.perf_counter() - t1, prompts_seen=sampler.position, response_tokens=lengths.sum().item())
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
