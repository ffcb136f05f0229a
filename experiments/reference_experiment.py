"""Which reference should the KL term pull toward? SmolLM2-135M-Instruct on the math task.

    .venv/bin/python experiments/reference_experiment.py                    # 4 runs x 3 seeds, ~4.5 h on 2 CPU cores
    .venv/bin/python experiments/reference_experiment.py --max_new_runs 2   # two more runs, then the report so far
    .venv/bin/python experiments/reference_experiment.py --seeds 1 --steps 10          # a quick look
    .venv/bin/python experiments/reference_experiment.py --tiny --seeds 1 --steps 2    # checks the script (random model)

Runs (the same start, data and budget; k3 KL with beta BETA where there is a KL term):
  no KL             beta 0, no reference
  fixed reference   the initial policy
  EMA alpha 0.05    ref <- 0.05 policy + 0.95 ref every 10 steps ("EMA-PG" by Zhang & Ba: eta 0.95)
  EMA alpha 0.6     open-instruct's alpha, every 10 steps

One vLLM CPU server serves every run (each run pushes its initial weights into it first);
each run is `torchrun --nproc_per_node NPROC train.py`. Greedy accuracy on the held-out
prompts every EVAL steps. Writes OUT/reference_experiment.png (accuracy, training reward and KL,
mean and +- std over seeds), copies it to docs/, and prints a markdown table (accuracy at step 0
and at the end, per seed and mean +- std; training reward and KL over the last 10 steps)
with the command of each run. Runs already
finished in OUT are read back, not run again, so the experiment can be done a few runs
at a time; the runs go seed by seed (every configuration's seed 1 first).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]

RUNS = {  # name -> flags
    "no KL": ["--beta", "0", "--load_ref_policy", "false"],
    "fixed reference": ["--beta", "BETA"],
    "EMA alpha 0.05 / 10 steps": ["--beta", "BETA", "--alpha", "0.05", "--ref_policy_update_freq", "10"],
    "EMA alpha 0.6 / 10 steps": ["--beta", "BETA", "--alpha", "0.6", "--ref_policy_update_freq", "10"],
}
# The demo's settings (scripts/demo.sh); the tiny variant only checks that everything runs.
TASK = ["--dataset", "math", "--reward_fn", "rewards:math_reward_last_number", "--max_prompt_length", "128",
        "--response_length", "128", "--learning_rate", "5e-6", "--warm_up_steps", "5", "--temperature", "0.7",
        "--num_eval_prompts", "64",
        "--num_unique_prompts_rollout", "4", "--num_samples_per_prompt_rollout", "8", "--log_samples_freq", "0"]
TINY = ["--max_prompt_length", "256", "--response_length", "16", "--num_eval_prompts", "8",
        "--num_unique_prompts_rollout", "2", "--num_samples_per_prompt_rollout", "4"]


def run_dir(args, name, seed):
    return os.path.join(args.out, name.split(" /")[0].replace(" ", "_") + f"-s{seed}")


def finished(args, name, seed):
    """The metrics rows of a run that reached its last step and evaluation, else None."""
    path = os.path.join(run_dir(args, name, seed), "metrics.jsonl")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    last = [r for r in rows if r["step"] == args.steps and r.get("eval_accuracy") is not None]
    return rows if last else None


def command(args, name, flags, seed, url):
    """The torchrun command line of one run."""
    return ["torchrun", "--nproc_per_node", str(args.nproc), "--master_port", str(args.master_port), "train.py",
            "--model_name_or_path", args.model, "--output_dir", run_dir(args, name, seed),
            "--num_training_steps", str(args.steps), "--seed", str(seed), "--eval_freq", str(args.eval_freq),
            "--vllm_server_urls", url] + TASK + (TINY if args.tiny else []) \
        + [args.beta if f == "BETA" else f for f in flags]


def run_one(args, name, flags, seed, url):
    """Train one run against the shared server; its metrics rows."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    launcher = [sys.executable, "-m", "torch.distributed.run"] + command(args, name, flags, seed, url)[1:]
    r = subprocess.run(launcher, env=env, capture_output=True, text=True, cwd=ROOT)
    if r.returncode:
        sys.exit(f"{name} seed {seed} failed:\n{r.stderr[-3000:]}")
    return finished(args, name, seed)


def start_server(args):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infra import vllm_server
    from infra import weight_sync
    from config import Config

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    served = os.path.join(args.out, "vllm_model")
    weight_sync.write_serving_dir(weight_sync.full_state_dict(model), model.config,
                                  AutoTokenizer.from_pretrained(args.model), served)
    max_len = 256 + 16 if args.tiny else 128 + 128
    return vllm_server.launch_server(served, Config(vllm_startup_timeout=900, vllm_max_model_len=max_len),
                                 os.path.join(args.out, "vllm.log"), port=args.port)


