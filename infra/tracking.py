"""What a run writes: its directories made and checked, output_dir claimed by a lock (run.lock), the
private directories of its processes (private_dir: sockets, weights, scratch), and
on rank 0: run_info.json before step 0, one metrics.jsonl line and
one console line per step, every log_samples_freq steps a few (prompt, completion, reward)
in samples.jsonl and on the console, and optionally Weights & Biases (samples as a table)
or TensorBoard (samples as text).

A resumed run keeps the lines up to its checkpoint and rewrites the rest, so
metrics.jsonl and samples.jsonl always read as one run.
"""

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import platform
import subprocess
from dataclasses import asdict

from tqdm import tqdm

SAMPLE_COLUMNS = ("step", "prompt", "completion", "episode", "reward")  # rollout.show_episode says what each is
CONSOLE = ("step", "reward_mean", "eval_accuracy", "eval_tool_calls", "response_length", "tool_calls", "loss", "kl",
           "teacher_kl", "kl_forward", "teacher_kl_forward", "clip_frac", "entropy", "grad_norm", "vllm_logp_diff_max",
           "time_step")


def private_dir(prefix, base=None, clean=True):
    """tempfile.mkdtemp (0700: only our user may enter) in `base`, named for its owner, this process:
    {prefix}{pid namespace}-{pid}-{random}. A process killed by SIGKILL cannot remove its directories,
    so with `clean` a new one first removes those a dead owner left in `base`: our prefix, our uid, our
    pid namespace (another container's pids mean nothing in ours) and no process with that pid. A pid
    taken again by another process only delays the removal until that one ends (a start time in the name
    would cost bytes of the 107 a path of vLLM's sockets in vllm_server's directory may have). Not
    `clean` where other machines make them (a shared weight_sync_dir): their pids mean nothing here.
    vllm_server.py, weight_sync.py and worker_pool.py make theirs with it."""
    base = base or tempfile.gettempdir()
    if not os.path.exists("/proc/self/ns/pid"):  # not Linux: a dead owner cannot be told from a live one
        return tempfile.mkdtemp(prefix=prefix, dir=base)
    ns = os.stat("/proc/self/ns/pid").st_ino
    for name in os.listdir(base) if clean else ():
        owner = name[len(prefix):].split("-")  # mkdtemp's random part has no "-"
        if name.startswith(prefix) and len(owner) == 3 and owner[0] == str(ns) and owner[1].isdigit() \
                and not os.path.exists(f"/proc/{owner[1]}"):
            path = os.path.join(base, name)
            with contextlib.suppress(OSError):  # another run may be removing it too
                if os.lstat(path).st_uid == os.getuid():
                    shutil.rmtree(path)
    return tempfile.mkdtemp(prefix=f"{prefix}{ns}-{os.getpid()}-", dir=base)


HELD = {}  # run.lock path -> its open file, which this process holds (flock's lock lives as long as it is open)


def claim_output_dir(output_dir):
    """Lock output_dir/run.lock for this process's life (rank 0), or ValueError naming the run that
    holds it: two runs in one output_dir overwrite each other's serving copy, metrics and checkpoints.
    The kernel drops the lock when the process ends, however it ends (SIGKILL included), so a
    killed run can be resumed at once. A second call in the same process is a no-op."""
    path = os.path.realpath(os.path.join(output_dir, "run.lock"))
    if path in HELD:
        return
    os.makedirs(output_dir, exist_ok=True)
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        other = f.read().strip() or "unknown"
        f.close()
        raise ValueError(f"output_dir={output_dir!r} is in use by another run (pid {other}); give this run "
                         "another --output_dir, or stop that run") from None
    f.truncate(0)
    f.write(f"{os.getpid()}\n")
    f.flush()
    HELD[path] = f


