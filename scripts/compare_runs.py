"""Compare two directories of scripts/behaviour_check.sh runs: every logged metric but the
wall-clock ones, and every tensor and value of the checkpoints and exports, exactly. Paths
under each directory are compared as OUT/...; Python's `random` state is left out (nothing
of the trainer draws from it, and each process seeds it from the OS).

    python scripts/compare_runs.py OUT_A OUT_B [--perturb]   (--perturb changes one metric of B
    in memory first, to show a difference is caught)"""

import glob
import json
import os
import sys
import tempfile

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VOLATILE = ("time_", "tokens_per_s", "peak_memory_gb", "memory_plan_gb")
# The server's side of the sync check: with episodes of several turns (an environment, an agent) the
# server batches turns as they arrive, and its logprobs move in the last bits between two runs of the
# same code. Shown when they differ, never counted as a difference.
SERVER = ("vllm_logp_diff_",)


def metrics(run):
    rows = [json.loads(line) for line in open(os.path.join(run, "out", "metrics.jsonl"))]
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def leaves(obj, prefix=""):
    """Every tensor and plain value of a nested state, by its path."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from leaves(v, f"{prefix}/{i}")
    else:
        yield prefix, obj


def leaf_ok(path):
    return "/python/" not in path  # rng_R.pt's Python `random` state: seeded from the OS in every process


def same(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    return a == b or (a != a and b != b)  # NaN equals NaN here


def state(run):
    """The run's files as one flat dict: the sharded checkpoint, the small .pt files, the exports."""
    found = {}
    for ckpt in sorted(glob.glob(os.path.join(run, "ckpt", "step_*"))):
        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(ckpt, os.path.join(tmp, "all.pt"))
            found.update(leaves(torch.load(os.path.join(tmp, "all.pt"), weights_only=False), os.path.basename(ckpt)))
        for pt in sorted(glob.glob(os.path.join(ckpt, "*.pt"))):
            found.update(leaves(torch.load(pt, weights_only=False), os.path.relpath(pt, run)))
    root = os.path.dirname(os.path.abspath(run))
    found = {k: v.replace(root, "OUT") if isinstance(v, str) else v
             for k, v in found.items() if leaf_ok(k)}
    for st in sorted(glob.glob(os.path.join(run, "out", "**", "*.safetensors"), recursive=True)):
        found.update(leaves(load_file(st), os.path.relpath(st, run)))
    return found


def compare(a, b, perturb=False):
    ma, mb = metrics(a), metrics(b)
    if perturb and mb:
        key = next(k for k, v in mb[-1].items() if isinstance(v, float))
        mb[-1][key] += 1e-9
    diff = [(i, k, ra.get(k), rb.get(k)) for i, (ra, rb) in enumerate(zip(ma, mb)) for k in sorted(set(ra) | set(rb))
            if not same(ra.get(k), rb.get(k))]
    bad = [f"metrics row {i}: {k}: {x} != {y}" for i, k, x, y in diff if not k.startswith(SERVER)]
    server = [f"metrics row {i}: {k}: {x} vs {y} (the server's)" for i, k, x, y in diff if k.startswith(SERVER)]
    if len(ma) != len(mb):
        bad.append(f"metrics rows: {len(ma)} != {len(mb)}")
    sa, sb = state(a), state(b)
    bad += [f"{k}: only in {'A' if k in sa else 'B'}" for k in sorted(set(sa) ^ set(sb))]
    bad += [f"{k}: differs" for k in sorted(set(sa) & set(sb)) if not same(sa[k], sb[k])]
    tensors = sum(isinstance(v, torch.Tensor) for v in sa.values())
    return bad, len(ma), tensors, server


def main(argv):
    perturb = "--perturb" in argv
    a, b = [x for x in argv if not x.startswith("--")]
    failed = False
    for name in sorted(os.listdir(a)):
        if not os.path.isdir(os.path.join(a, name)):
            continue
        bad, rows, tensors, server = compare(os.path.join(a, name), os.path.join(b, name), perturb)
        print(f"{name}: {'identical' if not bad else 'DIFFERENT'}: {rows} metric rows, {tensors} tensors"
              + "".join(f"\n    {line}" for line in bad[:10] + server))
        failed |= bool(bad)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main(sys.argv[1:])
