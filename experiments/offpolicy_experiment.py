"""Stale data, measured: dapo vs cispo vs ess, and a fixed vs an EMA reference (the story of "Trust the Batch" by Fakoor et al.).

    .venv/bin/python experiments/offpolicy_experiment.py                         # 3 seeds x 5 runs, ~40 min on 2 cores
    .venv/bin/python experiments/offpolicy_experiment.py --seeds 1 --steps 10    # a quick look

Every run trains the random tiny model on the built-in copy task from the same start,
with stale data: each rollout batch is cut into 4 mini-batches and seen for 2 epochs, so
8 optimizer steps use samples of one behaviour policy and the ratios drift from 1.
One vLLM CPU server serves all runs (each run pushes its initial weights into it first);
runs are single processes (FSDP2 in a world of one) so they leave the other core to the
server. Writes OUT/offpolicy.png (reward and ESS curves, mean over seeds) and prints a
markdown table of the final reward (mean of the last 10 steps) and the last greedy
evaluation, mean +- std over seeds.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]

STALE = ["--num_mini_batches", "4", "--num_epochs", "2"]
RUNS = {  # name -> flags
    "dapo": ["--loss_fn", "dapo"],
    "cispo": ["--loss_fn", "cispo"],
    "ess": ["--loss_fn", "ess"],
    "dapo+kl fixed ref": ["--loss_fn", "dapo", "--beta", "0.1"],
    "dapo+kl EMA ref": ["--loss_fn", "dapo", "--beta", "0.1", "--ref_policy_update_freq", "5", "--alpha", "0.1"],
}


def summary(rows):
    steps = [r for r in rows if "reward_mean" in r]
    evals = [r["eval_accuracy"] for r in rows if r.get("eval_accuracy") is not None]
    return dict(final_reward=statistics.mean(r["reward_mean"] for r in steps[-10:]), final_eval=evals[-1],
                ess=statistics.mean(r["ess"] for r in steps if "ess" in r) if any("ess" in r for r in steps) else None)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=os.path.join(ROOT, "models", "tiny"), help="built if missing")
    p.add_argument("--out", default=os.path.join(ROOT, "output", "offpolicy"))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--port", type=int, default=8051)
    args = p.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import make_tiny_model
    from infra import vllm_server
    from infra import weight_sync
    from config import Config

    if not os.path.isfile(os.path.join(args.model, "config.json")):
        make_tiny_model.main(["--out", args.model])
    os.makedirs(args.out, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    served = os.path.join(args.out, "vllm_model")
    weight_sync.write_serving_dir(weight_sync.full_state_dict(model), model.config, AutoTokenizer.from_pretrained(args.model),
                              served)
    server, url = vllm_server.launch_server(served, Config(vllm_startup_timeout=900), os.path.join(args.out, "vllm.log"),
                                        port=args.port)
    results = {}
    try:
        for name, flags in RUNS.items():
            for seed in range(1, args.seeds + 1):
                out_dir = os.path.join(args.out, name.replace(" ", "_").replace("+", "_") + f"-s{seed}")
                metrics = os.path.join(out_dir, "metrics.jsonl")
                if os.path.exists(metrics):
                    os.remove(metrics)  # metrics.jsonl appends; a re-run starts clean
                cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--model_name_or_path", args.model,
                       "--output_dir", out_dir, "--num_training_steps", str(args.steps), "--seed", str(seed),
                       "--eval_freq", str(args.steps), "--vllm_server_urls", url] + STALE + flags
                env = dict(os.environ, OMP_NUM_THREADS="1")
                for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
                    env.pop(k, None)
                r = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if r.returncode:
                    sys.exit(f"{name} seed {seed} failed:\n{r.stderr[-3000:]}")
                with open(metrics) as f:
                    results.setdefault(name, []).append([json.loads(line) for line in f])
                print(f"{name} seed {seed}: {summary(results[name][-1])}", flush=True)
    finally:
        vllm_server.stop_server(server)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_e) = plt.subplots(1, 2, figsize=(11, 4))
    for name, runs in results.items():
        curves = [[r["reward_mean"] for r in rows if "reward_mean" in r] for rows in runs]
        ax_r.plot(range(1, args.steps + 1), [statistics.mean(c[i] for c in curves) for i in range(args.steps)],
                  label=name)
        if name == "ess":
            ess_curves = [[r["ess"] for r in rows if "ess" in r] for rows in runs]
            ax_e.plot(range(1, args.steps + 1), [statistics.mean(c[i] for c in ess_curves) for i in range(args.steps)])
    ax_r.set(title=f"train reward, mean of {args.seeds} seed(s)", xlabel="step")
    ax_r.legend()
    ax_e.set(title="ESS of the ess runs (mean over optimizer steps)", xlabel="step", ylim=(0, 1.05))
    for ax in (ax_r, ax_e):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "offpolicy.png"), dpi=100)

    fmt = lambda xs: f"{statistics.mean(xs):.3f} +- {statistics.stdev(xs) if len(xs) > 1 else 0:.3f}"  # noqa: E731
    print(f"\n{args.steps} steps, {args.seeds} seed(s), stale data ({' '.join(STALE)}); {args.out}/offpolicy.png\n")
    print("| run | final train reward | final greedy eval | mean ESS |\n|---|---|---|---|")
    for name, runs in results.items():
        s = [summary(rows) for rows in runs]
        e = [x["ess"] for x in s if x["ess"] is not None]
        print(f"| {name} | {fmt([x['final_reward'] for x in s])} | {fmt([x['final_eval'] for x in s])} | "
              f"{fmt(e) if e else '-'} |")


if __name__ == "__main__":
    main()
