"""Scoring throughput of the reward pool against scoring in the trainer's process.

    .venv/bin/python benchmarks/bench_rewards.py                      # 400 math completions, serial vs 1 and 2 workers
    .venv/bin/python benchmarks/bench_rewards.py --n 1000 --workers 0,2,4

The completions are written the way SmolLM2 answers the built-in math task (a few lines
of working, then a boxed answer, a plain last number, a fraction or nothing), a third of
them wrong; each is scored by rewards.math_reward_last_number (math-verify parse and
verify). Workers are started (and warmed on one batch) before timing: the pool lives as
long as the run. Best of --repeats timings.
"""

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def completions(n, seed=0):
    """(prompt, completion, example) triples in the style of the math task's answers."""
    import data

    rng = random.Random(seed)
    rows = data.task_rows("math", n, seed, "train", digits=2, operations="+-", steps=1)
    out = []
    for row in rows:
        gold = int(row["answer"])
        said = gold if rng.random() < 0.67 else gold + rng.choice([-10, -1, 1, 2, 7])
        style = rng.choice(["boxed", "last", "frac", "none"])
        working = f"We start with some and change it.\nSo the count is {said}.\n"
        end = {"boxed": f"The final answer is \\boxed{{{said}}}.", "last": f"The answer is {said}.",
               "frac": f"That is \\boxed{{\\frac{{{2 * said}}}{{2}}}}.", "none": "I am not sure."}[style]
        out.append((row["prompt"][0]["content"], working + end, row))
    return out


def time_scoring(pool, batch, repeats):
    prompts, texts, examples = zip(*batch)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        values, counts, _ = pool.score(list(prompts), list(texts), list(examples))
        best = min(best, time.perf_counter() - t0)
        assert sum(counts.values()) == 0, counts
    return best, sum(values) / len(values)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=400, help="completions per batch")
    p.add_argument("--workers", default="0,1,2", help="comma-separated worker counts; 0 = in this process")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    import rewards
    from infra.worker_pool import RewardPool

    batch = completions(args.n)
    print(f"{args.n} completions, rewards.math_reward_last_number, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print("| workers | seconds (best of %d) | completions/s | mean reward |\n|---|---|---|---|" % args.repeats)
    serial = None
    for workers in (int(w) for w in args.workers.split(",")):
        pool = RewardPool(rewards.math_reward_last_number, workers=workers, timeout=30)
        try:
            pool.score(*map(list, zip(*batch[:20])))  # warm: workers started, math-verify and sympy loaded
            seconds, mean = time_scoring(pool, batch, args.repeats)
        finally:
            pool.close()
        serial = serial or (seconds if workers == 0 else None)
        speedup = f" ({serial / seconds:.2f}x serial)" if serial and workers else ""
        print(f"| {workers or 'serial'} | {seconds:.3f} | {args.n / seconds:.0f}{speedup} | {mean:.3f} |", flush=True)


if __name__ == "__main__":
    main()
