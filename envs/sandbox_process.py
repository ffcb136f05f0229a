"""The sandbox's process, as envs/sandbox.py's Interpreter starts it: its command line (bwrap,
then as root setpriv, then Python), its seccomp filter, the program that runs the cells inside it,
its environment variables, its session keyring and, as root, its memory cgroup; and its processes
as /proc shows them from outside (the tree under its pid 1, their CPU time, whether they are
stopped). envs/sandbox.py says what holds and by what.
"""

import contextlib
import ctypes
import functools
import inspect
import os
import platform
import secrets
import shutil
import struct
import subprocess
import sys

# The system calls the seccomp filter refuses (their numbers per architecture, from the kernel's
# unistd tables; AUDIT_ARCH_* from linux/audit.h): ptrace, process_vm_readv/writev and pidfd_getfd
# (another process's memory and files), add_key, request_key and keyctl (keys); memory that no
# rlimit counts: memfd_create and memfd_secret (a file in memory, sized by write(2) past RLIMIT_AS
# and outside /tmp's size), and SysV shmget, semget and msgget (segments, semaphore sets and queues
# that outlive every mapping, bounded only by the ipc namespace's sysctls: gigabytes); unshare and
# clone where their flags ask for CLONE_NEWUSER (in a user namespace of its own the code would be
# root again, and could mount a tmpfs of any size past Limits.disk); and prctl(PR_SET_PDEATHSIG) to
# anything but SIGKILL (not root, the interpreter is pid 1 and dies with bwrap by that signal alone). clone3 passes its flags in memory, which a filter cannot read: it is
# told ENOSYS, and glibc falls back to clone.
ARCHES = {"x86_64": dict(arch=0xC000003E, denied=(101, 310, 311, 438, 248, 249, 250, 319, 447, 29, 64, 68),
                         newuser=(272, 56), clone3=435, prctl=157),
          "aarch64": dict(arch=0xC00000B7, denied=(117, 270, 271, 438, 217, 218, 219, 279, 447, 194, 190, 186),
                          newuser=(97, 220), clone3=435, prctl=167)}
KEYCTL = {"x86_64": 250, "aarch64": 219}.get(platform.machine())  # keyctl's number, for new_session_keyring
SYSCALLS = ARCHES.get(platform.machine()) if struct.calcsize("P") == 8 else None  # None: a 32-bit Python


def python_dirs():
    """The directories the interpreter runs from outside /usr: the venv and the Python it was made
    from (each at its own path and, where that is a link, at its target's), and nothing around them."""
    dirs = set()
    for prefix in {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix}:
        dirs |= {prefix, os.path.realpath(prefix)}
    return sorted(d for d in dirs if d != "/" and d != "/usr" and not d.startswith("/usr/"))


