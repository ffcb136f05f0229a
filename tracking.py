"""What a run records, on rank 0: run_info.json before step 0, one metrics.jsonl line and
one console line per step, and optionally Weights & Biases or TensorBoard.

A resumed run keeps the metrics lines up to its checkpoint and rewrites the rest, so
metrics.jsonl always reads as one run.
"""

import json
import os
import platform
import subprocess
from dataclasses import asdict

import torch
from tqdm import tqdm

CONSOLE = ("step", "reward_mean", "eval_accuracy", "response_length", "loss", "kl", "clip_frac", "entropy",
           "grad_norm", "vllm_logp_diff_max", "time_step")


def run_info(cfg, world_size):
    """What reproduces the run: config, git SHA, versions, world size."""
    import transformers

    sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    versions = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import vllm
        versions["vllm"] = vllm.__version__
    except ImportError:
        pass
    return dict(config=asdict(cfg), git_sha=sha, versions=versions, world_size=world_size)


def open_tracker(cfg):
    """A log(metrics, step) function for Weights & Biases or TensorBoard, whichever is installed."""
    if not cfg.with_tracking:
        return None
    try:
        import wandb
        run = wandb.init(project="flatgrpo", config=asdict(cfg), dir=cfg.output_dir)
        return lambda m, step: run.log(m, step=step)
    except ImportError:
        pass
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError("with_tracking=True needs wandb or tensorboard installed (pip install tensorboard)") from None
    writer = SummaryWriter(os.path.join(cfg.output_dir, "tensorboard"))
    return lambda m, step: [writer.add_scalar(k, v, step) for k, v in m.items() if isinstance(v, (int, float))]


class MetricsLog:
    def __init__(self, output_dir, start, tracker=None):
        path = os.path.join(output_dir, "metrics.jsonl")
        kept = [line for line in open(path) if json.loads(line)["step"] <= start] \
            if start and os.path.exists(path) else []
        self.file, self.tracker = open(path, "w"), tracker
        self.file.writelines(kept)

    def write(self, m, console=True):
        self.file.write(json.dumps(m) + "\n")
        self.file.flush()
        if self.tracker:
            self.tracker(m, m["step"])
        if console:
            tqdm.write(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items()
                                if k in CONSOLE))
