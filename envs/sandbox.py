"""Run Python that the policy writes in a bubblewrap sandbox.

    from envs import sandbox
    sandbox.run("print(2 ** 10)", sandbox.Limits(cpu=5, wall=10)).stdout    # one shot: "1024\n"
    with sandbox.Interpreter() as py:                                       # one per episode
        py.run("x = 41"); py.run("print(x + 1)")                           # variables last
    --environment envs.python_tool:PythonTool                               # the policy's tool

The interpreter runs in bwrap (bubblewrap: apt-get install bubblewrap; scripts/install.sh does
it as root); envs/sandbox_process.py builds its command line. What holds, and by what
(tests/test_sandbox.py checks each, as root and as a user):
- Files: only /usr (and /bin, /lib... beside it) and the interpreter's own prefixes (the venv,
  the Python it was made from), read-only; a /tmp that is the cwd and HOME, and a /dev/shm, each
  a tmpfs of its own (gone when the sandbox ends: a restart empties them; a venv that lives under
  /tmp is bound read-only into it at its own path), the only places it can write: / and /dev are
  read-only (/dev/null and the other devices are written all the same). Nothing of the checkout,
  the datasets, the output directory, /etc, the home or the host's /tmp and /dev/shm.
- Namespaces: a network of its own loopback only (nothing outside it, the host's loopback
  neither), a pid namespace with its own /proc whose pid 1 is the interpreter itself (bwrap
  --as-pid-1: no reaper of bwrap's beside it, so no process of the sandbox stands outside the
  limits below; /proc/1/mem is the code's own), ipc, uts. As root:
  no user namespace, and the code runs as a uid of its own (setpriv: no groups, no new
  privileges); not root: a user namespace in which the code is uid 1000 and can make no other
  (bwrap 0.8's --disable-userns, and the seccomp filter below).
- Kernel: a seccomp filter (bwrap --seccomp; x86_64 and aarch64, none elsewhere) refuses ptrace,
  process_vm_readv/writev and pidfd_getfd, add_key, request_key and keyctl; memory no rlimit
  counts (memfd_create, memfd_secret, and SysV shmget, semget and msgget: POSIX shared memory is
  files in /dev/shm, of Limits.disk); clearing or changing the parent-death signal
  (prctl(PR_SET_PDEATHSIG) to anything but SIGKILL); a user namespace (unshare or clone with
  CLONE_NEWUSER; clone3 answers ENOSYS, and glibc then uses clone); on x86_64, every x32 call too,
  and a 32-bit call (int 0x80) kills its process.
  The sandbox joins a session keyring of its own: the trainer's keys are not within its reach.
- Life: bwrap dies with the process that started it (--die-with-parent; the tool worker, or its
  thread that started it), and with bwrap the interpreter (its parent-death signal, which setpriv
  keeps as root and the filter keeps the code from clearing), and with the interpreter, pid 1,
  every process of the sandbox. At the wall clock, and when a reply does not check, we SIGKILL
  pid 1: the whole tree goes. After each cell the interpreter SIGKILLs every other process of the
  namespace, and we stop it (SIGSTOP) until the next cell: nothing a cell started, a thread of
  the interpreter's included, runs or takes a CPU between cells.
- Limits. Per sandbox: processes and threads (RLIMIT_NPROC counts per uid, and the uid, or user
  namespace, is the sandbox's own), disk (Limits.disk in /tmp and as much in /dev/shm), wall
  clock; as root where a memory cgroup can be made, memory (Limits.memory for all its processes
  together). Per process: CPU seconds (RLIMIT_CPU from each cell's start: SIGXCPU; its hard
  value Limits.cpu_total, the interpreter's whole life, finite: a cell cannot lift it, and one
  that ignores SIGXCPU is killed there or at the wall clock), memory (RLIMIT_AS: MemoryError;
  the only memory limit where there is no cgroup: as many processes as the limit allows may
  each use as much, and memory outside any mapping is refused above), open files. Per file: size
  (RLIMIT_FSIZE, stdout and stderr too). What is left unbounded by a number of ours is bounded by
  these: pipes' and sockets' buffers (by open files and processes).
- Whose a wall clock is: Result.waited is how long the cell's thread waited on the run queue for
  a CPU; more than half the wall clock is a loaded machine's doing (Result.ours, faults.py's
  tool_starved), else the code's.
- Replies: each cell is sent with a random nonce, and the reply must carry it; a reply that does
  not (a cell that wrote on the reply pipe) kills the sandbox and answers the cell as an error.
  Code in the cell can still find the nonce by introspection (frames, the gc): this keeps a
  model's mistakes from corrupting the protocol, not a determined attacker. Same for the rest:
  the kernel is shared, and the seccomp filter refuses only the calls above.
- Environment: PATH, HOME, TMPDIR, LANG and thread counts; none of the trainer's variables, in
  the code's process or in bwrap's.
Fails closed: without bwrap, or where it cannot make namespaces, the first cell raises one line
naming the fix (probe() runs one cell, once at the run's start where the calls run: PythonTool.check). SANDBOX_ISOLATION=none
(or Limits(isolation="none")) opts into running the code unisolated, with a warning: rlimits (no
process limit) and a scratch directory, nothing else.

Its door: envs/python_tool.py (PythonTool) runs the policy's code here; no core file names it.
"""

