"""Several runs' held-out accuracy against steps: one markdown table and one PNG.

    python scripts/plot_curves.py distillation=output/demo-distill/metrics.jsonl \\
        grpo=output/demo-grpo/metrics.jsonl --level teacher=0.641 --out docs/distillation.png

Each NAME=PATH is a metrics.jsonl written by train.py; --key picks the metric (eval_accuracy by
default); --level draws a horizontal line (a teacher's accuracy, say) and the table says at which
step each run first came within --within of it.
"""

import argparse
import json
import os


def curve(path, key):
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {r["step"]: r[key] for r in rows if r.get(key) is not None}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="NAME=path/to/metrics.jsonl")
    p.add_argument("--key", default="eval_accuracy")
    p.add_argument("--level", help="NAME=VALUE: a horizontal line, and the step each run first reaches it")
    p.add_argument("--within", type=float, default=0.02, help="how close to the level counts as reaching it")
    p.add_argument("--out", required=True, help="PNG to write")
    args = p.parse_args(argv)
    curves = {}
    for run in args.runs:
        name, _, path = run.partition("=")
        if not os.path.isfile(path):
            p.error(f"{path} does not exist; train.py writes OUTPUT_DIR/metrics.jsonl")
        curves[name] = curve(path, args.key)
    steps = sorted({s for c in curves.values() for s in c})
    print("| step | " + " | ".join(curves) + " |")
    print("|---|" + "---|" * len(curves))
    for s in steps:
        print(f"| {s} | " + " | ".join(f"{c[s]:.3f}" if s in c else "" for c in curves.values()) + " |")
    level_name, level = None, None
    if args.level:
        level_name, _, value = args.level.partition("=")
        level = float(value)
        for name, c in curves.items():
            first = next((s for s in sorted(c) if c[s] >= level - args.within), None)
            print(f"{name}: first within {args.within:g} of {level_name} ({level:.3f}) at step "
                  + (str(first) if first is not None else "never"))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, c in curves.items():
        ax.plot(sorted(c), [c[s] for s in sorted(c)], marker="o", label=name)
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
