"""End to end against TRL's GRPOTrainer: the same models, task, batch and cores, one after the other.

    bash benchmarks/install_trl.sh                          # once: TRL in its own .venv-trl
    .venv/bin/python benchmarks/bench_trl.py                # tiny (0.3 M) and 24m, 20 steps each
    .venv/bin/python benchmarks/bench_trl.py --models 24m --steps 10 --nproc 1
    .venv/bin/python benchmarks/bench_trl.py -- --async_steps 1   # anything after -- goes to train.py

Both sides train the same random Qwen2-shaped model (make_tiny_model.SHAPES, one
directory for both) on the built-in `copy` task: the same 4,096 training prompts
(data.task_rows, exported to a jsonl for TRL) and the same reward (data.copy_reward,
wrapped in TRL's batch signature). Per step: 16 prompts x 8 samples, at most 64 new
tokens, temperature 1, top_p 1, no top-k; the DAPO objective with clip 0.2 / 0.28 and a
token-level denominator over the whole step; beta 0 (no reference model on either
side); group-standardised advantages; no zero-std filtering; one optimizer step per
batch (AdamW, lr --learning_rate constant, no weight decay, grad clip 1.0); float32.

- ours: `torchrun --nproc_per_node --nproc train.py` with a vLLM CPU server it starts
  itself (port --port), eval off. Step time is the metrics' time_step (generate, score,
  train, weight sync); the server's start is reported apart.
- TRL: GRPOTrainer in .venv-trl (TRL has no CPU vLLM there, so it generates with
  transformers' generate), one process with all cores (--trl_threads; on a shared
  2-core machine one thread was 3x faster at 24 M, see BENCHMARKS.md), micro-batch --micro_batch and
  gradient accumulation to 128 completions (ours packs sequences into micro-batches of
  max_tokens_per_micro_batch tokens instead), one generation per optimizer step. Step
  time is between the Trainer's on_step_begin and on_step_end callbacks (generation,
  scoring, forward, backward, optimizer). Model loading is reported apart.

Differences that remain: TRL decodes completions with skip_special_tokens=True, we keep
special tokens (but the stop token) in what the reward sees; TRL's advantage eps is
1e-4, ours 1e-6; the prompt order differs (each side shuffles with its own sampler).
Seconds per step are medians over the steps after --skip_first (warm-up); the reward
after N steps is the mean over the last 5 steps. The ratio printed is TRL's seconds per
step over ours (> 1: we are faster), and the same for generated tokens per second.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]


# --- the TRL side (runs inside .venv-trl)


def trl_worker(args):
    import torch
    from datasets import load_dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from data import copy_reward

    def reward(prompts, completions, answer, **kwargs):  # TRL's batch signature around the same function
        return [copy_reward(p, c, {"answer": a}) for p, c, a in zip(prompts, completions, answer)]
    reward.__name__ = "copy_reward"

    class Clock(TrainerCallback):
        def __init__(self):
            self.rows, self.t0 = [], None

        def on_step_begin(self, a, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            self.rows.append({"step": state.global_step, "time_step": time.perf_counter() - self.t0})
            print(f"TRL step {state.global_step}: {self.rows[-1]['time_step']:.2f}s", file=sys.stderr, flush=True)

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and self.rows and "reward" in logs:
                self.rows[-1].update({k: v for k, v in logs.items() if isinstance(v, (int, float))})

    t_load = time.perf_counter()
    ds = load_dataset("json", data_files=args.prompts_file, split="train")
    per_step = args.prompts * args.samples
    cfg = GRPOConfig(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=per_step // args.micro_batch, num_generations=args.samples,
        max_completion_length=args.new_tokens, temperature=1.0, top_p=1.0, top_k=0, beta=0.0,
        loss_type="dapo", epsilon=0.2, epsilon_high=0.28, scale_rewards="group", num_iterations=1,
        learning_rate=args.learning_rate, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, use_cpu=True, bf16=False, logging_steps=1, save_strategy="no", report_to="none",
        seed=args.seed, disable_dropout=True, dataloader_num_workers=0)
    clock = Clock()
    trainer = GRPOTrainer(model=args.model_dir, reward_funcs=reward, args=cfg, train_dataset=ds, callbacks=[clock])
    load = time.perf_counter() - t_load
    trainer.train()
    print(json.dumps({"load": load, "threads": torch.get_num_threads(), "rows": clock.rows}), flush=True)


# --- our side and the comparison (runs in the trainer's .venv)


def run_ours(args, name, model_dir, out, extra):
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", str(args.nproc),
           "--master_port", str(args.master_port), os.path.join(ROOT, "train.py"),
           "--model_name_or_path", model_dir, "--dataset", "copy", "--output_dir", out,
           "--num_training_steps", str(args.steps), "--num_unique_prompts_rollout", str(args.prompts),
           "--num_samples_per_prompt_rollout", str(args.samples), "--response_length", str(args.new_tokens),
           "--temperature", "1.0", "--top_p", "1.0",
           "--loss_fn", "dapo", "--clip_lower", "0.2", "--clip_higher", "0.28", "--beta", "0",
           "--load_ref_policy", "false", "--advantage_normalization_type", "standard",
           "--filter_zero_std_samples", "false", "--learning_rate", str(args.learning_rate),
           "--lr_scheduler_type", "constant", "--weight_decay", "0", "--max_grad_norm", "1.0",
           "--eval_freq", "0", "--vllm_port", str(args.port), "--seed", str(args.seed), *extra]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // args.nproc)))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode:
        print(f"[{name} ours] FAILED (exit {proc.returncode}):\n{proc.stderr[-3000:]}", flush=True)
        return None
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "reward_mean" in r]
    for r in rows:
        r["generated_tokens"] = r["response_length"] * args.prompts * args.samples
    return dict(rows=rows, wall=wall, startup=wall - sum(r["time_step"] for r in rows), cmd=" ".join(cmd))


def run_trl(args, name, model_dir, out, prompts_file):
    py = os.path.join(ROOT, args.trl_venv, "bin", "python")
    if not os.path.exists(py):
        print(f"[{name} TRL] no {py}: run bash benchmarks/install_trl.sh first", flush=True)
        return None
    cmd = [py, os.path.abspath(__file__), "--_trl", "--_model_dir", model_dir, "--_prompts_file", prompts_file,
           "--_out", out]
    for k in ("steps", "prompts", "samples", "new_tokens", "micro_batch", "learning_rate", "seed"):
        cmd += [f"--{k}", str(getattr(args, k))]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.trl_threads or os.cpu_count() or 1), PYTHONPATH=ROOT)
    t0 = time.perf_counter()
    with open(os.path.join(args.out, f"trl_{name}.log"), "w") as log:  # TRL's own output, step times as they come
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        print(f"[{name} TRL] FAILED (exit {proc.returncode}); see {args.out}/trl_{name}.log", flush=True)
        return None
    res = json.loads(lines[-1])
    for r in res["rows"]:
        r["reward_mean"] = r.get("reward", float("nan"))
        r["generated_tokens"] = r.get("completions/mean_length", float("nan")) * args.prompts * args.samples
    return dict(rows=res["rows"], wall=wall, startup=res["load"], threads=res["threads"])


def summary(res, skip):
    rows = res["rows"]
    steady = rows[skip:] or rows
    s = statistics.median(r["time_step"] for r in steady)
    toks = statistics.median(r["generated_tokens"] / r["time_step"] for r in steady)
    return dict(s_per_step=s, tokens_per_s=toks, first=statistics.mean(r["reward_mean"] for r in rows[:5]),
                last=statistics.mean(r["reward_mean"] for r in rows[-5:]), steps=len(rows))


def main():
    import make_tiny_model

    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tiny,24m", help="comma separated, from make_tiny_model.SHAPES")
    p.add_argument("--steps", type=int, default=20, help="training steps per run")
    p.add_argument("--skip_first", type=int, default=2, help="steps left out of the seconds-per-step median")
    p.add_argument("--nproc", type=int, default=2, help="our trainer's ranks (torchrun --nproc_per_node)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--micro_batch", type=int, default=16, help="TRL's sequences per forward/backward (ours packs by tokens)")
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=os.path.join(ROOT, "output", "bench_trl"))
    p.add_argument("--port", type=int, default=8060, help="our vLLM server's port")
    p.add_argument("--master_port", type=int, default=29680, help="our torchrun's master port")
    p.add_argument("--trl_venv", default=".venv-trl")
    p.add_argument("--trl_threads", type=int, default=None, help="TRL's torch threads (default: all cores)")
    p.add_argument("--only", choices=["ours", "trl"], default=None, help="run one side only")
    p.add_argument("--_trl", action="store_true", help=argparse.SUPPRESS)
    for k in ("_model_dir", "_prompts_file", "_out"):
        p.add_argument(f"--{k}", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._trl:
        args.model_dir, args.prompts_file, args.out = args._model_dir, args._prompts_file, args._out
        return trl_worker(args)

    from data import task_rows

    os.makedirs(args.out, exist_ok=True)
    prompts_file = os.path.join(args.out, "copy_train.jsonl")
    with open(prompts_file, "w") as f:  # the rows train.py builds for --dataset copy with this seed
        for row in task_rows("copy", max(4096, 4 * args.prompts), args.seed, "train"):
            f.write(json.dumps(row) + "\n")
    print(f"{os.cpu_count()} cores, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {args.prompts} prompts x "
          f"{args.samples} samples x {args.new_tokens} new tokens a step, {args.steps} steps; ours on {args.nproc} "
          f"rank(s){' + ' + ' '.join(extra) if extra else ''}", flush=True)
    results = {}
    for name in args.models.split(","):
        model_dir = os.path.join(args.out, "models", name)
        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            make_tiny_model.main(["--out", model_dir, "--shape", name])
        if args.only != "trl":
            results[(name, "ours")] = run_ours(args, name, model_dir, os.path.join(args.out, f"ours_{name}"), extra)
            if results[(name, "ours")]:
                print(f"[{name} ours] {summary(results[(name, 'ours')], args.skip_first)}", flush=True)
        if args.only != "ours":
            results[(name, "trl")] = run_trl(args, name, model_dir, os.path.join(args.out, f"trl_{name}"), prompts_file)
            if results[(name, "trl")]:
                print(f"[{name} TRL] {summary(results[(name, 'trl')], args.skip_first)}", flush=True)

    print(f"\n| model | trainer | s/step (median) | generated tokens/s | reward, first 5 steps | reward, last 5 steps "
          f"| steps | startup s |")
    print("|---|---|---|---|---|---|---|---|")
    for (name, side), res in results.items():
        if res:
            s = summary(res, args.skip_first)
            print(f"| {name} | {side} | {s['s_per_step']:.2f} | {s['tokens_per_s']:.0f} | {s['first']:.3f} | "
                  f"{s['last']:.3f} | {s['steps']} | {res['startup']:.0f} |")
    for name in args.models.split(","):
        ours, trl = results.get((name, "ours")), results.get((name, "trl"))
        if ours and trl:
            a, b = summary(ours, args.skip_first), summary(trl, args.skip_first)
            print(f"{name}: throughput ours / TRL = {b['s_per_step'] / a['s_per_step']:.2f}x in seconds per step, "
                  f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}x in generated tokens per second")
        if ours:
            rows = ours["rows"][args.skip_first:] or ours["rows"]
            split = {k: statistics.mean(r[k] for r in rows) for k in ("time_generate", "time_score", "time_train",
                                                                       "time_sync", "time_step")}
            print(f"{name} ours, mean time split (s): " + ", ".join(f"{k[5:]} {v:.2f}" for k, v in split.items()))
        if trl:
            rows = trl["rows"][args.skip_first:] or trl["rows"]
            keys = sorted({k for r in rows for k in r if k.startswith("profiling/")})
            if keys:
                print(f"{name} TRL, mean per step (s): " + ", ".join(
                    f"{k.split('/')[-1]} {statistics.mean(r.get(k, 0.0) for r in rows):.2f}" for k in keys))


if __name__ == "__main__":
    main()