import contextlib
import dataclasses
import fcntl
import json
import os
import random
import secrets
import select
import shutil
import signal
import subprocess
import tempfile
import time
import warnings

from envs.sandbox_process import (child, command, cpu_seconds, environment, memory_cgroup, new_session_keyring,
                                  oom_kills, run_delay, seccomp_pipe, stopped, tree)

# what Interpreter.fail and probe say to do where bwrap cannot start a sandbox
FIX = ("; where bwrap cannot make namespaces: as root in a container, allow them (docker run --privileged, "
       "or a seccomp profile that permits unshare); not root, enable user namespaces (sysctl "
       "user.max_user_namespaces=15000 kernel.unprivileged_userns_clone=1, on Ubuntu "
       "kernel.apparmor_restrict_unprivileged_userns=0); or run the code unisolated with SANDBOX_ISOLATION=none")
UIDS = 2_000_000_000  # the sandboxes' uids, as root: UIDS + a random offset below 2**24, no user's
START_TIME = 4.0  # seconds the sandboxed interpreter may take to start (it takes ~0.1 s)


@dataclasses.dataclass
class Limits:
    cpu: int = 5  # CPU seconds per cell, per process (all its threads): SIGXCPU, the interpreter restarts
    cpu_total: int = 60  # CPU seconds of the interpreter's whole life, every cell's: a hard limit (SIGKILL)
    wall: float = 10.0  # seconds per cell, by the clock, for the whole sandbox
    memory: int = 1 << 30  # bytes of address space per process; as root with a memory cgroup, also of all together
    disk: int = 64 << 20  # bytes in /tmp, and as many in /dev/shm (tmpfs, in memory)
    file_size: int = 16 << 20  # bytes per file written, stdout and stderr included
    processes: int = 32  # processes and threads of the sandbox, the interpreter included
    open_files: int = 64  # per process
    output: int = 4096  # bytes of stdout and of stderr kept per cell
    # "bwrap", or "none" to run the code unisolated (a warning says what is missing)
    isolation: str = dataclasses.field(default_factory=lambda: os.environ.get("SANDBOX_ISOLATION", "bwrap"))

    def __post_init__(self):
        if self.isolation not in ("bwrap", "none"):
            raise ValueError(f"isolation={self.isolation!r} must be 'bwrap' or 'none' (SANDBOX_ISOLATION)")
        if self.cpu_total < self.cpu:
            raise ValueError(f"cpu_total={self.cpu_total} is below one cell's cpu={self.cpu}: raise cpu_total")


@dataclasses.dataclass
class Result:
    stdout: str  # cut to Limits.output bytes (" [cut]" marks a cut)
    stderr: str  # a failed cell's traceback is here
    error: str | None = None  # what went wrong, in words; None when the cell ran through
    limit: str | None = None  # the limit that fired: cpu, wall, memory, disk, file size, processes, open files
    exit: int | None = None  # the interpreter's exit status (-N: signal N) when it ended; the next cell starts afresh
    waited: float = 0.0  # seconds the cell's thread waited for a CPU (the kernel's run queue), isolated only
    cpu: float = 0.0  # CPU seconds every process of the sandbox used in the cell, isolated only

    def ours(self, limits):
        """Whose failure a cell at the wall clock is, by faults.py's rule (tool_starved): ours when the
        machine kept the cell's thread waiting for a CPU for more than half its wall clock while the
        sandbox, all its processes together, got less than half a CPU (a loaded machine); else the
        code's own: it computed, slept, or made its own thread wait behind processes of its own."""
        return self.limit == "wall" and self.waited > limits.wall / 2 and self.cpu < limits.wall / 2


