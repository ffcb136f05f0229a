"""Does a moving (EMA) reference help where it should? SmolLM2-135M-Instruct, pre-registered.

    .venv/bin/python experiments/moving_reference.py --probe             # the probes that fix BETA and the lr
    .venv/bin/python experiments/moving_reference.py --max_new_runs 4    # four more runs, then the report so far
    .venv/bin/python experiments/moving_reference.py                     # every run (21: 7 arms x 3 seeds)
    .venv/bin/python experiments/moving_reference.py --tiny              # checks the script (random model, minutes)

Pre-registered design (written before the reported runs; the probes below fixed BETA and LARGE_LR)

Question. The EMA anchor is claimed to be a trust region that moves: it should hold the policy
at step sizes that wreck an unanchored run, without a fixed anchor's brake on how far and how fast
the policy can go. The math experiment (reference_experiment.py) was a null in a regime where
neither matters. Two regimes where each can:
  tools     the tools demo's task (`--dataset calc --environment envs.calculator:calculator`, 3 digits,
            + - *, at most 3 turns): the policy must move far, from 0.34 to about 1.0 held-out
            accuracy in 20 steps (calling the tool, in its format, and boxing its answer); lr 5e-6
            after 5 warm-up steps, 20 steps. The end is near the ceiling, so the measure is how
            fast the policy gets there: its mean accuracy over the evaluations after step 0.
  large lr  the math demo's task (`--dataset math`, rewards:math_reward_last_number) at LARGE_LR
            with no warm-up, 10 steps: Adam's first steps move every weight by about lr, and
            the unanchored run collapses (measured in the demo: 0.30 -> 0.09 in 3 steps at 2e-5).
Arms (k3 KL at BETA where there is a KL term; 4 prompts x 8 samples at T 0.7 a step):
  no KL             beta 0, no reference
  fixed             the initial policy
  EMA 0.05/step     ref <- 0.05 policy + 0.95 ref every step: EMA-PG's eta 0.95 at every step, so
                    the reference differs from the fixed one from step 1
  EMA-PG 0.05/10    the same every 10 steps, EMA-PG's setting as published (eta 0.9 to 0.95 every
                    10 steps); tools only (inside 10 steps it is the fixed arm)
Metric. Greedy accuracy on the same 64 held-out prompts for every arm and seed (the built-in tasks'
eval prompts do not depend on the seed), every 5 steps (tools: every step, see the amendment);
3 seeds an arm (seeds 1-3). Per run: the
mean accuracy after step 0 ("speed"), the gain (last minus step 0) and the worst accuracy after
step 0. Also logged: training reward, tool-call rate, KL to the reference (the trainer's k3), and
KL to the initial policy (exact over the vocabulary, at T 0.7, on 32 sampled first turns of the
held-out prompts, from the exports every 5 steps).
Criterion, with s the pooled std over seeds of the two arms compared (sqrt of the mean variance):
  tools     support if the speed of "EMA 0.05/step" exceeds the fixed arm's by more than s, and is
            no more than s below the no-KL arm's (no brake); against if it is more than s below
            the fixed arm's; else null.
  large lr  support if the worst accuracy of "EMA 0.05/step" exceeds the no-KL arm's by more than s
            and is no more than s below the fixed arm's; against if it is more than s below the
            no-KL arm's; else null.
Probes (seed 0, not reported runs; `--probe`), on the large-lr regime for 5 steps:
  1. LARGE_LR: the smallest of 2e-5, 5e-5 and 1e-4 at which no KL degrades (accuracy at step 5
     10 points or more below step 0). None did (0.30 -> 0.61, 0.34, 0.52), so the ladder went on,
     before any other run, to 3e-4: 0.30 -> 0.02. LARGE_LR = 3e-4.
  2. BETA: the smallest of 0.05, 0.2, 1.0 at which the fixed arm holds at LARGE_LR (accuracy at
     step 5 no more than 10 points below step 0); 1.0 if none does. None did (0.30 -> 0.09, 0.06,
     0.11; KL to the initial policy at step 5: 0.63, 0.78, 0.74, against 2.83 with no KL), so
     BETA = 1.0. At 3e-4 no anchor tried holds the policy: Adam moves every weight by about lr
     whatever the loss's scale, so a KL term turns the first steps but cannot shorten them.
Amendment, after the first reported run (tools, no KL, seed 1) and before any other arm: it was
at 1.0 by its first evaluation after step 0 (0.34 -> 1.0, 1.0, 1.0, 0.98 at steps 5, 10, 15, 20), so
a 5-step grid cannot tell how fast an arm gets there; the tools regime evaluates every step, and
that run was run again so. Nothing else changed.
A first design used a harder tools task and was dropped after one probe run each, before any
reported run: with two operations per problem the built-in calculator (a whole expression per
call) went 0.50 -> 0.98 in 5 steps at 2e-5 (saturated), and a calculator that takes one operation
per call gave reward 0 on all 32 samples of each of 5 steps at 2e-5 (no signal).
Outcome (the 21 runs, judged by the criterion above; docs/algorithm.md has the tables):
  tools     support: speed EMA - fixed +0.073 (s 0.009), EMA - no KL +0.002 (s 0.002); the fixed
            anchor falls from 1.0 to 0.61-0.72 at steps 14-15 in every seed, the EMA stays at 1.0
  large lr  null: worst EMA - no KL -0.042 (s 0.050), EMA - fixed +0.005 (s 0.014); every arm
            falls to 0.00-0.14

One vLLM CPU server serves every run (each run pushes its initial weights into it first); each
run is `torchrun --nproc_per_node NPROC train.py`. Finished runs in OUT are read back, not run
again; runs go seed by seed. Writes OUT/moving_reference.png (copied to docs/) and
OUT/moving_reference.md (printed too): a markdown table per regime with the command of each arm.
"""

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]

