"""The rollout: the scored, grouped samples the trainer learns from, made on rank 0.

`rollout_batch` is one step's batch: prompts -> episodes (the run's player, episodes.Player: vLLM
completions, an environment's turns, an agent's program) -> rewards -> group advantages. The loop
hands it to the generator (infra/generator.py), which calls it when a batch is due: on demand
(async_steps=0: the synchronous loop, exact and debuggable), or up to async_steps steps ahead on a
thread while the trainer trains; `evaluate` is the held-out greedy accuracy.
"""

import time

import torch
from tqdm import tqdm

from episodes import round_seed
from infra.faults import FAULTS, Refused, ours
from loss import group_advantages
from rewards import has_answer_format

SAMPLES_SHOWN = 4  # episodes a step logs every log_samples_freq steps
# how an environment's calls and the rewards fail, and whose each failure is: faults.FAULTS
TOOL_FAILURES = tuple(k for k in FAULTS if k.startswith("tool_"))
REWARD_FAILURES = tuple(k for k in FAULTS if k.startswith("reward_"))
PER_EPISODE = ("turns", "tool_calls")  # counts a player returns that a step logs as means per episode


def evaluate(client, eval_rows, pool, player):
    """Greedy episodes on held-out prompts: the task's mean reward (format_reward not included) over
    the episodes that could be scored and, with episodes of several turns, the fraction that called a tool."""
    if not eval_rows:
        return None, None
    episodes, _ = player.play(client, eval_rows, 1, None, 0.0)
    rewards = [r for r in score(pool, episodes)[0] if r == r]  # NaN: unscored
    return (sum(rewards) / len(rewards) if rewards else None,
            sum(e.tool_calls > 0 for e in episodes) / len(episodes) if player.multi_turn else None)


def score(pool, episodes):
    """Rewards of the episodes' final answers (the policy's last turn), the row as the example,
    with the whole conversation, if there is one, as example["messages"]. The reward (`pool`) scores
    the episodes whose player asks for it (Episode.needs_reward), and is added to the player's own
    (an environment's, an agent's: Episode.env_reward). An episode that could not be scored (its reward
    raised, timed out or crashed; the infrastructure lost it: Episode.failure) gets NaN and its
    failure. Returns the rewards, and the counts of each way a reward failed (the reward_* rows of
    faults.FAULTS, all ours)."""
    examples = [e.row if e.messages is None else dict(e.row, messages=e.messages) for e in episodes]
    asked = [i for i, e in enumerate(episodes) if e.failure is None and e.needs_reward]
    values, counts = [0.0] * len(episodes), dict.fromkeys(REWARD_FAILURES, 0)
    if asked:
        got, found, first = pool.score([episodes[i].row["prompt_text"] for i in asked],
                                        [episodes[i].completion for i in asked], [examples[i] for i in asked],
                                        [last_turn(episodes[i].sample) for i in asked],
                                        [episodes[i].env_reward is None for i in asked])
        counts.update(found)
        for i, v in zip(asked, got):
            values[i] = v
        failed = [episodes[i] for i, v in zip(asked, got) if v != v]  # NaN: the pool's value of a failed call
        for e in failed:
            e.failure, e.reward_failed = e.failure or "the reward failed", e.reward_failed or "reward_fn"
        if failed and failed[0].failure == "the reward failed":  # the first, in the order of the samples, described
            failed[0].failure = f"the reward: {first.split(': ', 1)[1]}"
    for e in episodes:
        if e.reward_failed in counts:  # the environment's reward failed: counted with the reward's failures
            counts[e.reward_failed] += 1
    return [float("nan") if e.failure else v + (e.env_reward or 0.0) for v, e in zip(values, episodes)], counts


def last_turn(sample):
    """The token ids of a sample's last sampled turn (TRL's completion_ids)."""
    ids, mask, k = sample.token_ids, sample.mask, len(sample.mask)
    while k and not mask[k - 1]:
        k -= 1
    start = k
    while start and mask[start - 1]:
        start -= 1
    return ids[start:k]