def command(limits, uid, reply_fd, info_fd, seccomp_fd):
    """The sandbox's command line: bwrap, then (as root) setpriv to the sandbox's uid, then Python.
    Its environment is environment("/tmp"), which bwrap is given to pass on (sandbox.py's Popen)."""
    rlimits = dict(RLIMIT_AS=limits.memory, RLIMIT_FSIZE=limits.file_size, RLIMIT_NOFILE=limits.open_files,
                   RLIMIT_CORE=0, **({} if limits.isolation == "none" else dict(RLIMIT_NPROC=limits.processes)))
    python = [sys.executable, "-I", "-B", "-u", "-c", f"{inspect.getsource(interpreter)}\n"
              f"interpreter({reply_fd}, {limits.cpu}, {limits.cpu_total}, {rlimits!r}, {limits.isolation == 'bwrap'})\n"]
    if limits.isolation == "none":
        return python
    tmpfs = ["--size", str(limits.disk), "--perms", "1777", "--tmpfs"]  # writable by the sandbox's uid
    bwrap = shutil.which("bwrap") or "bwrap"  # found on the trainer's PATH, not on the sandbox's
    # Not root, bwrap's reaper would be the namespace's pid 1 with the code's uid, outside every rlimit, its
    # memory the code's to write (/proc/1/mem): --as-pid-1 makes the interpreter pid 1 instead, under its
    # limits, tied to bwrap by its parent-death signal (which the seccomp filter keeps the code from
    # clearing); when it ends the kernel kills every other process of the namespace. As root the reaper
    # is uid 0, out of the code's reach, and stays: the interpreter's uid (setpriv) could not be sent
    # its parent-death signal by bwrap, which holds no CAP_KILL.
    line = [bwrap, "--die-with-parent", *(["--as-pid-1"] if uid is None else []), "--new-session",
            "--info-fd", str(info_fd),
            *(["--seccomp", str(seccomp_fd)] if seccomp_fd is not None else []),
            # root makes namespaces without a user namespace, which would map the code to uid 0,
            # for which RLIMIT_NPROC does not hold; setpriv below gives it a uid of its own
            *(["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
              if uid is not None else ["--unshare-all", "--uid", "1000", "--gid", "1000"]),
            # not root, no user namespace inside ours either (bwrap 0.8; the seccomp filter refuses them too)
            *(["--unshare-user", "--disable-userns"] if uid is None and "--disable-userns" in options(bwrap) else []),
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
    # / and /dev read-only (not root, they are tmpfs the code owns, of no size limit): only /tmp and
    # /dev/shm, each of Limits.disk, take files; /dev/null and the other devices are written all the same
    line += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/tmp", "--"]
    if uid is not None:
        line += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs", "--"]
    return line + python


@functools.cache
def options(bwrap):
    """bwrap's --help, once: the options this version knows."""
    return subprocess.run([bwrap, "--help"], capture_output=True, text=True).stdout


def seccomp_filter():
    """The sandbox's seccomp filter, for bwrap --seccomp: a classic BPF program (struct sock_filter:
    code, jt, jf, k) over struct seccomp_data (nr at offset 0, arch at 4, the low halves of args[0]
    and args[1] at 16 and 24) that refuses ARCHES's calls. None on an architecture we hold no numbers for: the code then
    runs without it, bwrap's namespaces and the rlimits still hold."""
    if SYSCALLS is None:
        return None
    load, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET
    allow, kill, eperm, enosys = 0x7FFF0000, 0x80000000, 0x50000 | 1, 0x50000 | 38  # SECCOMP_RET_*, ERRNO|errno
    program = [(load, 0, 0, 4), (jeq, 1, 0, SYSCALLS["arch"]), (ret, 0, 0, kill),  # i386's int 0x80: killed
               (load, 0, 0, 0)]
    if platform.machine() == "x86_64":  # the x32 ABI: the same arch, its numbers with bit 30 set
        program += [(jge, 0, 1, 0x40000000), (ret, 0, 0, eperm)]
    for nr, errno in [(nr, eperm) for nr in SYSCALLS["denied"]] + [(SYSCALLS["clone3"], enosys)]:
        program += [(jeq, 0, 1, nr), (ret, 0, 0, errno)]
    program += [(jeq, 0, 6, SYSCALLS["prctl"]), (load, 0, 0, 16), (jeq, 0, 3, 1),  # prctl(PR_SET_PDEATHSIG, sig)
                (load, 0, 0, 24), (jeq, 1, 0, 9), (ret, 0, 0, eperm),  # sig (args[1]) other than SIGKILL
                (ret, 0, 0, allow)]
    unshare, clone = SYSCALLS["newuser"]
    program += [(jeq, 1, 0, unshare), (jeq, 0, 3, clone),  # either: look at its flags; else allow
                (load, 0, 0, 16), (jset, 0, 1, 0x10000000), (ret, 0, 0, eperm),  # CLONE_NEWUSER
                (ret, 0, 0, allow)]
    return b"".join(struct.pack("=HBBI", *op) for op in program)


def seccomp_pipe():
    """A pipe's read end that holds the seccomp filter, for bwrap --seccomp to read; None without one."""
    if (program := seccomp_filter()) is None:
        return None
    fd, write = os.pipe()
    os.write(write, program)  # some 30 instructions of 8 bytes: the pipe's buffer holds them
    os.close(write)
    return fd


def new_session_keyring(keyctl=ctypes.CDLL(None, use_errno=True).syscall):
    """Popen's preexec_fn: bwrap, and so the sandbox, joins an anonymous session keyring of its own
    (keyctl(KEYCTL_JOIN_SESSION_KEYRING, NULL)) in place of the trainer's, whose keys any process
    holding that keyring may read, whatever its uid. It only calls the syscall, bound in advance (after
    fork, with no lock of another thread taken). Its failure is ignored (a container's seccomp profile
    that refuses keyctl, a user's key quota spent): the filter still refuses keyctl to the code."""
    if KEYCTL is not None:
        keyctl(KEYCTL, 1, None)


def interpreter(reply_fd, cpu, cpu_total, rlimits, isolated):
    """The sandbox's interpreter (its source runs alone there): runs each line of stdin, a JSON
    {"code", "nonce"}, as a cell in one namespace and answers on reply_fd with the nonce. As the
    namespace's pid 1 (not root), the kernel ignores the signals it has no handler for (SIGKILL from
    outside excepted), so the CPU limit's SIGXCPU gets one, which exits as the signal would."""
    import contextlib, errno, json, math, os, resource, signal, traceback  # noqa: E401 - the whole program

    for name, value in rlimits.items():  # soft = hard: a cell cannot raise them
        resource.setrlimit(getattr(resource, name), (value, value))
    if os.getpid() == 1:
        signal.signal(signal.SIGXCPU, lambda *_: os._exit(128 + signal.SIGXCPU))  # bwrap's way to tell a signal
    cells, null = os.fdopen(os.dup(0), "rb"), os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # input() in a cell ends at once: it cannot eat the next cell
    os.close(null)
    namespace, me = {"__name__": "__main__"}, os.getpid()
    os.write(reply_fd, b'{"ready": true}\n')
    for line in cells:
        request = json.loads(line)
        with contextlib.suppress(ChildProcessError):  # what the host killed between cells (Interpreter.freeze)
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        used = resource.getrusage(resource.RUSAGE_SELF)  # the CPU limit counts from the cell's start
        soft = min(math.ceil(used.ru_utime + used.ru_stime) + cpu, cpu_total)  # SIGXCPU there; the hard
        resource.setrlimit(resource.RLIMIT_CPU, (soft, cpu_total + 1))  # limit (SIGKILL) is the whole life's
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
        with contextlib.suppress(ChildProcessError):  # zombies count as processes; pid 1 reaps every orphan
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
    """The sandbox's environment variables: nothing of the trainer's (no HF_TOKEN, no WANDB_API_KEY).
    bwrap itself starts with them."""
    return dict(PATH=f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin", HOME=home, TMPDIR=home,
                LANG="C.UTF-8", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",  # a thread per core would
                MKL_NUM_THREADS="1")  # count as processes


# --- the sandbox's processes, read from outside (/proc/PID/stat: state is field 3, ppid 4, utime, stime,
# cutime and cstime 14 to 17, in clock ticks; the fields after the command's closing parenthesis)


def stat(pid):
    """The fields of /proc/PID/stat after its command (state first); None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def tree(pid):
    """Process pid and every living process under it (a sandbox's pid 1: all of the sandbox, since its
    orphans are reparented to it), zombies left out."""
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        if (fields := stat(entry)) and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


def child(pid):
    """A child of process pid (as root, bwrap's reaper's only one: the interpreter); None when it has none."""
    return next(iter(tree(pid)[1:]), None)


def cpu_seconds(pid):
    """CPU seconds of process pid and all under it, those of the children each has reaped included."""
    tick = os.sysconf("SC_CLK_TCK")
    return sum(sum(map(int, fields[11:15])) / tick for p in tree(pid) if (fields := stat(p)))


def stopped(pid):
    """Whether every thread of process pid is stopped (state T) or gone (Z, X): none of it runs."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    return all((fields := stat(f"{pid}/task/{t}")) is None or fields[0] in "TZX" for t in tasks)


def run_delay(pid):
    """Seconds the main thread of process pid has waited on a run queue for a CPU (/proc/PID/schedstat:
    its time on a CPU, its time waiting for one, in ns); 0 without a pid or the file."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0
