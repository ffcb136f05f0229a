"""Several runs' held-out accuracy against steps: one markdown table and one PNG.

    python scripts/plot_curves.py distillation=output/demo-distill/metrics.jsonl \\
        grpo=output/demo-grpo/metrics.jsonl --level teacher=0.641 --out docs/distillation.png

Each NAME=PATH is a metrics.jsonl written by train.py; --key picks the metric (eval_accuracy by
default); --level draws a horizontal line (a teacher's accuracy, say) and the table says at which
step each run first came within --within of it. Seeds: NAME=a.jsonl,b.jsonl,c.jsonl is their mean
(the table gives the range beside it, the plot draws each seed faintly). A run continued by another
(GRPO from a distilled export): first.jsonl+second.jsonl, the second's steps after the first's last.
"""

import argparse
import json
import os


def curve(path, key):
    """{step: value} of one run, or of runs joined by '+' (each after the one before it)."""
    joined = {}
    for part in path.split("+"):
        with open(part) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        start = max(joined, default=0)
        joined |= {start + r["step"]: r[key] for r in rows if r.get(key) is not None and (r["step"] or not joined)}
    return joined


def mean_curve(paths, key):
    """(mean, low, high) by step over seeds, at the steps every seed has."""
    seeds = [curve(path, key) for path in paths]
    steps = sorted(set.intersection(*(set(c) for c in seeds)))
    return {s: (sum(c[s] for c in seeds) / len(seeds), min(c[s] for c in seeds), max(c[s] for c in seeds))
            for s in steps}, seeds


def cell(value):
    mean, low, high = value
    return f"{mean:.3f}" if low == high else f"{mean:.3f} ({low:.2f}-{high:.2f})"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="NAME=path/to/metrics.jsonl")
    p.add_argument("--key", default="eval_accuracy")
    p.add_argument("--level", help="NAME=VALUE: a horizontal line, and the step each run first reaches it")
    p.add_argument("--within", type=float, default=0.02, help="how close to the level counts as reaching it")
    p.add_argument("--out", required=True, help="PNG to write")
    args = p.parse_args(argv)
    curves, seeds = {}, {}
    for run in args.runs:
        name, _, paths = run.partition("=")
        for path in paths.replace("+", ",").split(","):
            if not os.path.isfile(path):
                p.error(f"{path} does not exist; train.py writes OUTPUT_DIR/metrics.jsonl")
        curves[name], seeds[name] = mean_curve(paths.split(","), args.key)
    steps = sorted({s for c in curves.values() for s in c})
    print("| step | " + " | ".join(curves) + " |")
    print("|---|" + "---|" * len(curves))
    for s in steps:
        print(f"| {s} | " + " | ".join(cell(c[s]) if s in c else "" for c in curves.values()) + " |")
    level_name, level = None, None
    if args.level:
        level_name, _, value = args.level.partition("=")
        level = float(value)
        for name, c in curves.items():
            first = next((s for s in sorted(c) if c[s][0] >= level - args.within), None)
            print(f"{name}: first within {args.within:g} of {level_name} ({level:.3f}) at step "
                  + (str(first) if first is not None else "never"))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, c in curves.items():
        line, = ax.plot(sorted(c), [c[s][0] for s in sorted(c)], marker="o", label=name)
        for seed in seeds[name] if len(seeds[name]) > 1 else ():
            ax.plot(sorted(seed), [seed[s] for s in sorted(seed)], color=line.get_color(), alpha=0.25, linewidth=1)
    if level is not None:
        ax.axhline(level, color="gray", linestyle="--", label=level_name)
    ax.set_xlabel("step")
    ax.set_ylabel(args.key)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
