"""Plot a run's metrics.jsonl to PNG.

    python scripts/plot_metrics.py output/demo/metrics.jsonl            # writes output/demo/metrics.png
    python scripts/plot_metrics.py run.jsonl --out curves.png --keys reward_mean,eval_accuracy,kl
"""

import argparse
import json
import os

DEFAULT_KEYS = ("reward_mean,eval_accuracy,response_length,entropy,loss,kl,teacher_kl,kl_forward,teacher_kl_forward,"
                "clip_frac,grad_norm,vllm_logp_diff_max,time_step")  # those the run logged


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("metrics", help="a metrics.jsonl written by train.py")
    p.add_argument("--out", help="PNG to write (default: beside the metrics file)")
    p.add_argument("--keys", default=DEFAULT_KEYS, help="comma-separated metric names, one panel each")
    args = p.parse_args(argv)
    if not os.path.isfile(args.metrics):
        p.error(f"{args.metrics} does not exist; train.py writes OUTPUT_DIR/metrics.jsonl")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.metrics) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    keys = [k for k in args.keys.split(",") if any(isinstance(r.get(k), (int, float)) for r in rows)]
    if not keys:
        p.error(f"none of {args.keys} is in {args.metrics}")
    cols = min(3, len(keys))
    fig, axes = plt.subplots(-(-len(keys) // cols), cols, figsize=(4.5 * cols, 3 * -(-len(keys) // cols)),
                             squeeze=False)
    for ax, key in zip(axes.flat, keys):
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        ax.plot(*zip(*pts), marker="o" if len(pts) < 30 else None, markersize=3)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.tight_layout()
    out = args.out or os.path.splitext(args.metrics)[0] + ".png"
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
