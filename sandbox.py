"""Run Python that the policy writes in a sandboxed process, and the environment that does.

    sandbox.run("print(2 ** 10)", sandbox.Limits(cpu=5, wall=10)).stdout    # one shot: "1024\n"
    with sandbox.Interpreter() as py:                                       # one per episode
        py.run("x = 41"); py.run("print(x + 1)")                           # variables last
    --environment sandbox:PythonTool                                        # the policy's tool

What holds, and by what (tests/test_sandbox.py checks each, and fails without it):
- Limits per cell: CPU seconds (RLIMIT_CPU: SIGXCPU), wall-clock seconds (we wait that long for
  the answer, then kill the sandbox; the next cell starts an empty interpreter). Per process:
  memory (RLIMIT_AS: MemoryError), file size (RLIMIT_FSIZE: EFBIG, stdout and stderr too), open
  files (RLIMIT_NOFILE). Processes and threads: RLIMIT_NPROC, which counts per uid and does not
  hold for root, so as root the code runs as a uid of its own (setpriv: unique among live
  sandboxes, no groups, no new privileges), which also keeps it out of the trainer's files and
  the other sandboxes. Not root, it runs as our user, and the limit is set above our own count.
- Namespaces (unshare: as root or with user namespaces, found once): a network of one loopback,
  down, so no connection goes anywhere; a pid namespace with its own /proc, so the trainer's
  processes are not seen, orphans are reaped, and killing its first process kills them all,
  those that left the process group too. Where unshare cannot, a warning says so: the code has
  the network, and only the process group (and, as root, the uid) is killed.
- Environment: PATH, HOME and TMPDIR (the scratch directory), LANG, thread counts; nothing of
  the trainer's (no HF_TOKEN, no WANDB_API_KEY). A scratch directory per Interpreter, removed by
  close(). The uid must be able to read sys.executable and its libraries.
Not enforced: the memory and disk of a sandbox's processes together (a memory cgroup and a disk
quota would), writes to world-writable /tmp and /dev/shm, system calls (no seccomp). The kernel
is shared: this contains a model's mistakes and accidents, not a determined attacker.
"""

import contextlib
import dataclasses
import fcntl
import functools
import inspect
import json
import os
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings

from environments import ToolError

UIDS = 2_000_000_000  # the sandboxes' uids, as root: UIDS + a random offset below 2**24, no user's


@dataclasses.dataclass
class Limits:
    cpu: int = 5  # CPU seconds per cell (all its threads)
    wall: float = 10.0  # seconds per cell, by the clock
    memory: int = 1 << 30  # bytes of address space per process
    file_size: int = 16 << 20  # bytes per file written, stdout and stderr included
    processes: int = 32  # processes and threads of the sandbox, itself included
    open_files: int = 64  # per process
    output: int = 4096  # bytes of stdout and of stderr kept per cell


@dataclasses.dataclass
class Result:
    stdout: str  # cut to Limits.output bytes (" [cut]" marks a cut)
    stderr: str  # a failed cell's traceback is here
    error: str | None = None  # what went wrong, in words; None when the cell ran through
    limit: str | None = None  # the limit that fired: cpu, wall, memory, file size, processes, open files
    exit: int | None = None  # the interpreter's exit status (-N: signal N) when it ended; the next cell starts afresh


@functools.cache
def namespaces():
    """The unshare flags that isolate a sandbox here, or [] where unshare cannot."""
    flags = ["--net", "--pid", "--fork", "--kill-child", "--mount-proc"]
    flags = flags if os.geteuid() == 0 else ["--user", "--map-root-user", *flags]
    if shutil.which("unshare") and subprocess.run(["unshare", *flags, "true"], capture_output=True).returncode == 0:
        return flags
    warnings.warn("sandbox: unshare cannot make namespaces here (neither root nor user namespaces): the code has "
                  "the network, and a process that leaves its group outlives a kill", stacklevel=2)
    return []


def processes_of(uid):
    """{pid: its number of threads} of the processes whose real uid is uid."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                status = dict(line.split(":", 1) for line in f)
        except OSError:
            continue  # gone meanwhile
        if status["Uid"].split()[0] == str(uid):
            found[int(pid)] = int(status["Threads"])
    return found


def scratch_dir():
    """A new scratch directory, and the uid the code runs as: as root, a uid of its own, which
    the directory's name claims (mkdir is atomic across processes) and which owns it; else None."""
    if os.geteuid() != 0:
        return tempfile.mkdtemp(prefix="sandbox-"), None
    while True:
        uid = UIDS + random.randrange(1 << 24)
        path = os.path.join(tempfile.gettempdir(), f"sandbox-{uid}")
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        os.chown(path, uid, uid)
        return path, uid


