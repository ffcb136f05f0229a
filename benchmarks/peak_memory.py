"""Peak host memory of a command's whole process tree, of each trainer rank and of the vLLM server.

    .venv/bin/python benchmarks/peak_memory.py --out output/demo-memory.json -- bash scripts/demo.sh
    .venv/bin/python benchmarks/peak_memory.py --interval 0.5 -- bash scripts/demo.sh --num_training_steps 3

Everything after `--` is the command. It runs with this terminal's stdin, stdout and stderr
unchanged, and this tool exits with its exit status (128 + N when a signal N ended it). Every
--interval seconds (default 1) the tool walks the command's process and all its descendants
(/proc/*/stat parent links) and reads each one's PSS from /proc/PID/smaps_rollup (VmRSS from
/proc/PID/status when that is not readable; such processes are marked "rss"). The sum over the
tree is that sample's total. At the end it prints to stderr the peak of the total, the peak of
each process under a label (trainer rank N, vllm server, vllm EngineCore, a rank's reward/tool
workers, torchrun, ...), what each held at the moment of the tree's peak, the peak of each group
of processes (all trainer processes, all vLLM processes, the rest), and the wall time; --out
writes the same as JSON. GB = 1e9 bytes.

Why PSS: RSS counts every resident page of a process, so pages shared between processes (the
torch and vLLM libraries mapped by every rank, memory a fork has not written to yet) are
counted once per process and a sum of RSS over the tree overstates it. PSS gives each process
its share of a shared page (1/N of it when N processes map it), so the shares of one page add
up to one page and the sum over the tree counts it once. (Pages shared with processes outside
the tree are split with them too, so those are slightly undercounted.)

What it does not see: GPU memory, files in /dev/shm or tmpfs that no process maps, the page
cache, a peak shorter than --interval, and a process that leaves the tree (reparented to init
when its parent dies before it) from then on.
"""

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time

GB = 1e9


def read_text(path):
    """The contents of a /proc file, or None when the process is gone or the file is not readable."""
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:  # FileNotFoundError, ProcessLookupError, PermissionError: the process vanished or is not ours
        return None


def process_table():
    """{pid: (ppid, start_time, comm)} for every live process (zombies have no memory: left out)."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        stat = read_text(f"/proc/{name}/stat")
        if not stat:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split at the last ")"
        comm = stat[stat.find("(") + 1:stat.rfind(")")]
        fields = stat[stat.rfind(")") + 2:].split()
        if fields[0] != "Z":
            table[int(name)] = (int(fields[1]), fields[19], comm)  # fields[19]: starttime (stat field 22)
    return table


def descendants(table, root):
    """The root and all its descendants, parents before their children."""
    children = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    order = [root] if root in table else []
    for pid in order:  # grows as we go: a breadth-first walk
        order.extend(sorted(children.get(pid, [])))
    return order


def memory_bytes(pid):
    """(bytes, "pss") from smaps_rollup, else (bytes, "rss") from status, else None (vanished)."""
    for path, field, source in ((f"/proc/{pid}/smaps_rollup", "Pss:", "pss"), (f"/proc/{pid}/status", "VmRSS:", "rss")):
        text = read_text(path)
        for line in (text or "").splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024, source  # kB
    return None


def read_argv(pid):
    """The command line as a list (setproctitle titles such as "VLLM::EngineCore" come back as one item)."""
    text = read_text(f"/proc/{pid}/cmdline") or ""
    return [a for a in text.split("\0") if a]


def read_rank(pid):
    """RANK (else LOCAL_RANK) from the process's environment, or None when absent or not readable."""
    env = dict(item.split("=", 1) for item in (read_text(f"/proc/{pid}/environ") or "").split("\0") if "=" in item)
    return env.get("RANK", env.get("LOCAL_RANK"))


def short_name(argv, comm):
    """A readable name for any other process: "bash demo.sh", "python3 -c", "python -m pytest"."""
    if not argv:
        return comm
    prog = os.path.basename(argv[0])
    rest = argv[1:]
    while rest and rest[0].startswith("-") and rest[0] not in ("-c", "-m"):
        rest = rest[1:]  # interpreter options: python -u, bash -e
    if not rest:
        return prog
    if rest[0] == "-m" and len(rest) > 1:
        return f"{prog} -m {rest[1]}"
    return f"{prog} {rest[0] if rest[0] == '-c' else os.path.basename(rest[0])}"