def make_dirs(cfg):
    """The directories the run writes, made and checked writable (ValueError with one line naming
    the fix), and output_dir claimed for this run on rank 0 (claim_output_dir)."""
    for name in ("output_dir", "checkpoint_state_dir", "weight_sync_dir"):
        path = getattr(cfg, name)
        if path is None:
            continue
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:  # a file of that name, a read-only or virtual file system (/proc)
            raise ValueError(f"{name}={path!r} cannot be made a directory ({e.strerror}); pick a writable "
                             "directory") from None
        if not os.access(path, os.W_OK):
            raise ValueError(f"{name}={path!r} is not writable; pick a writable directory")
    if int(os.environ.get("RANK", 0)) == 0:
        claim_output_dir(cfg.output_dir)  # a second run into it stops here, before it overwrites anything


def run_info(cfg, world_size):
    """What reproduces the run: config, git SHA, versions, world size (write_run_info writes it)."""
    import torch
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


def write_run_info(cfg, world_size, device, **more):
    """output_dir/run_info.json (run_info and `more`), and its line on the console."""
    info = run_info(cfg, world_size)
    with open(os.path.join(cfg.output_dir, "run_info.json"), "w") as f:
        json.dump(dict(info, **more), f, indent=2)
    print(f"run: {json.dumps(info['versions'])}, git {info['git_sha']}, world size {world_size}, device {device}")


def open_tracker(cfg):
    """A log(metrics, step) function for Weights & Biases or TensorBoard, whichever is installed."""
    if not cfg.with_tracking:
        return None
    try:
        import wandb
        run = wandb.init(project="flatgrpo", config=asdict(cfg), dir=cfg.output_dir)

        def log_wandb(m, step):
            if "samples" in m:
                m = dict(m, samples=wandb.Table(columns=list(SAMPLE_COLUMNS),
                                                data=[[s[c] for c in SAMPLE_COLUMNS] for s in m["samples"]]))
            run.log(m, step=step)
        return log_wandb
    except ImportError:
        pass
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError("with_tracking=True needs wandb or tensorboard installed (pip install tensorboard)") from None
    writer = SummaryWriter(os.path.join(cfg.output_dir, "tensorboard"))

    def log_tensorboard(m, step):
        for k, v in m.items():
            if isinstance(v, (int, float)):
                writer.add_scalar(k, v, step)
        for s in m.get("samples", []):
            writer.add_text("samples", f"reward {shown(s['reward'])}\n\n{s['prompt']}\n\n{s['episode']}", step)
    return log_tensorboard


def shown(reward):
    """A logged sample's reward as text: None is an episode that could not be scored."""
    return "unscored" if reward is None else f"{reward:.3g}"


def reopen(path, start):
    """A jsonl log opened for writing that keeps the lines of steps up to `start` (a resumed run)."""
    kept = [line for line in open(path) if json.loads(line)["step"] <= start] if start and os.path.exists(path) else []
    f = open(path, "w")
    f.writelines(kept)
    return f


def one_line(text, n, end=False):
    """Whitespace collapsed, its first (or, with end, last) n characters."""
    text = " ".join(text.split())
    return text if len(text) <= n else "..." + text[-n:] if end else text[:n] + "..."


class MetricsLog:
    def __init__(self, output_dir, start, tracker=None):
        self.file, self.tracker = reopen(os.path.join(output_dir, "metrics.jsonl"), start), tracker
        self.samples_path, self.start, self.samples_file = os.path.join(output_dir, "samples.jsonl"), start, None

    def write(self, m, console=True):
        self.file.write(json.dumps(m) + "\n")
        self.file.flush()
        if self.tracker:
            self.tracker(m, m["step"])
        if console:
            tqdm.write(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items()
                                if k in CONSOLE))

    def write_samples(self, samples):
        """Append (step, prompt, completion, episode, reward) rows to samples.jsonl, print them (the
        episode), send them to the tracker."""
        if not samples:
            return
        if self.samples_file is None:
            self.samples_file = reopen(self.samples_path, self.start)
        for s in samples:
            self.samples_file.write(json.dumps({c: s[c] for c in SAMPLE_COLUMNS}) + "\n")
            tqdm.write(f"  sample reward={shown(s['reward'])} | {one_line(s['prompt'], 90, end=True)} | "
                       f"{one_line(s['episode'], 200)}")
        self.samples_file.flush()
        if self.tracker:
            self.tracker({"samples": samples}, samples[0]["step"])
