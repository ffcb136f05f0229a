"""The sandbox's process, as envs/sandbox.py's Interpreter starts it: its command line (bwrap,
then as root setpriv, then Python), the program that runs the cells inside it, its environment
variables and, as root, its memory cgroup. envs/sandbox.py says what holds and by what.
"""

import contextlib
import inspect
import os
import secrets
import sys


def python_dirs():
    """The directories the interpreter runs from outside /usr: the venv and the Python it was made
    from (each at its own path and, where that is a link, at its target's), and nothing around them."""
    dirs = set()
    for prefix in {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix}:
        dirs |= {prefix, os.path.realpath(prefix)}
    return sorted(d for d in dirs if d != "/" and d != "/usr" and not d.startswith("/usr/"))


def command(limits, uid, reply_fd, info_fd):
    """The sandbox's command line: bwrap, then (as root) setpriv to the sandbox's uid, then Python."""
    rlimits = dict(RLIMIT_AS=limits.memory, RLIMIT_FSIZE=limits.file_size, RLIMIT_NOFILE=limits.open_files,
                   RLIMIT_CORE=0, **({} if limits.isolation == "none" else dict(RLIMIT_NPROC=limits.processes)))
    python = [sys.executable, "-I", "-B", "-u", "-c", f"{inspect.getsource(interpreter)}\n"
              f"interpreter({reply_fd}, {limits.cpu}, {rlimits!r}, {limits.isolation == 'bwrap'})\n"]
    if limits.isolation == "none":
        return python
    tmpfs = ["--size", str(limits.disk), "--perms", "1777", "--tmpfs"]  # writable by the sandbox's uid
    line = ["bwrap", "--die-with-parent", "--new-session", "--info-fd", str(info_fd),
            # root makes namespaces without a user namespace, which would map the code to uid 0,
            # for which RLIMIT_NPROC does not hold; setpriv below gives it a uid of its own
            *(["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
              if uid is not None else ["--unshare-all", "--uid", "1000", "--gid", "1000"]),
            "--ro-bind", "/usr", "/usr"]
    for path in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):  # links into /usr on merged systems
        line += (["--symlink", os.readlink(path), path] if os.path.islink(path) else
                 ["--ro-bind", path, path] if os.path.isdir(path) else [])
    # the sandbox's own /proc, /dev, /tmp and /dev/shm first: the interpreter's files are bound after them,
    # so that a venv under /tmp (a checkout in /tmp) is bound into the sandbox's /tmp, not hidden by it
    line += ["--proc", "/proc", "--dev", "/dev", *tmpfs, "/tmp", *tmpfs, "/dev/shm"]
    for path in python_dirs():  # its parents made searchable (bwrap would make them 0700)
        parents = [path[:i] for i in range(1, len(path)) if path[i] == "/"]
        line += [a for p in parents if p not in ("/tmp", "/dev", "/dev/shm") for a in ("--perms", "0755", "--dir", p)]
        line += ["--ro-bind", os.path.realpath(path), path]
    line += ["--chdir", "/tmp",
             "--clearenv", *[a for k, v in environment("/tmp").items() for a in ("--setenv", k, v)], "--"]
    if uid is not None:
        line += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs", "--"]
    return line + python


def interpreter(reply_fd, cpu, rlimits, isolated):
    """The sandbox's interpreter (its source runs alone there): runs each line of stdin, a JSON
    {"code", "nonce"}, as a cell in one namespace and answers on reply_fd with the nonce."""
    import contextlib, errno, json, math, os, resource, signal, traceback  # noqa: E401 - the whole program

    for name, value in rlimits.items():  # soft = hard: a cell cannot raise them
        resource.setrlimit(getattr(resource, name), (value, value))
    cells, null = os.fdopen(os.dup(0), "rb"), os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # input() in a cell ends at once: it cannot eat the next cell
    os.close(null)
    namespace, me = {"__name__": "__main__"}, os.getpid()
    os.write(reply_fd, b'{"ready": true}\n')
    for line in cells:
        request = json.loads(line)
        used = resource.getrusage(resource.RUSAGE_SELF)  # the CPU limit counts from the cell's start
        soft = math.ceil(used.ru_utime + used.ru_stime) + cpu
        resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.RLIM_INFINITY))  # SIGXCPU there
        error = limit = None
        try:
            exec(compile(request.pop("code"), "<cell>", "exec"), namespace)
        except Exception as e:  # noqa: BLE001 - the cell's failure, told to the policy
            if os.getpid() == me:
                traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # from the cell's frame on
                error, limit = f"{type(e).__name__}: {e}", "memory" if isinstance(e, MemoryError) else {
                    errno.EFBIG: "file size", errno.EAGAIN: "processes", errno.EMFILE: "open files",
                    errno.ENOSPC: "disk"}.get(getattr(e, "errno", None))
        if os.getpid() != me:
            os._exit(0)  # a process forked by the cell ran off its end: it must not answer
        if isolated:  # every other process of the namespace (pid 1 and we are spared: kill(2))
            with contextlib.suppress(ProcessLookupError):
                os.kill(-1, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):  # our zombies count as processes; pid 1 reaps the rest
            while os.waitpid(-1, 0 if isolated else os.WNOHANG)[0]:
                pass
        os.write(reply_fd, (json.dumps(dict(nonce=request["nonce"], error=error, limit=limit)) + "\n").encode())


def memory_cgroup(limit):
    """As root, a memory cgroup of its own for one sandbox, capped at limit bytes (cgroup v1's memory
    controller, or v2 where our cgroup delegates memory); None where none can be made."""
    if os.geteuid() != 0:
        return None
    with open("/proc/self/cgroup") as f:  # lines "id:controllers:path"; v2's is "0::path"
        own = dict(line.strip().split(":", 2)[1:] for line in f)
    if os.path.exists("/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # v1: under our own where it is mounted
        parent = "/sys/fs/cgroup/memory" + own.get("memory", "/").rstrip("/")
        parent, cap = parent if os.path.isdir(parent) else "/sys/fs/cgroup/memory", "memory.limit_in_bytes"
    else:
        parent, cap = "/sys/fs/cgroup" + own.get("", "/").rstrip("/"), "memory.max"
        with contextlib.suppress(OSError), open(f"{parent}/cgroup.subtree_control") as f:
            if "memory" not in f.read().split():
                return None
    for name in os.listdir(parent):  # those of owners killed before they could remove theirs
        if name.startswith("sandbox-") and not os.path.exists(f"/proc/{name.split('-')[1]}"):
            with contextlib.suppress(OSError):  # (not empty: its processes are still dying)
                os.rmdir(f"{parent}/{name}")
    path = f"{parent}/sandbox-{os.getpid()}-{secrets.token_hex(4)}"  # its owner's pid
    try:
        os.mkdir(path)
        with open(f"{path}/{cap}", "w") as f:
            f.write(str(limit))
        return path
    except OSError:
        with contextlib.suppress(OSError):
            os.rmdir(path)
        return None


def oom_kills(cgroup):
    """How many processes the kernel killed for the cgroup's memory limit."""
    for name in ("memory.events", "memory.oom_control"):  # v2, v1
        with contextlib.suppress(OSError), open(f"{cgroup}/{name}") as f:
            return int(dict(line.split() for line in f).get("oom_kill", 0))
    return 0


def environment(home):
    """The sandbox's environment variables: nothing of the trainer's (no HF_TOKEN, no WANDB_API_KEY)."""
    return dict(PATH=f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin", HOME=home, TMPDIR=home,
                LANG="C.UTF-8", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",  # a thread per core would
                MKL_NUM_THREADS="1")  # count as processes
