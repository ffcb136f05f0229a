"""The colocated run (the vLLM server asleep on the training GPUs) measured phase by phase:
benchmarks/gpu_colocated.sh runs it on GPUs, tests/test_gpu_scripts.py on the CPU.

    torchrun --nproc_per_node N benchmarks/colocated_phases.py run [train.py's flags]   # train.py, phases timed
    python benchmarks/colocated_phases.py report OUTPUT_DIR [NVIDIA_SMI_CSV]            # what it measured

`run` is train.py as `python train.py` runs it, with four of the generator's phases wrapped; a
wrapper times and measures, and changes nothing the phase does. The phases of a step, in order:
generate (Generator.batch: rank 0 asks vLLM, every rank gets the batch), sleep (Generator.sleep:
weights to host memory, KV cache freed), train (update.train_on_batch), wake_sync
(Generator.sync: wake the weights, the weight sync, wake the KV cache). Each rank appends one
line a phase to OUTPUT_DIR/phases_rank{R}.jsonl: its wall-clock window and seconds, and on CUDA
torch.cuda.memory_allocated/reserved at its end, max_memory_allocated/reserved so far (not reset
per phase: train.py's peak_memory_gb reads the same counter), the device's used bytes at its
end (mem_get_info: every process on the GPU, the server's included, as nvidia-smi counts), and
the host's used memory (MemTotal - MemAvailable: the server's pinned sleep copies included) and
the rank's resident set. Rank 0 also times each call it makes to the server (sleep, wake_up of
each tag, reload_weights) apart.

`report` prints, from OUTPUT_DIR: the sync check's gap of each step (vllm_logp_diff_mean and _max,
metrics.jsonl) beside the tolerance the run used; each phase's figures (the largest over ranks
and steps) and nvidia-smi's largest used figure within the phase's window (NVIDIA_SMI_CSV:
`nvidia-smi --query-gpu=timestamp,index,memory.used --format=csv,noheader,nounits -lms 250`);
the server calls' times; the plan beside the measure (the run's `memory plan:` line from
OUTPUT_DIR/train.log, each step's memory_plan_gb and peak_memory_gb); and the times vLLM itself
logs for its sleep and wake ("It took ... seconds to fall asleep", OUTPUT_DIR/vllm.log).
"""

import datetime
import functools
import json
import os
import re
import resource
import runpy
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
GB = 1e9
PHASES = ("generate", "sleep", "train", "wake_sync")