def unscored(step, episodes, n):
    """Say the round's episodes that could not be scored (the first one's why); returns the failure
    that would name them in a stop (a reward's first), or None."""
    failed = [e for e in episodes if e.failure]
    if not failed:
        return None
    groups, lost = len(episodes) // n, len({e.k // n for e in failed})
    tqdm.write(f"step {step}: {len(failed)} of {len(episodes)} episode(s) could not be scored, and {lost} of "
               f"{groups} group(s) left the batch with them; first: episode {failed[0].k}: {failed[0].failure}")
    return next((e for e in failed if e.reward_failed), failed[0]).failure


def check_lost(step, rounds, cfg):
    """Stop the run when more than unscored_stop of the step's groups so far (every round of active
    sampling) left the batch for episodes that could not be scored. The rule counts groups, what is
    lost, not episodes: a group with one unscored episode leaves whole, so a grader that fails on 30%
    of calls loses 94% of groups of 8 (1 - 0.7 ** 8) and trains almost nothing, and must not look
    like a run that trains."""
    lost, groups, most = sum(r["unscored_groups"] for r in rounds), sum(r["groups"] for r in rounds), cfg.unscored_stop
    # 1 stops only a step that lost every group (what 1 always meant), and above 1 never stops
    if lost and (lost > most * groups or (lost == groups and most <= 1)):
        first = next(r["first_unscored"] for r in rounds if r["first_unscored"])
        rule = f"more than unscored_stop={most:g} of them" if lost > most * groups else f"every one; unscored_stop={most:g}"
        raise Refused(f"step {step}: {lost} of {groups} groups left the batch with episodes that could not be scored "
                      f"({rule}); first: {first}")