def command(limits, uid, reply_fd):
    """The sandbox's command line: each program sets up one thing and executes the next."""
    # RLIMIT_NPROC counts the threads of every process of the uid: without a uid of its own, ours too
    processes = limits.processes + (0 if uid is not None else sum(processes_of(os.getuid()).values()))
    isolate = namespaces()
    return ["setpriv", "--pdeathsig", "KILL", "--",  # gone with the process that started it (a tool worker)
            *(["unshare", *isolate, "--"] if isolate else []),
            "prlimit", f"--cpu={limits.cpu}:",  # the first cell's: the interpreter moves it on at each cell
            f"--as={limits.memory}", f"--fsize={limits.file_size}", f"--nproc={processes}",
            f"--nofile={limits.open_files}", "--core=0", "--",
            *(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs", "--"]
              if uid is not None else []),
            sys.executable, "-I", "-u", "-c", f"{inspect.getsource(child)}\nchild({reply_fd}, {limits.cpu})\n"]


def child(reply_fd, cpu):
    """The sandbox's first process (its source runs alone there): pid 1 of the namespace, which
    reaps orphans and tells how the interpreter ended; and, forked from it, the interpreter, which
    runs each line of stdin (a JSON string) as a cell in one namespace and answers on reply_fd."""
    import contextlib, errno, json, math, os, resource, signal, traceback  # noqa: E401 - the whole program

    def answer(**reply):
        os.write(reply_fd, (json.dumps(reply) + "\n").encode())

    def reap():  # the cells' ended children: zombies count as processes
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass

    if interpreter := os.fork():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # pid 1 takes no signal from the sandbox's processes
        while (ended := os.wait())[0] != interpreter:
            pass
        code = os.waitstatus_to_exitcode(ended[1])
        return answer(error=f"the interpreter ended (exit status {code})", exit=code,
                      limit="cpu" if code == -signal.SIGXCPU else None)
    cells, null = os.fdopen(os.dup(0), "rb"), os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # input() in a cell ends at once: it cannot eat the next cell
    os.close(null)
    namespace, me = {"__name__": "__main__"}, os.getpid()
    answer(ready=True)
    for line in cells:
        reap()
        used = resource.getrusage(resource.RUSAGE_SELF)  # the CPU limit counts from the cell's start
        soft, hard = math.ceil(used.ru_utime + used.ru_stime) + cpu, resource.getrlimit(resource.RLIMIT_CPU)[1]
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
        error = limit = None
        try:
            exec(compile(json.loads(line), "<cell>", "exec"), namespace)
        except Exception as e:  # noqa: BLE001 - the cell's failure, told to the policy
            if os.getpid() == me:
                traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # from the cell's frame on
                error, limit = f"{type(e).__name__}: {e}", "memory" if isinstance(e, MemoryError) else {
                    errno.EFBIG: "file size", errno.EAGAIN: "processes", errno.EMFILE: "open files"}.get(
                    getattr(e, "errno", None))
        if os.getpid() != me:
            os._exit(0)  # a process forked by the cell ran off its end: it must not answer
        reap()
        answer(error=error, limit=limit)


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
    its CPU, an exit) says so, and the next cell starts an empty interpreter in the same scratch
    directory. close() ends the process and removes the directory."""

    def __init__(self, limits=None):
        self.limits = limits or Limits()
        self.scratch, self.uid = scratch_dir()
        self.proc = None

    def start(self):
        (cells, self.cells), (self.replies, replies) = os.pipe(), os.pipe()
        os.set_blocking(self.cells, False)
        self.out, self.err = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # ours, read bounded
        for f in (self.out, self.err):  # appended to, so that truncating them between cells restarts them
            fcntl.fcntl(f, fcntl.F_SETFL, fcntl.fcntl(f, fcntl.F_GETFL) | os.O_APPEND)
        env = dict(PATH=f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin", HOME=self.scratch,
                   TMPDIR=self.scratch, LANG="C.UTF-8",  # and a thread per core would count as processes:
                   OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        try:
            self.proc = subprocess.Popen(command(self.limits, self.uid, replies), cwd=self.scratch, env=env,
                                         stdin=cells, stdout=self.out, stderr=self.err, pass_fds=(replies,),
                                         start_new_session=True)
        except FileNotFoundError as e:
            raise RuntimeError(f"the sandbox needs {e.filename!r}: install util-linux (setpriv, prlimit, "
                               "unshare)") from None
        finally:
            for fd in (cells, replies):
                os.close(fd)
        if read_line(self.replies, time.monotonic() + 30) != b'{"ready": true}':
            why = os.pread(self.err.fileno(), 300, 0).decode(errors="replace").strip() or "no message"
            self.stop()
            raise RuntimeError(f"the sandboxed interpreter did not start: {why}")

    def run(self, code):
        """Run one cell; returns its Result."""
        if self.proc is None:
            self.start()
        for f in (self.out, self.err):
            os.ftruncate(f.fileno(), 0)
        deadline = time.monotonic() + self.limits.wall
        try:  # one line: JSON escapes the newlines
            sent = write_all(self.cells, json.dumps(code).encode() + b"\n", deadline)
            line = read_line(self.replies, deadline) if sent else None
        except BrokenPipeError:
            line = b""
        try:
            reply = dict(error="", limit="wall", exit=-signal.SIGKILL) if line is None else json.loads(line)
        except ValueError:  # no answer: killed from outside, or a cell wrote on the pipe
            reply = dict(error="the interpreter died", exit=-signal.SIGKILL)
        result = Result(self.head(self.out), self.head(self.err), reply["error"], reply.get("limit"), reply.get("exit"))
        if "exit" in reply:  # the interpreter ended, or is to be ended: the whole sandbox goes
            self.stop()
        if result.limit:
            result.error = describe(result.limit, self.limits) + (
                "" if result.exit is None else "; the interpreter restarted: its variables are gone")
        return result

    def head(self, f):
        data = os.pread(f.fileno(), self.limits.output + 1, 0)
        return data[:self.limits.output].decode(errors="replace") + (" [cut]" if len(data) > self.limits.output else "")

    def stop(self):
        """SIGKILL the sandbox. With namespaces, its first process: the kernel kills the rest, and
        unshare reaps it and exits (killed first, unshare would leave it a zombie). Without, or if
        unshare does not exit, the process group, while its leader is not yet reaped."""
        if self.proc is None:
            return
        if namespaces():
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                for pid in f.read().split():
                    os.kill(int(pid), signal.SIGKILL)
        else:  # the group, then (as root) those of its uid that left the group
            os.killpg(self.proc.pid, signal.SIGKILL)
            for pid in processes_of(self.uid) if self.uid is not None else ():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        os.close(self.cells)
        os.close(self.replies)
        self.out.close()
        self.err.close()
        self.proc = None

    def close(self):
        self.stop()
        shutil.rmtree(self.scratch, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def describe(limit, limits):
    return {"cpu": f"the code ran past {limits.cpu} s of CPU", "wall": f"the code ran past {limits.wall:g} s",
            "memory": f"the code ran out of its {limits.memory >> 20} MiB of memory",
            "file size": f"a file or the output grew past {limits.file_size >> 20} MiB",
            "processes": f"the code reached its limit of {limits.processes} processes",
            "open files": f"the code reached its limit of {limits.open_files} open files"}[limit]


def run(code, limits=None):
    """Run code once in a fresh sandbox; returns its Result."""
    with Interpreter(limits) as py:
        return py.run(code)


# --- the environment: a Python tool


class PythonTool:
    """The policy writes <python>code</python>; the code runs in the episode's Interpreter and
    what it printed comes back as a tool message. A turn without code ends the episode. The code's
    exception or a limit is the policy's mistake: told as "error: ..." and counted (tool_bad_calls).
    Keep tool_timeout above limits.wall, so that a slow cell is the sandbox's to stop."""

    stop = ["</python>"]
    limits = Limits(cpu=5, wall=5.0)
    system = ("You can run Python. Write code between <python> and </python>, for example <python>print(2 ** 10)"
              "</python>; what it prints is shown to you. Variables are kept from one call to the next. "
              "Give the final answer as \\boxed{answer}.")

    def __init__(self):
        self.interpreter = None  # started by the first call: the trainer's probe instance never runs code

    def reset(self, row):
        prompt = row["prompt"]
        question = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        return [{"role": "system", "content": self.system}, {"role": "user", "content": question}]

    def step(self, row, messages):
        call = re.search(r"<python>(.*?)</python>", messages[-1]["content"], re.S)
        if call is None:
            return []
        self.interpreter = self.interpreter or Interpreter(self.limits)
        result = self.interpreter.run(call.group(1))
        output = (result.stdout + result.stderr).strip()
        if result.error:
            raise ToolError(f"{result.error}\n{output}".strip())
        return [{"role": "tool", "content": output}]

    def close(self):
        if self.interpreter:
            self.interpreter.close()