def base_label(pid, argv, comm):
    """What the process is, from its own command line (and environment for a trainer rank)."""
    joined = " ".join(argv)
    names = [os.path.basename(a) for a in argv]
    if joined.startswith("VLLM::") or comm.startswith("VLLM::"):
        title = joined if joined.startswith("VLLM::") else comm
        return "vllm " + title.split("::", 1)[1].split()[0]  # vllm EngineCore, vllm Worker_TP0
    if "torchrun" in names or "torch.distributed.run" in argv:
        return "torchrun"
    if "train.py" in names:
        rank = read_rank(pid)
        return "trainer" if rank is None else f"trainer rank {rank}"
    # the program and its script or module: "python -m vllm.entrypoints.openai.api_server", "vllm serve",
    # not "pip install vllm"
    program = short_name(argv, comm)
    if "vllm" in program.lower():
        return "vllm server" if "vllm.entrypoints" in program or program == "vllm serve" else "vllm " + program
    for module, name in (("multiprocessing.forkserver", "forkserver"), ("multiprocessing.resource_tracker",
                         "resource tracker"), ("multiprocessing.spawn", "spawned child")):
        if module in joined:
            return name
    return program


def is_owner(label):
    """A process whose helpers are named after it."""
    return label.startswith("trainer") or label.startswith("vllm")


def label_tree(order, table):
    """{pid: label}. A trainer's or vLLM's helpers carry its name ("trainer rank 0: reward/tool worker");
    a fork without exec (same label as its parent) is "<parent> fork"."""
    base, labels, owner = {}, {}, {}
    for pid in order:
        ppid, _, comm = table[pid]
        base[pid] = base_label(pid, read_argv(pid), comm)
        if base[pid] == "forkserver" and base.get(ppid) == "forkserver":
            name = "reward/tool worker"  # forked by the forkserver of worker_pool.py
        elif base[pid] == base.get(ppid):
            name = labels[ppid] + " fork"
        else:
            name = base[pid]
        helper_of = owner.get(ppid)
        if is_owner(name) or helper_of is None or name.startswith(helper_of):
            labels[pid] = name
        else:
            labels[pid] = f"{helper_of}: {name}"
        owner[pid] = labels[pid] if is_owner(labels[pid]) and ":" not in labels[pid] else helper_of
    return labels


def group_of(label):
    """The group a process's memory is summed into: its owner's kind."""
    if label.startswith("trainer"):
        return "all trainer processes"
    if label.startswith("vllm"):
        return "all vllm processes"
    return "the rest"


def take_sample(state, root, t):
    """Read the tree once and fold it into state: peaks of the total, of each process and of each group."""
    table = process_table()
    order = descendants(table, root)
    labels = label_tree(order, table)
    total, now, groups = 0, {}, {}
    for pid in order:
        mem = memory_bytes(pid)
        if mem is None:
            continue  # vanished since the table was read
        size, source = mem
        key = (pid, table[pid][1])  # pid and start time: a reused pid is another process
        proc = state["processes"].setdefault(key, {"pid": pid, "peak": 0, "source": source, "cmdline": ""})
        proc["label"] = labels[pid]  # the latest: vLLM renames its engine after it starts
        proc["cmdline"] = shlex.join(read_argv(pid))[:200] or proc["cmdline"]
        if size > proc["peak"]:
            proc.update(peak=size, peak_s=t, source=source)
        total += size
        now[key] = size
        group = group_of(labels[pid])
        groups[group] = groups.get(group, 0) + size
    for group, size in groups.items():
        state["groups"][group] = max(state["groups"].get(group, 0), size)
    if total > state["peak"]:
        state.update(peak=total, peak_s=t, at_peak=now)
    state["samples"] += 1