def sample_groups(cfg, client, rows, seed, step, pool, tokenizer, player, show=False):
    """One generation round: num_samples_per_prompt_rollout episodes of each row played by `player`, scored by
    `pool` (a RewardPool), with group advantages. A group with an episode that could not be
    scored leaves the batch whole: its advantages would rank the others against a reward nobody
    earned. Returns the samples of the groups kept and the round's counts; with show=True a few
    whole episodes as "samples"."""
    n = cfg.num_samples_per_prompt_rollout
    episodes, stats = player.play(client, rows, n, seed, cfg.temperature)
    t = time.perf_counter()
    rewards, failures = score(pool, episodes)
    first_unscored = unscored(step, episodes, n)
    if "tool_failures" in stats:  # an environment's calls that failed, as (kind, why): counted by kind
        lost = stats.pop("tool_failures")
        stats.update({kind: sum(what == kind for what, _ in lost) for kind in TOOL_FAILURES})
        env_side = [why for what, why in lost if ours(what)]  # the policy's bad calls are its to learn
        if env_side:
            tqdm.write(f"step {step}: {len(env_side)} environment call(s) failed; first: {env_side[0]}")
    if cfg.format_reward:
        rewards = [r + cfg.format_reward * has_answer_format(e.completion) for r, e in zip(rewards, episodes)]
    rewards = torch.tensor(rewards)
    broken = rewards.isnan().view(-1, n).any(dim=1).repeat_interleave(n)  # each sample: its group has an unscored one
    adv, std = group_advantages(rewards.nan_to_num(0.0), n, cfg.advantage_normalization_type)
    if not cfg.reward_advantage:  # the KL term alone trains (a teacher's): every group has its signal
        adv, std = torch.zeros_like(adv), torch.ones_like(std)
    # std is exactly 0 for a group whose rewards are all equal (max == min), also at 2/3 or 0.1
    signal = (std > 0) if cfg.filter_zero_std_samples else torch.ones_like(std, dtype=torch.bool)
    kept = signal & ~broken
    for e, a, r in zip(episodes, adv.tolist(), rewards.tolist()):
        e.sample.adv, e.sample.reward = (float("nan"), r) if e.failure else (a, r)
    shown = range(0, len(episodes), max(1, len(episodes) // SAMPLES_SHOWN))[:SAMPLES_SHOWN] if show else []
    scored = ~rewards.isnan()
    return [e.sample for e, k in zip(episodes, kept.tolist()) if k], dict(
        rewards=rewards[scored], lengths=torch.tensor([len(e.sample.token_ids) for e in episodes], dtype=torch.float),
        **failures, played=list(stats), **stats, time_score=time.perf_counter() - t, stops=sum(not e.cut for e in episodes),
        filtered_groups=int((~signal & ~broken).sum().item()) // n, unscored_episodes=int((~scored).sum().item()),
        groups=len(rows), first_unscored=first_unscored,
        unscored_groups=int(broken.sum().item()) // n, samples=[show_episode(step, episodes[i], tokenizer) for i in shown])


def show_episode(step, e, tokenizer):
    """One logged episode: the prompt; the completion, the text the reward was given (its last turn,
    without the end-of-sequence token that ended it: episodes.completion_text), so that a logged
    reward can be recomputed from the log; the episode, every token after the prompt as trained, the
    environment's marked [env: ...] and end tokens included; and its reward."""
    parts, s = [], e.sample
    for i, m in enumerate(s.mask):
        if not parts or parts[-1][0] != m:
            parts.append((m, []))
        parts[-1][1].append(s.token_ids[i])
    text = "".join(tokenizer.decode(ids) if m else f"[env: {tokenizer.decode(ids)}]" for m, ids in parts)
    return dict(step=step, prompt=e.row["prompt_text"], completion=e.completion, episode=text,
                reward=None if e.failure else s.reward)


def rollout_batch(cfg, client, sampler, step, pool, tokenizer, player):
    """Rank 0: prompts -> episodes -> rewards (scored by `pool`) -> group advantages.
    With active_sampling (DAPO's dynamic sampling) the groups the zero-std filter drops are
    refilled from new prompts, a whole batch of prompts per round, for at most
    active_sampling_max_rounds more rounds; groups beyond the batch are discarded.
    Returns the samples to train on and the step's rollout metrics (rewards, lengths and
    counts over every round; times summed); every log_samples_freq steps they carry a few
    episodes of the first round as "samples"."""
    prompts, n = cfg.num_unique_prompts_rollout, cfg.num_samples_per_prompt_rollout
    show = bool(cfg.log_samples_freq) and step % cfg.log_samples_freq == 0
    samples, stats = sample_groups(cfg, client, sampler.next_batch(prompts), round_seed(cfg, step, 0), step, pool,
                                   tokenizer, player, show)
    rounds = [stats]
    check_lost(step, rounds, cfg)
    while cfg.active_sampling and len(samples) < prompts * n and len(rounds) <= cfg.active_sampling_max_rounds:
        more, stats = sample_groups(cfg, client, sampler.next_batch(prompts), round_seed(cfg, step, len(rounds)),
                                    step, pool, tokenizer, player)
        samples += more[:prompts * n - len(samples)]  # whole groups: both counts are multiples of n
        rounds.append(stats)
        check_lost(step, rounds, cfg)
    rewards, lengths = torch.cat([r["rewards"] for r in rounds]), torch.cat([r["lengths"] for r in rounds])
    total = lambda key: sum(r[key] for r in rounds)  # noqa: E731
    # over the scored episodes; None (JSON null, not NaN) where there are too few
    m = dict(reward_mean=rewards.mean().item() if len(rewards) else None,
             reward_std=rewards.std().item() if len(rewards) > 1 else None, response_length=lengths.mean().item(),
             **{kind: total(kind) for kind in REWARD_FAILURES}, stop_frac=total("stops") / len(lengths),
             filtered_groups=total("filtered_groups"), unscored_episodes=total("unscored_episodes"),
             unscored_groups=total("unscored_groups"),
             time_score=total("time_score"), prompts_seen=sampler.position, response_tokens=lengths.sum().item(),
             **{k: total(k) / (len(lengths) if k in PER_EPISODE else 1) for k in rounds[0]["played"]})
    for name in sorted({k for r in rounds for k in r if k.startswith("rewards/")}):  # --reward_fn a,b: each one's
        values = torch.tensor([v for r in rounds for v in r.get(name, [])])
        m.update({f"{name}/mean": values.mean().item() if len(values) else None,
                  f"{name}/std": values.std().item() if len(values) > 1 else None})
    if rounds[0]["samples"]:
        m["samples"] = rounds[0]["samples"]
    if not samples and m["unscored_groups"]:  # unscored_stop > 1 let it go on: say it loudly
        tqdm.write(f"step {step}: WARNING: no group is left to train on; {m['unscored_groups']} group(s) left the "
                   f"batch with episodes that could not be scored (unscored_groups)")
    if cfg.active_sampling:  # extra rounds run, and groups still missing after them
        m.update(active_sampling_rounds=len(rounds) - 1, active_sampling_missing_groups=prompts - len(samples) // n)
    return samples, m