def read_line(fd, deadline, cap=1 << 16):
    """One line from fd by the deadline; b"" at its end or past cap bytes (the sandbox is not
    trusted to be brief); None when time ran out."""
    data = b""
    while b"\n" not in data:
        if not select.select([fd], [], [], max(deadline - time.monotonic(), 0))[0]:
            return None
        chunk = os.read(fd, 4096)
        if not chunk or len(data) > cap:
            return b""
        data += chunk
    return data.split(b"\n", 1)[0]


def write_all(fd, data, deadline):
    """Write to a non-blocking fd by the deadline (a sandbox that stops reading cannot hang us)."""
    while data and select.select([], [fd], [], max(deadline - time.monotonic(), 0))[1]:
        data = data[os.write(fd, data):]
    return not data


class Interpreter:
    """One sandboxed Python process that runs successive cells in one namespace (variables last
    between cells), started by the first cell. A cell that ends the process (its wall clock,
    its CPU, an exit, a reply that does not check) says so, and the next cell starts an empty
    interpreter with an empty /tmp. close() ends it. Use it from the thread that will close it:
    the sandbox dies with the thread that started it (PR_SET_PDEATHSIG)."""

    def __init__(self, limits=None):
        self.limits = limits or Limits()
        self.proc = self.cells = self.replies = self.out = self.err = self.cgroup = None
        self.pidfd = self.python = self.pid = self.pid1 = None  # pid 1's handle; the interpreter's handle, host pids
        self.scratch = None  # unisolated only: the host directory that is its cwd, HOME and TMPDIR

    def start(self):
        isolated = self.limits.isolation == "bwrap"
        for tool, package in [("bwrap", "bubblewrap")] + [("setpriv", "util-linux")] * (os.geteuid() == 0):
            if isolated and not shutil.which(tool):
                raise RuntimeError(f"the sandbox needs {tool}: apt-get install {package} (dnf, apk, pacman: the "
                                   "same), or run the policy's code unisolated with SANDBOX_ISOLATION=none")
        if not isolated:
            warnings.warn("SANDBOX_ISOLATION=none: the policy's code runs unisolated, as this user, with the "
                          "network, every file this user can read or write, and no process limit", stacklevel=3)
            self.scratch = self.scratch or tempfile.mkdtemp(prefix="sandbox-")
        # as root, a uid of the sandbox's own: one in 2**24 at random (two sandboxes that drew the
        # same would share their process limit, and nothing else: their pids and files are apart)
        self.uid = UIDS + random.randrange(1 << 24) if isolated and os.geteuid() == 0 else None
        theirs = []  # the pipes' ends the sandbox's process gets: ours closed once it has them
        try:
            info = self.launch(isolated, theirs)
        except BaseException:  # nothing opened outlives a start that failed: pipes, files, the cgroup
            self.release(theirs)
            raise
        for fd in theirs:
            os.close(fd)
        ready = read_line(self.replies, time.monotonic() + START_TIME) == b'{"ready": true}'
        with os.fdopen(info) as f:  # bwrap wrote its pid 1's pid there, and closed it, before that started us
            pid = json.loads(f.read() or "{}").get("child-pid") if isolated and ready else None
        self.pidfd = os.pidfd_open(pid) if pid else None  # a handle on that process: no pid reuse misdirects a kill
        # the interpreter: pid 1 itself, or as root the only child of bwrap's reaper
        self.pid, self.pid1 = (pid if self.uid is None else child(pid)) if pid else None, pid
        self.python = self.pidfd if self.pid == pid else os.pidfd_open(self.pid) if self.pid else None
        if not ready:
            self.fail()

    def launch(self, isolated, theirs):
        """Open the pipes, the output files and (as root) the memory cgroup, and start the sandbox's
        process; returns the read end of bwrap's --info-fd. Whatever it opened is in self or theirs."""
        self.cells = self.replies = self.out = self.err = self.cgroup = self.pidfd = self.python = self.pid = None
        self.pid1 = None
        cells, self.cells = os.pipe()
        theirs.append(cells)
        self.replies, replies = os.pipe()
        theirs.append(replies)
        info, info_w = os.pipe()
        theirs += [info, info_w]
        os.set_blocking(self.cells, False)
        self.out, self.err = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # ours, read bounded
        for f in (self.out, self.err):  # appended to, so that truncating them between cells restarts them
            fcntl.fcntl(f, fcntl.F_SETFL, fcntl.fcntl(f, fcntl.F_GETFL) | os.O_APPEND)
        self.cgroup = memory_cgroup(self.limits.memory) if isolated else None
        seccomp = seccomp_pipe() if isolated else None
        theirs += [seccomp] if seccomp is not None else []
        line = command(self.limits, self.uid, replies, info_w, seccomp)
        if self.cgroup:  # bwrap enters the cgroup before it forks: sh moves itself there, then becomes bwrap
            line = ["sh", "-c", 'echo 0 > "$0/cgroup.procs" && exec "$@"', self.cgroup, *line]
        # bwrap too starts with the sandbox's variables
        self.proc = subprocess.Popen(line, cwd=self.scratch, env=environment(self.scratch or "/tmp"),
                                     stdin=cells, stdout=self.out, stderr=self.err, start_new_session=True,
                                     preexec_fn=new_session_keyring if isolated else None,
                                     pass_fds=[fd for fd in (replies, isolated and info_w, seccomp) if fd])
        theirs.remove(info)  # read by start
        return info

    def fail(self):
        why = " ".join(os.pread(self.err.fileno(), 400, 0).decode(errors="replace").split())
        self.stop()
        raise RuntimeError(f"the sandboxed interpreter did not start: {why or f'no answer in {START_TIME:g} s'}" + (
            FIX if why.startswith("bwrap") else ""))

    def run(self, code):
        """Run one cell; returns its Result."""
        if self.proc is None:
            self.start()
        for f in (self.out, self.err):
            os.ftruncate(f.fileno(), 0)
        nonce, ooms = secrets.token_hex(16), self.cgroup and oom_kills(self.cgroup)
        self.signal(signal.SIGCONT)
        deadline, waited, cpu = time.monotonic() + self.limits.wall, run_delay(self.pid), self.cpu_seconds()
        try:  # one line: JSON escapes the newlines
            sent = write_all(self.cells, json.dumps(dict(code=code, nonce=nonce)).encode() + b"\n", deadline)
            line = read_line(self.replies, deadline) if sent else None
        except BrokenPipeError:
            line = b""
        # read before a kill at the wall clock ends the processes
        waited, cpu = max(run_delay(self.pid) - waited, 0.0), max(self.cpu_seconds() - cpu, 0.0)
        stdout, stderr = self.head(self.out), self.head(self.err)
        reply = self.check(line, nonce, deadline)
        if not reply.get("limit") and self.cgroup and oom_kills(self.cgroup) > ooms:
            reply["limit"] = "memory"  # the kernel killed one of its processes (or it) for the cgroup's limit
        if "exit" not in reply and not self.freeze():
            reply.update(error="the sandbox could not be stopped between cells: it was killed", exit=-signal.SIGKILL)
        if "exit" in reply:  # the interpreter ended, or was ended: the whole sandbox is gone
            self.stop()
        result = Result(stdout, stderr, reply["error"], reply.get("limit"), reply.get("exit"), waited, cpu)
        if result.limit:
            result.error = describe(result.limit, self.limits) + (
                "" if result.exit is None else "; the interpreter restarted: its variables and files are gone")
        return result

    def check(self, line, nonce, deadline):
        """The cell's reply: the interpreter's when it carries the cell's nonce; else how it ended."""
        if line is None:
            return dict(error="", limit="wall", exit=-signal.SIGKILL)
        with contextlib.suppress(ValueError, AttributeError):  # not JSON, not an object
            if (reply := json.loads(line)).get("nonce") == nonce and reply.keys() == {"nonce", "error", "limit"} \
                    and isinstance(reply["error"], (str, type(None))) and reply["limit"] in REPLIED:
                return reply
        if line:  # not the interpreter's (or not as it writes them): the cell wrote on the pipe, and may be running on
            return dict(error="the cell wrote on the sandbox's reply pipe: the sandbox was killed",
                        exit=-signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):  # the pipe's end: the interpreter ended, and bwrap follows
            self.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        code = self.proc.returncode if self.proc.returncode is not None else -signal.SIGKILL
        # bwrap tells a signal N as 128 + N (so an exit status above 128 reads as a signal, as in a shell)
        code = 128 - code if self.pidfd is not None and code > 128 else code
        return dict(error=f"the interpreter ended (exit status {code})", exit=code,
                    limit="cpu" if code == -signal.SIGXCPU else None)

    def freeze(self):
        """Stop the sandbox until the next cell, from outside: the interpreter stopped (SIGSTOP, every thread
        of it in state T) and every other process of the sandbox killed. The interpreter kills them itself
        after each cell, but a thread of the cell's can fork after that, and the new process would run on
        between cells, and could wake the interpreter (SIGCONT). False when it did not hold within 5 s (a
        thread waiting for a CPU on a loaded machine stops when it next runs)."""
        if self.python is None:  # unisolated: nothing to stop it with (its warning says so)
            return True
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            self.signal(signal.SIGSTOP)
            others = [p for p in tree(self.pid1) if p not in (self.pid1, self.pid)]
            for p in others:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            if not others and stopped(self.pid):
                return True
            time.sleep(0.01)
        return False

    def cpu_seconds(self):
        return cpu_seconds(self.pid1) if self.pid1 else 0.0

    def signal(self, number):
        """Send the interpreter a signal (from outside its namespace: SIGSTOP and SIGCONT hold on a pid 1)."""
        if self.python is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.python, number)

    def head(self, f):
        data = os.pread(f.fileno(), self.limits.output + 1, 0)
        return data[:self.limits.output].decode(errors="replace") + (" [cut]" if len(data) > self.limits.output else "")

    def stop(self):
        """SIGKILL the sandbox's pid 1 and wait for it: it exits once the kernel has killed and reaped
        every other process of its namespace; bwrap then exits. Unisolated, the process group."""
        if self.proc is None:
            return
        if self.pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            select.select([self.pidfd], [], [], 10)  # readable when it has exited
            for fd in {self.pidfd, self.python} - {None}:
                os.close(fd)
            self.pidfd = self.python = self.pid = self.pid1 = None
        else:  # the group outlives its leader while a member is left: its id is not reused meanwhile
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.release()
        self.proc = None

    def release(self, fds=()):
        """Close fds, our pipes' ends and the output files, and remove the cgroup (empty once its last
        process is reaped): what start opened, after the sandbox, or after a start that failed."""
        for fd in (*fds, self.cells, self.replies):
            if fd is not None:
                os.close(fd)
        for f in (self.out, self.err):
            if f is not None:
                f.close()
        for _ in range(100) if self.cgroup else ():
            with contextlib.suppress(OSError):
                os.rmdir(self.cgroup)
                break
            time.sleep(0.01)
        self.cells = self.replies = self.out = self.err = self.cgroup = None

    def close(self):
        self.stop()
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