def run(command, interval):
    """Run the command, sampling its tree every `interval` seconds; returns (exit status, state, wall seconds)."""
    state = {"peak": 0, "peak_s": 0.0, "at_peak": {}, "processes": {}, "groups": {}, "samples": 0}
    start = time.monotonic()
    try:
        proc = subprocess.Popen(command)
    except OSError as e:  # not found, not executable
        print(f"peak_memory: cannot run {command[0]}: {e}", file=sys.stderr)
        sys.exit(127)
    # Ctrl-C reaches the command from the terminal; we wait for it to stop and still report.
    # SIGTERM sent to this tool alone is passed on. (Handlers, unlike ignored signals, reset on exec.)
    signal.signal(signal.SIGINT, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))
    while True:
        take_sample(state, proc.pid, time.monotonic() - start)
        try:
            code = proc.wait(timeout=interval)
            break
        except subprocess.TimeoutExpired:
            pass
    wall = time.monotonic() - start
    return (128 - code if code < 0 else code), state, wall


def summary(command, interval, code, state, wall):
    """The report as a dict (the JSON of --out): sizes in GB, times in seconds from the start."""
    procs = sorted(state["processes"].items(), key=lambda kv: (kv[1]["label"], kv[1]["pid"]))
    counts = {}
    for _, p in procs:
        counts[p["label"]] = counts.get(p["label"], 0) + 1
    rows = []
    for key, p in procs:
        name = p["label"] if counts[p["label"]] == 1 else f"{p['label']} [pid {p['pid']}]"
        rows.append({"label": name, "pid": p["pid"], "peak_gb": round(p["peak"] / GB, 3),
                     "peak_at_s": round(p.get("peak_s", 0.0), 1),
                     "at_tree_peak_gb": round(state["at_peak"].get(key, 0) / GB, 3),
                     "memory": p["source"], "cmdline": p["cmdline"]})
    return {"command": command, "exit_status": code, "wall_s": round(wall, 1), "interval_s": interval,
            "samples": state["samples"], "tree_peak_gb": round(state["peak"] / GB, 3),
            "tree_peak_at_s": round(state["peak_s"], 1),
            "groups_peak_gb": {g: round(b / GB, 3) for g, b in sorted(state["groups"].items())},
            "processes": rows}


def print_table(report, smallest_gb=0.01):
    """The report on stderr: the tree's peak, one row per process of at least `smallest_gb`, the groups."""
    out = sys.stderr
    rows = [r for r in report["processes"] if r["peak_gb"] >= smallest_gb]
    print(f"\npeak_memory: {report['wall_s']:.1f} s wall, {report['samples']} samples every "
          f"{report['interval_s']} s, exit status {report['exit_status']}", file=out)
    print(f"peak of the whole tree: {report['tree_peak_gb']:.3f} GB PSS at {report['tree_peak_at_s']:.1f} s", file=out)
    width = max([len(r["label"]) for r in rows] + [len("process")])
    print(f"  {'process':<{width}}  {'peak GB':>8}  {'when, s':>7}  {'at tree peak':>12}", file=out)
    for r in rows:
        note = "  (RSS: no smaps_rollup)" if r["memory"] == "rss" else ""
        print(f"  {r['label']:<{width}}  {r['peak_gb']:>8.3f}  {r['peak_at_s']:>7.1f}  "
              f"{r['at_tree_peak_gb']:>12.3f}{note}", file=out)
    hidden = len(report["processes"]) - len(rows)
    if hidden:
        print(f"  ({hidden} smaller process{'es' if hidden > 1 else ''}, each under {smallest_gb} GB)", file=out)
    for group, gb in report["groups_peak_gb"].items():
        print(f"  peak of {group}: {gb:.3f} GB", file=out)


def main():
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     usage="%(prog)s [--interval S] [--out FILE.json] -- COMMAND [ARGS...]")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples (default 1)")
    parser.add_argument("--out", help="also write the report here as JSON")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    if not command or args.interval <= 0:
        parser.error("give a positive --interval and the command after --")
    code, state, wall = run(command, args.interval)
    report = summary(command, args.interval, code, state, wall)
    print_table(report)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"  written to {args.out}", file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    main()