def curves(rows, key="eval_accuracy"):
    return [(r["step"], r[key]) for r in rows if r.get(key) is not None]


def tail_mean(rows, key, n=10):
    """The mean of `key` over a run's last n training steps."""
    return statistics.mean(v for _, v in curves(rows, key)[-n:])


def plot(results, args, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = [("eval_accuracy", "held-out greedy accuracy"), ("reward_mean", "training reward"),
              ("kl", "KL to the reference (k3)")]
    for ax, (key, title) in zip(axes, panels):
        for name, runs in results.items():
            if key == "kl" and "BETA" not in RUNS[name]:
                ax.plot([], [])  # no reference: keep each run's colour across the panels
                continue
            per_seed = [dict(curves(rows, key)) for rows in runs]
            steps = sorted(set.intersection(*(set(c) for c in per_seed)))
            vals = [[c[s] for c in per_seed] for s in steps]
            mean = [statistics.mean(v) for v in vals]
            std = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in vals]
            ax.plot(steps, mean, marker="o", markersize=3, label=f"{name} ({len(runs)} seed(s))")
            ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                            alpha=0.15)
        ax.set(title=f"{title}, mean +- std over seeds", xlabel="step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def table(results, args):
    fmt = lambda xs: f"{statistics.mean(xs):.3f} +- {statistics.stdev(xs) if len(xs) > 1 else 0:.3f}"  # noqa: E731
    lines = [f"{args.steps} steps, beta {args.beta} (k3) where there is a KL term; reward and KL: mean of the last "
             "10 training steps\n",
             "| run | seeds | accuracy at step 0 | final accuracy (per seed) | final mean +- std | gain over step 0 | "
             "reward | KL | command (seed 1) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, runs in results.items():
        first = [curves(rows)[0][1] for rows in runs]
        last = [curves(rows)[-1][1] for rows in runs]
        reward = [tail_mean(rows, "reward_mean") for rows in runs]
        kl = fmt([tail_mean(rows, "kl") for rows in runs]) if "BETA" in RUNS[name] else "-"
        cmd = " ".join(command(args, name, RUNS[name], 1, "URL")).replace(args.out, "OUT").replace(ROOT + os.sep, "")
        lines.append(f"| {name} | {len(runs)} | {fmt(first)} | {', '.join(f'{x:.3f}' for x in last)} | {fmt(last)} | "
                     f"{fmt([b - a for a, b in zip(first, last)])} | {fmt(reward)} | {kl} | `{cmd}` |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=os.path.join(ROOT, "models", "smollm2-135m-instruct"))
    p.add_argument("--tiny", action="store_true", help="the random tiny model (models/tiny, built if missing)")
    p.add_argument("--out", default=os.path.join(ROOT, "output", "reference_experiment"))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--eval_freq", type=int, default=10)
    p.add_argument("--beta", default="0.05")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--port", type=int, default=8061)
    p.add_argument("--master_port", type=int, default=29561)
    p.add_argument("--max_new_runs", type=int, default=None, help="run at most this many unfinished runs, then report")
    args = p.parse_args()
    if args.tiny:
        import make_tiny_model

        args.model, args.eval_freq = os.path.join(ROOT, "models", "tiny"), min(args.eval_freq, args.steps)
        if not os.path.isfile(os.path.join(args.model, "config.json")):
            make_tiny_model.main(["--out", args.model])
    else:
        prepare = [sys.executable, os.path.join(ROOT, "scripts", "prepare_smollm2.py"), "--out", args.model]
        if subprocess.run(prepare).returncode:
            sys.exit("error: the model could not be prepared (see above)")
    os.makedirs(args.out, exist_ok=True)
    from infra import vllm_server

    # Seed-major, so an interrupted experiment has every run at its first seeds; finished runs
    # (their last step evaluated in OUT) are read back, not run again.
    todo = [(seed, name) for seed in range(1, args.seeds + 1) for name in RUNS if not finished(args, name, seed)]
    todo = todo[:args.max_new_runs] if args.max_new_runs is not None else todo
    server, url = start_server(args) if todo else (None, None)
    try:
        for seed, name in todo:
            run_one(args, name, RUNS[name], seed, url)
            print(f"{name} seed {seed}: accuracy {curves(finished(args, name, seed))}", flush=True)
    finally:
        vllm_server.stop_server(server)
    results = {name: [rows for rows in (finished(args, name, seed) for seed in range(1, args.seeds + 1)) if rows]
               for name in RUNS}
    results = {name: runs for name, runs in results.items() if runs}
    png = os.path.join(args.out, "reference_experiment.png")
    plot(results, args, png)
    if not args.tiny:
        shutil.copy(png, os.path.join(ROOT, "docs", "reference_experiment.png"))
    print("\n" + table(results, args))


if __name__ == "__main__":
    main()