REPLIED = (None, "memory", "file size", "processes", "open files", "disk")  # the limits the interpreter reports


def describe(limit, limits):
    return {"cpu": f"the code ran past {limits.cpu} s of CPU", "wall": f"the code ran past {limits.wall:g} s",
            "memory": f"the code ran out of its {limits.memory >> 20} MiB of memory",
            "disk": f"the code filled its {limits.disk >> 20} MiB of /tmp or /dev/shm",
            "file size": f"a file or the output grew past {limits.file_size >> 20} MiB",
            "processes": f"the code reached its limit of {limits.processes} processes",
            "open files": f"the code reached its limit of {limits.open_files} open files"}[limit]


def run(code, limits=None):
    """Run code once in a fresh sandbox; returns its Result."""
    with Interpreter(limits) as py:
        return py.run(code)


def probe(limits=None):
    """Run print(1) in a fresh sandbox (~0.1 s): None where it prints 1, else a RuntimeError of one line
    that names the fix, so that a worker that will run the policy's code can fail at its start."""
    result = run("print(1)", limits)  # a sandbox that cannot start raises its own line (start, fail)
    if result.error or result.stdout != "1\n":
        said = " ".join(f"{result.error or ''} {result.stderr or result.stdout!r}".split())[:400]
        raise RuntimeError(f"the sandbox started, but print(1) answered {said}" + FIX)