from reference_experiment import curves, tail_mean  # noqa: E402

BETA, LARGE_LR = "1.0", "3e-4"  # from the probes (see the docstring and docs/algorithm.md)
COMMON = ["--temperature", "0.7", "--num_eval_prompts", "64", "--num_unique_prompts_rollout", "4",
          "--num_samples_per_prompt_rollout", "8", "--log_samples_freq", "0", "--save_freq", "5"]
REGIMES = {  # name -> (train.py's flags, steps, arms)
    "tools": (["--dataset", "calc", "--environment", "envs.calculator:calculator", "--math_digits", "3",
               "--math_operations", "+-*", "--max_prompt_length", "160", "--response_length", "96", "--max_turns", "3",
               "--learning_rate", "5e-6", "--warm_up_steps", "5", "--eval_freq", "1"], 20,
              ("no KL", "fixed", "EMA 0.05/step", "EMA-PG 0.05/10")),
    "large lr": (["--dataset", "math", "--reward_fn", "rewards:math_reward_last_number", "--max_prompt_length", "128",
                  "--response_length", "128", "--learning_rate", "LR", "--warm_up_steps", "0", "--eval_freq", "5"], 10,
                 ("no KL", "fixed", "EMA 0.05/step")),
}
ARMS = {"no KL": ["--beta", "0", "--load_ref_policy", "false"],
        "fixed": ["--beta", "BETA"],
        "EMA 0.05/step": ["--beta", "BETA", "--alpha", "0.05", "--ref_policy_update_freq", "1"],
        "EMA-PG 0.05/10": ["--beta", "BETA", "--alpha", "0.05", "--ref_policy_update_freq", "10"]}
PROBES = [*[("large lr", "no KL", {"LR": lr, "STEPS": "5"}) for lr in ("2e-5", "5e-5", "1e-4", "3e-4")],
          *[("large lr", "fixed", {"BETA": b, "STEPS": "5"}) for b in ("0.05", "0.2", "1.0")]]
TINY = ["--max_prompt_length", "1024", "--response_length", "16", "--num_eval_prompts", "8",
        "--num_unique_prompts_rollout", "2", "--num_samples_per_prompt_rollout", "4", "--eval_freq", "1",
        "--save_freq", "1"]
KL_PROMPTS = 32  # held-out first turns sampled from each export for the KL to the initial policy


def run_dir(args, regime, arm, seed, values=None):
    name = "-".join(x.replace(" ", "_").replace("/", "per") for x in (regime, arm)) + f"-s{seed}"
    return os.path.join(args.out, name + "".join(f"-{k}{v}" for k, v in sorted((values or {}).items())))


def flags(args, regime, arm, seed, values=None):
    """train.py's flags for one run; `values` overrides BETA, LR and the steps (the probes)."""
    subst = {"BETA": BETA, "LR": LARGE_LR, **(values or {})}
    out = ["--model_name_or_path", args.model, "--output_dir", run_dir(args, regime, arm, seed, values),
           "--num_training_steps", str(steps_of(args, regime, values)), "--seed", str(seed)]
    out += COMMON + REGIMES[regime][0] + ARMS[arm]
    return [subst.get(f, f) for f in out] + (TINY if args.tiny else [])