def host_used():
    """(the host's used bytes, MemTotal - MemAvailable; this process's peak resident set)."""
    info = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in open("/proc/meminfo"))}
    return info["MemTotal"] - info["MemAvailable"], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(name, record, step):
    """A wrapper of fn that appends the phase's record (module docstring) once fn returns or raises."""
    import torch

    def wrap(fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.time()
            try:
                return fn(*args, **kwargs)
            finally:
                r = dict(step=step["now"], phase=name, start=start, end=time.time())
                r["seconds"] = r["end"] - start
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                    free, total = torch.cuda.mem_get_info()
                    r.update(allocated=torch.cuda.memory_allocated(), reserved=torch.cuda.memory_reserved(),
                             max_allocated=torch.cuda.max_memory_allocated(),
                             max_reserved=torch.cuda.max_memory_reserved(), device_used=total - free)
                r["host_used"], r["rank_peak_rss"] = host_used()
                record(r)
        return timed
    return wrap


def run(argv):
    """train.py's __main__ with the phases wrapped (the classes train.py imports, before it imports them)."""
    import update
    from config import Config
    from infra import vllm_client
    from infra.cli import parse_args_or_exit
    from infra.generator import Generator

    cfg = parse_args_or_exit(Config, argv)
    rank, step = int(os.environ.get("RANK", 0)), {"now": 0}
    os.makedirs(cfg.output_dir, exist_ok=True)
    out = open(os.path.join(cfg.output_dir, f"phases_rank{rank}.jsonl"), "a", buffering=1)

    def record(r):
        out.write(json.dumps(dict(r, rank=rank)) + "\n")
    for owner, name, phase in [(Generator, "batch", "generate"), (Generator, "sleep", "sleep"),
                               (update, "train_on_batch", "train"), (Generator, "sync", "wake_sync"),
                               (vllm_client.VLLMClient, "sleep", "server_sleep"),
                               (vllm_client.VLLMClient, "reload_weights", "server_reload")]:
        if not hasattr(owner, name):
            sys.exit(f"error: {owner.__name__}.{name} is gone; benchmarks/colocated_phases.py wraps it: update its list")
        setattr(owner, name, measure(phase, record, step)(getattr(owner, name)))
    batch = Generator.batch

    def batch_of_step(self, n, policy):  # the step every later phase belongs to
        step["now"] = n
        return batch(self, n, policy)
    Generator.batch = batch_of_step
    wake_up = vllm_client.VLLMClient.wake_up

    def wake_up_timed(self, tags):  # one phase a tag
        return measure(f"server_wake_{tags}", record, step)(wake_up)(self, tags)
    vllm_client.VLLMClient.wake_up = wake_up_timed
    sys.argv = [os.path.join(ROOT, "train.py"), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")  # exits with train.py's status


def smi_samples(path):
    """[(epoch seconds, gpu index, MiB used)] from nvidia-smi's csv (module docstring), or []."""
    if not path or not os.path.exists(path):
        return []
    rows = []
    for line in open(path):
        parts = [p.strip() for p in line.split(",")]
        try:
            t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            rows.append((t, int(parts[1]), float(parts[2])))
        except (ValueError, IndexError):
            continue
    return rows


def read_jsonl(path):
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def report(out_dir, smi_csv=None):
    """Print what the run in out_dir measured (module docstring)."""
    steps = read_jsonl(os.path.join(out_dir, "metrics.jsonl"))
    info_path = os.path.join(out_dir, "run_info.json")
    info = json.load(open(info_path)) if os.path.exists(info_path) else {}
    tolerance = info.get("config", {}).get("vllm_logp_tolerance")
    print(f"== {out_dir}: the sync check (mean |trainer - vLLM| logprob; the run's vllm_logp_tolerance {tolerance})")
    checked = [r for r in steps if "vllm_logp_diff_mean" in r]
    for r in checked:
        print(f"step {r['step']}: vllm_logp_diff_mean {r['vllm_logp_diff_mean']:.3g}, "
              f"vllm_logp_diff_max {r['vllm_logp_diff_max']:.3g}")
    if not checked:
        print("no step trained: no gap measured")
    phases = [r for name in sorted(os.listdir(out_dir)) if name.startswith("phases_rank")
              for r in read_jsonl(os.path.join(out_dir, name))]
    print_phases(phases, smi_samples(smi_csv))
    print("== the plan beside the measure")
    log = os.path.join(out_dir, "train.log")
    for line in open(log, errors="replace") if os.path.exists(log) else []:
        if "memory plan" in line or line.startswith("error:"):
            print(line.rstrip())
    for r in steps:
        print(f"step {r['step']}: memory_plan_gb {r.get('memory_plan_gb', float('nan')):.2f}, peak_memory_gb "
              f"{r.get('peak_memory_gb', float('nan')):.2f}, time_train {r.get('time_train', float('nan')):.3f} s, "
              f"time_sync {r.get('time_sync', float('nan')):.3f} s")
    print_server_times(os.path.join(out_dir, "vllm.log"))


def print_phases(phases, smi):
    """One line a phase: the largest figure over ranks and steps, nvidia-smi's largest within its windows."""
    print("== phases (largest over ranks and steps; GB = 1e9 bytes; the counters at the phase's end)")
    print("phase | median s | max s | allocated | reserved | max_allocated | max_reserved | device used | "
          "nvidia-smi max used GiB | host used | rank peak rss")
    names = [p for p in PHASES if any(r["phase"] == p for r in phases)]
    for name in names + sorted({r["phase"] for r in phases} - set(names)):
        rs = [r for r in phases if r["phase"] == name]
        cells = [f"{statistics.median(r['seconds'] for r in rs):.3f}", f"{max(r['seconds'] for r in rs):.3f}"]
        for key in ("allocated", "reserved", "max_allocated", "max_reserved", "device_used"):
            cells.append(f"{max(r[key] for r in rs) / GB:.2f}" if key in rs[0] else "-")
        window = [mib for t, _, mib in smi if any(r["start"] <= t <= r["end"] for r in rs)]
        cells.append(f"{max(window) / 1024:.2f}" if window else "-")
        cells += [f"{max(r[k] for r in rs) / GB:.2f}" for k in ("host_used", "rank_peak_rss")]
        print(" | ".join([name, *cells]))


def print_server_times(vllm_log):
    """The times vLLM logs for its sleep and wake-ups, and what its last sleeps freed."""
    print("== vLLM's own times (its log)")
    text = open(vllm_log, errors="replace").read() if os.path.exists(vllm_log) else ""
    for what, pattern in [("fall asleep", r"It took ([\d.]+) seconds to fall asleep"),
                          ("wake up weights", r"It took ([\d.]+) seconds to wake up tags \['weights'\]"),
                          ("wake up kv_cache", r"It took ([\d.]+) seconds to wake up tags \['kv_cache'\]")]:
        found = [float(x) for x in re.findall(pattern, text)]
        print(f"{what}: " + (f"{len(found)} times, median {statistics.median(found):.3f} s, max {max(found):.3f} s"
                             if found else "not in the log"))
    for line in re.findall(r"Sleep mode freed .*", text)[-2:]:
        print(line)


if __name__ == "__main__":  # the reward pool's workers import this file again as __mp_main__
    if len(sys.argv) < 2 or sys.argv[1] not in ("run", "report"):
        sys.exit("usage: benchmarks/colocated_phases.py run [train.py's flags] | report OUTPUT_DIR [NVIDIA_SMI_CSV]")
    run(sys.argv[2:]) if sys.argv[1] == "run" else report(*sys.argv[2:4])