def steps_of(args, regime, values=None):
    """A run's steps: the regime's, 2 with --tiny, or a probe's."""
    return int((values or {}).get("STEPS", 2 if args.tiny else REGIMES[regime][1]))


def trained(path, steps):
    """The metrics rows of a run trained and evaluated to its last step, else None."""
    if not os.path.isfile(os.path.join(path, "metrics.jsonl")):
        return None
    with open(os.path.join(path, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return rows if any(r["step"] == steps and r.get("eval_accuracy") is not None for r in rows) else None


def finished(path, steps):
    """(metrics rows, {step: KL to the initial policy}) of a run trained and measured, else None."""
    kl_path = os.path.join(path, "kl_to_initial.json")
    if not os.path.isfile(kl_path) or not (rows := trained(path, steps)):
        return None
    with open(kl_path) as f:
        return rows, {int(k): v for k, v in json.load(f).items()}


def train(args, cmd_flags, url):
    """One torchrun run of train.py against the shared server."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "--master_port",
           str(args.master_port), "train.py", "--vllm_server_urls", url] + cmd_flags
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if r.returncode:
        sys.exit(f"failed: {' '.join(cmd_flags)}\n{r.stderr[-3000:]}")


class InitialPolicy:
    """The initial model and the held-out first turns, to measure how far an export has moved:
    the mean over sampled tokens of the exact KL(policy || initial) over the vocabulary, both
    softmaxes at the sampling temperature, on KL_PROMPTS first turns sampled from the export."""

    def __init__(self, args, cmd_flags):
        import torch
        from transformers import AutoModelForCausalLM

        import data
        from config import Config
        from envs.environment import Environment
        from infra import cli, model_files

        cfg = cli.parse_args(Config, cmd_flags)
        self.tokenizer = model_files.load_tokenizer(cfg)
        env = Environment(cfg.environment, self.tokenizer, cfg) if cfg.environment else None
        evals = data.load_prompts(cfg, self.tokenizer, env)[1]
        self.prompts = [r["prompt_ids"] for r in evals[:KL_PROMPTS]]
        self.temperature, self.max_new = cfg.temperature, min(cfg.response_length, 96)
        self.model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()

    def kl(self, export_dir, seed=0):
        import torch
        from transformers import AutoModelForCausalLM

        policy = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        batch = self.tokenizer.pad({"input_ids": self.prompts}, padding_side="left", return_tensors="pt")
        torch.manual_seed(seed)
        with torch.no_grad():
            seqs = policy.generate(**batch, do_sample=True, temperature=self.temperature, top_p=1.0, top_k=0,
                                   repetition_penalty=1.0, max_new_tokens=self.max_new, pad_token_id=pad)
            n_prompt = batch["input_ids"].shape[1]
            eos = torch.tensor(policy.generation_config.eos_token_id).reshape(-1)
            is_eos = torch.isin(seqs[:, n_prompt:], eos)
            valid = (is_eos.cumsum(1) - is_eos.long()) == 0  # up to and with the first end-of-sequence token
            attn = torch.cat([batch["attention_mask"], valid.long()], 1)
            pos = (attn.cumsum(1) - 1).clamp(min=0)
            total, count = 0.0, 0
            for rows in torch.split(torch.arange(len(seqs)), 8):
                out = [m(seqs[rows], attention_mask=attn[rows], position_ids=pos[rows]).logits[:, n_prompt - 1:-1]
                       for m in (policy, self.model)]
                logp, logq = (torch.log_softmax(o / self.temperature, -1) for o in out)
                kl = (logp.exp() * (logp - logq)).sum(-1)
                total, count = total + kl[valid[rows]].sum().item(), count + valid[rows].sum().item()
        return total / count


def measure(path, initial):
    """KL to the initial policy at every export of a finished run, into kl_to_initial.json; the
    exports (full models) are deleted after."""
    exports = {int(d.split("_")[1]): d for d in os.listdir(path) if d.startswith("step_")}
    with open(os.path.join(path, "metrics.jsonl")) as f:
        exports[max(json.loads(line)["step"] for line in f)] = "final"
    kl = {step: initial.kl(os.path.join(path, d)) for step, d in sorted(exports.items())}
    with open(os.path.join(path, "kl_to_initial.json"), "w") as f:
        json.dump(kl, f)
    for d in exports.values():
        shutil.rmtree(os.path.join(path, d))


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
    cfg = Config(vllm_startup_timeout=900, vllm_max_model_len=1024 + 16 if args.tiny else 192 + 128)
    return vllm_server.launch_server(served, cfg, os.path.join(args.out, "vllm.log"), port=args.port)


def mean_std(xs):
    return statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def summary(runs):
    """Per-seed figures of one arm: accuracy at step 0, at the end, gain, worst and mean after step 0,
    training reward and KL to the reference (last 5 steps), KL to the initial policy at the end."""
    out = []
    for rows, kl in runs:
        acc = [a for _, a in curves(rows)]
        kl_ref = tail_mean(rows, "kl", 5) if any(r.get("kl") for r in rows) else None
        tools = curves(rows, "eval_tool_calls")
        out.append(dict(first=acc[0], last=acc[-1], gain=acc[-1] - acc[0], worst=min(acc[1:]),
                        speed=statistics.mean(acc[1:]),
                        reward=tail_mean(rows, "reward_mean", 5), kl_ref=kl_ref, kl_init=kl[max(kl)],
                        tool_calls=tools[-1][1] if tools else None))
    return out


def verdict(regime, s):
    """The pre-registered criterion (see the docstring) on per-arm summaries; None until 2 seeds an arm."""
    ema, fixed, free = (s.get(a) for a in ("EMA 0.05/step", "fixed", "no KL"))
    if not all(x and len(x) >= 2 for x in (ema, fixed, free)):
        return None

    def diff(a, b, key):  # (mean difference, pooled std)
        xa, xb = [r[key] for r in a], [r[key] for r in b]
        return statistics.mean(xa) - statistics.mean(xb), math.sqrt((statistics.variance(xa) +
                                                                      statistics.variance(xb)) / 2)
    if regime == "tools":
        (d_fixed, s_fixed), (d_free, s_free) = diff(ema, fixed, "speed"), diff(ema, free, "speed")
        word = "support" if d_fixed > s_fixed and d_free >= -s_free else "against" if d_fixed < -s_fixed else "null"
        return f"{word}: speed EMA - fixed {d_fixed:+.3f} (s {s_fixed:.3f}), EMA - no KL {d_free:+.3f} (s {s_free:.3f})"
    (d_free, s_free), (d_fixed, s_fixed) = diff(ema, free, "worst"), diff(ema, fixed, "worst")
    word = "support" if d_free > s_free and d_fixed >= -s_fixed else "against" if d_free < -s_free else "null"
    return f"{word}: worst EMA - no KL {d_free:+.3f} (s {s_free:.3f}), EMA - fixed {d_fixed:+.3f} (s {s_fixed:.3f})"


def table(args, results):
    fmt = lambda xs, f="%.3f": "-" if None in xs else f"{f} +- {f}" % mean_std(xs)  # noqa: E731
    lines = []
    for regime, arms in results.items():
        s = {arm: summary(runs) for arm, runs in arms.items()}
        lines += [f"\n**{regime}** ({steps_of(args, regime)} steps; reward and KL to the reference: mean of the "
                  f"last 5 steps; verdict: {verdict(regime, s) or 'not yet (2 seeds an arm needed)'})\n",
                  "| arm | seeds | accuracy at step 0 | final (per seed) | gain | mean after step 0 | worst after "
                  "step 0 | reward | KL to reference | KL to initial (end) | tool-call rate (end) | command (seed 1) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for arm, rs in s.items():
            cmd = " ".join(["torchrun --nproc_per_node", str(args.nproc), "train.py"] + flags(args, regime, arm, 1))
            cmd = cmd.replace(args.out, "OUT").replace(ROOT + os.sep, "")
            col = lambda k: fmt([r[k] for r in rs], "%.3g" if k.startswith("kl") else "%.3f")  # noqa: E731
            lines.append(f"| {arm} | {len(rs)} | {col('first')} | {', '.join('%.3f' % r['last'] for r in rs)} | "
                         f"{col('gain')} | {col('speed')} | {col('worst')} | {col('reward')} | {col('kl_ref')} | "
                         f"{col('kl_init')} | {col('tool_calls')} | `{cmd}` |")
    return "\n".join(lines)


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("eval_accuracy", "held-out greedy accuracy"), ("reward_mean", "training reward"),
              ("kl", "KL to the reference (k3)"), ("kl_init", "KL to the initial policy")]
    fig, axes = plt.subplots(len(results), 4, figsize=(20, 4.5 * len(results)), squeeze=False)
    for row, (regime, arms) in zip(axes, results.items()):
        for ax, (key, title) in zip(row, panels):
            for arm, runs in arms.items():
                per_seed = [dict(sorted(kl.items())) if key == "kl_init" else dict(curves(rows, key))
                            for rows, kl in runs]
                # every step some seed has: a step that trained nothing (all groups filtered) logs no KL
                steps = sorted(set.union(*(set(c) for c in per_seed)))
                if key == "kl" and "BETA" not in ARMS[arm] or not steps:
                    ax.plot([], [])  # keep each arm's colour across the panels
                    continue
                values = [[c[t] for c in per_seed if t in c] for t in steps]
                line, = ax.plot(steps, [statistics.mean(v) for v in values], marker="o", markersize=3,
                                label=f"{arm} ({len(runs)} seeds)")
                ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=line.get_color(),
                                alpha=0.15)
            ax.set(title=f"{regime}: {title}", xlabel="step")
            ax.grid(alpha=0.3)
        row[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=os.path.join(ROOT, "models", "smollm2-135m-instruct"))
    p.add_argument("--tiny", action="store_true", help="the random tiny model, 1 seed, 2 steps (checks the script)")
    p.add_argument("--probe", action="store_true", help="the probes (seed 0) instead of the reported runs")
    p.add_argument("--out", default=os.path.join(ROOT, "output", "moving_reference"))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--port", type=int, default=8062)
    p.add_argument("--master_port", type=int, default=29562)
    p.add_argument("--max_new_runs", type=int, default=None, help="run at most this many unfinished runs, then report")
    args = p.parse_args()
    os.chdir(ROOT)  # the environment's file is named from the repository root
    if args.tiny:
        import make_tiny_model

        args.model, args.seeds = os.path.join(ROOT, "models", "tiny"), 1
        args.out = os.path.join(ROOT, "output", "moving_reference_tiny")
        if not os.path.isfile(os.path.join(args.model, "config.json")):
            make_tiny_model.main(["--out", args.model])
    elif subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "prepare_smollm2.py"), "--out",
                         args.model]).returncode:
        sys.exit("error: the model could not be prepared (see above)")
    os.makedirs(args.out, exist_ok=True)
    from infra import vllm_server

    runs = [(r, a, 0, v) for r, a, v in PROBES] if args.probe else \
        [(r, a, seed, None) for seed in range(1, args.seeds + 1) for r, (_, _, arms) in REGIMES.items() for a in arms]
    todo = [x for x in runs if not finished(run_dir(args, *x), steps_of(args, x[0], x[3]))][:args.max_new_runs]
    server, url = start_server(args) if todo else (None, None)
    initial = {}  # per regime: its prompts
    try:
        for regime, arm, seed, values in todo:
            if not trained(run_dir(args, regime, arm, seed, values), steps_of(args, regime, values)):
                train(args, flags(args, regime, arm, seed, values), url)
            if regime not in initial:
                initial[regime] = InitialPolicy(args, flags(args, regime, arm, seed, values))
            measure(run_dir(args, regime, arm, seed, values), initial[regime])
            rows, kl = finished(run_dir(args, regime, arm, seed, values), steps_of(args, regime, values))
            print(f"{regime} / {arm} seed {seed} {values or ''}: accuracy {curves(rows)}, KL to initial {kl}",
                  flush=True)
    finally:
        vllm_server.stop_server(server)
    if args.probe:
        return
    seeds = range(1, args.seeds + 1)
    results = {r: {a: [x for x in (finished(run_dir(args, r, a, s), steps_of(args, r)) for s in seeds) if x]
                   for a in arms} for r, (_, _, arms) in REGIMES.items()}
    results = {r: {a: runs for a, runs in arms.items() if runs} for r, arms in results.items()}
    results = {r: arms for r, arms in results.items() if arms}
    png = os.path.join(args.out, "moving_reference.png")
    plot(results, png)
    if not args.tiny:
        shutil.copy(png, os.path.join(ROOT, "docs", "moving_reference.png"))
    text = table(args, results)
    with open(os.path.join(args.out, "moving_reference.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
