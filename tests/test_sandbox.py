"""The sandbox (envs/sandbox.py): each limit fires on the code that needs it, ends as a counted error
with the interpreter (or the next one) working, and leaves no process behind; the attacks of a
hostile review fail (files, network, /tmp and /dev/shm, an owner killed mid-cell, a forged reply,
processes after the cell, memory of several processes; the kernel's doors: bwrap's environment,
ptrace, keys, nested user namespaces, writes to / and /dev), as root and, in scripts, as a user;
probe(); and the PythonTool environment through the trainer's episodes."""

import ast
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from config import Config
from envs import sandbox, sandbox_process
from envs.environment import Environment
from envs.python_tool import PythonTool
from envs.sandbox import Interpreter, Limits, Result
from helpers import ScriptedClient, with_prompts

pytestmark = pytest.mark.subprocess  # every test here starts sandboxed processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a checkout in /tmp (a venv there): the interpreter's own directories are bound, read-only, into the sandbox's
# /tmp; a cell lists what else is there
OWN = {p.split("/")[2] for p in sandbox_process.python_dirs() if p.startswith("/tmp/")}
TMP = f"sorted(set(os.listdir('/tmp')).difference(({''.join(repr(d) + ', ' for d in sorted(OWN))})))"  # no braces:
# the tiny model's tokenizer, which writes PythonTool's cells below, has none
QUICK = Limits(cpu=1, wall=30.0)  # a CPU limit of 1 s comes well before the wall clock, even on a busy machine


def tree(pid):
    """pid and its descendants, from /proc."""
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as f:
            children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


def alive(pids, wait=10.0):
    """Those of pids still running (zombies are not) after up to `wait` seconds."""
    def running():
        left = []
        for pid in pids:
            with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
                left += [pid] if f.read().rsplit(")", 1)[1].split()[0] not in "ZX" else []
        return left
    deadline = time.monotonic() + wait
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    return running()


def marked(marker, where="cmdline"):
    """The running processes whose command line holds marker (or whose environment holds it as a variable)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/{where}", "rb") as f:
            data = f.read()
            found += [int(pid)] if marker.encode() in (data.split(b"\0") if where == "environ" else data) else []
    return alive(found, wait=0)


def bwraps(variable):
    """The running bwrap processes (a sandbox's outer two) whose environment holds variable."""
    found = []
    for pid in marked(variable, "environ"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/comm") as f:
            found += [pid] if f.read().strip() == "bwrap" else []
    return found


@contextlib.contextmanager
def checked(limits):
    """A started interpreter; at the end, closed, with nothing of it left: no process, no cgroup."""
    interpreter = Interpreter(limits)
    interpreter.start()
    pids, cgroup = tree(interpreter.proc.pid), interpreter.cgroup
    try:
        yield interpreter
    finally:
        pids += tree(interpreter.proc.pid) if interpreter.proc else []
        interpreter.close()
    assert alive(pids) == [] and not (cgroup and os.path.exists(cgroup))


@pytest.fixture
def py():
    with checked(QUICK) as interpreter:
        yield interpreter


@pytest.fixture
def host_dir():
    """A world-readable directory on the host, as a dataset's or a run's output directory is."""
    path = tempfile.mkdtemp(prefix="sandbox-test-")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path)


def test_a_one_shot_run_answers_in_its_own_root(monkeypatch):
    result = sandbox.run("import os\nprint(2 ** 10, os.getcwd(), os.getuid(), sorted(os.listdir('/')))")
    assert result.error is None and result.stdout.split()[:2] == ["1024", "/tmp"]
    assert int(result.stdout.split()[2]) != 0  # never root, in any namespace
    assert "'etc'" not in result.stdout and "'home'" not in result.stdout


def test_variables_last_between_cells_of_one_interpreter_and_not_between_two(py):
    assert py.run("x = 41").error is None
    assert py.run("print(x + 1)").stdout == "42\n"
    with Interpreter(QUICK) as other:
        assert other.run("print(x)").error == "NameError: name 'x' is not defined"
    result = py.run("1 / 0")
    assert result.error == "ZeroDivisionError: division by zero" and result.stderr.endswith(
        "ZeroDivisionError: division by zero\n") and result.exit is None
    assert py.run("print(x)").stdout == "41\n"  # an exception leaves the interpreter as it was


def test_an_infinite_loop_is_stopped_by_the_cpu_limit(py):
    py.run("x = 1")
    pids = tree(py.proc.pid)
    result = py.run("while True: pass")
    assert result.limit == "cpu" and result.exit == -signal.SIGXCPU and "1 s of CPU" in result.error
    assert alive(pids) == []  # the sandbox went with it
    assert py.run("print(globals().get('x'))").stdout == "None\n"  # restarted, empty


def test_the_wall_clock_kills_the_whole_tree_and_restarts_the_interpreter_empty():
    with checked(Limits(wall=4.0)) as py:
        py.run("x = 1\nopen('/tmp/note', 'w').close()")
        pids, t = tree(py.proc.pid), time.monotonic()
        sleep = f"1000.{os.getpid()}"  # a command line of this test's own
        result = py.run(f"import subprocess, time\nsubprocess.Popen(['sleep', '{sleep}'], start_new_session=True)\n"
                        "print('started')\ntime.sleep(1000)")
        assert time.monotonic() - t < 4.0 + 10
        assert result.limit == "wall" and result.stdout == "started\n"
        assert "variables and files are gone" in result.error
        assert alive(pids + marked(f"sleep\0{sleep}")) == []  # the sleep in its own session went too
        assert py.run(f"import os\nprint(globals().get('x'), {TMP})").stdout == "None []\n"


def test_a_fork_bomb_is_bounded_by_the_process_limit(py):
    # the processes a cell can hold at once: the sandbox's, less the interpreter (and bwrap's pid 1)
    held = py.run("import os, time\npids = []\ntry:\n    while True:\n        if (pid := os.fork()) == 0:\n"
                  "            time.sleep(60)\n            os._exit(0)\n        pids.append(pid)\n"
                  "finally:\n    print(len(pids))")
    assert held.limit == "processes" and held.exit is None
    assert QUICK.processes - 3 <= int(held.stdout) < QUICK.processes  # the limit is the sandbox's own
    bomb = py.run("while True: os.fork()")
    assert bomb.limit == "processes" and "limit of 32 processes" in bomb.error and bomb.exit is None
    assert py.run("print(len(pids))").stdout == held.stdout  # the interpreter lived through it all


def test_processes_a_cell_started_do_not_outlive_it():
    burn = f"['sh', '-c', 'while :; do :; done', 'burner-{os.getpid()}']"  # $0 names it: burner-PID
    with checked(Limits(cpu=30, wall=30.0)) as py:  # CPU enough to burn on past the 10 s that alive() waits
        result = py.run(f"import subprocess\nfor _ in range(2):\n    subprocess.Popen({burn})\n"
                        f"subprocess.Popen({burn}, start_new_session=True)\nprint('started')")
        assert result.stdout == "started\n" and result.error is None, result
        assert alive(marked(f"burner-{os.getpid()}")) == []  # killed when the cell returned, not at the wall clock
        assert py.run("print(1)").stdout == "1\n"


def test_a_memory_hog_fails_and_the_trainer_is_fine(py):
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    py.run("x = 1")
    result = py.run("hog = bytearray(4 << 30)")
    assert result.limit == "memory" and "MemoryError" in result.stderr and result.exit is None
    assert py.run("print(x)").stdout == "1\n"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB: the trainer did not grow


def test_the_memory_of_several_processes_together_is_bounded_where_a_cgroup_can_be_made():
    limits = Limits(cpu=5, wall=60.0, memory=256 << 20)
    if (probe := sandbox_process.memory_cgroup(1 << 30)) is None:
        pytest.skip("no memory cgroup can be made here (not root, or cgroup v2 without memory delegated): "
                    "memory is limited per process only")
    os.rmdir(probe)
    with checked(limits) as py:
        # four processes of 150 MiB each, under an address-space limit of 256 MiB per process: each
        # fits alone; together they hold 600 MiB unless the sandbox's memory is limited as a whole
        result = py.run("import os\nready, go = os.pipe(), os.pipe()\npids = []\nfor _ in range(4):\n"
                        "    if (pid := os.fork()) == 0:\n        os.close(ready[0])\n"
                        "        hold = bytearray(b'x') * (150 << 20)\n        os.write(ready[1], b'1')\n"
                        "        os.close(ready[1])\n        os.close(go[1])\n        os.read(go[0], 1)\n        os._exit(0)\n"
                        "    pids.append(pid)\n"
                        "os.close(ready[1])\nwhile os.read(ready[0], 1):\n    pass\n"  # each allocated, or died
                        "print(sum(os.waitpid(pid, os.WNOHANG) == (0, 0) for pid in pids))\nos.close(go[1])")
        assert int(result.stdout) <= 1 and result.limit == "memory", result
        assert py.run("print(2)").stdout == "2\n"


def test_a_1gb_file_write_stops_at_the_file_size_limit(py):
    result = py.run("with open('big', 'wb') as f:\n    for _ in range(1024):\n        f.write(b'x' * (1 << 20))")
    assert result.limit == "file size" and "File too large" in result.stderr
    assert py.run("import os\nprint(os.path.getsize('big'))").stdout == f"{QUICK.file_size}\n"
    # printing a gigabyte: the output file stops at the same limit, and the trainer reads a bounded head
    printed = py.run("for _ in range(1024):\n    print('y' * (1 << 20))")
    assert printed.limit == "file size" and printed.stdout == "y" * QUICK.output + " [cut]"


def test_many_files_stop_at_the_disk_limit_in_tmp_and_in_dev_shm(py):
    fill = "import os\nfor i in range(64):\n    with open(f'{}/f{{i}}', 'wb') as f:\n        f.write(b'x' * (8 << 20))"
    for where in (".", "/dev/shm"):  # 512 MiB in files of 8 MiB, under the file size limit; the cwd is /tmp
        result = py.run(fill.format(where))
        assert result.limit == "disk" and "No space left" in result.stderr and result.exit is None, result
    assert int(py.run("import shutil\nprint(shutil.disk_usage('/tmp').total)").stdout) <= QUICK.disk


def test_open_files_are_limited(py):
    result = py.run("files = [open('/dev/null') for _ in range(1000)]")
    assert result.limit == "open files" and result.exit is None


def test_the_code_cannot_read_the_trainers_environment(py, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_sandbox_test")
    result = py.run(f"import os\nprint(dict(os.environ))\ntry:\n    print(open('/proc/{os.getpid()}/environ').read())\n"
                    "except OSError as e:\n    print(type(e).__name__)")
    assert result.error is None and "hf_secret_sandbox_test" not in result.stdout, result.stdout
    assert "HF_TOKEN" not in result.stdout and "'HOME': '/tmp'" in result.stdout
    assert result.stdout.rstrip().endswith(("PermissionError", "FileNotFoundError"))


READ = ("for path in {!r}:\n    try:\n        open(path).read()\n        print('read', path)\n"
        "    except OSError:\n        pass")


def test_the_code_reads_no_dataset_checkout_output_or_token_and_writes_nowhere_outside(py, host_dir):
    answers, samples, token = (os.path.join(host_dir, name) for name in ("answers.jsonl", "samples.jsonl", "token"))
    for path in (answers, samples, token):
        with open(path, "w") as f:
            f.write('{"answer": 42}\n')
    os.chmod(token, 0o600)  # the trainer's own, as a HF token file is
    secrets = [answers, samples, token, os.path.join(ROOT, "envs", "sandbox.py"), os.path.join(ROOT, "pyproject.toml"),
               "/etc/passwd", "/etc/hostname", os.path.expanduser("~/.bashrc")]
    result = py.run(READ.format(secrets))
    assert result.error is None and result.stdout == "", result.stdout
    wrote = py.run(f"for d in {[host_dir, ROOT, sys.prefix]!r}:\n    try:\n        open(d + '/sandbox-wrote', 'w')\n"
                   "        print('wrote', d)\n    except OSError:\n        pass")
    assert wrote.stdout == "" and not any(os.path.exists(d + "/sandbox-wrote") for d in (host_dir, ROOT, sys.prefix))


def test_tmp_and_dev_shm_are_the_sandboxs_own_and_die_with_it(py):
    mine = f"episode-{os.getpid()}"  # a name of this test's own
    host_file = tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="weights-")  # as weight sync writes there
    os.chmod(host_file.name, 0o644)
    host_tmp = tempfile.NamedTemporaryFile(prefix="host-")
    os.chmod(host_tmp.name, 0o644)
    with host_file, host_tmp:
        seen = py.run(f"import os\nprint({TMP}, os.listdir('/dev/shm'))\n" + READ.format(
            [host_file.name, host_tmp.name]) + f"\nfor p in ('/tmp/{mine}', '/dev/shm/{mine}'):\n"
                                               "    open(p, 'w').write('a')")
        assert seen.stdout == "[] []\n" and seen.error is None, seen
    assert not os.path.exists(f"/tmp/{mine}") and not os.path.exists(f"/dev/shm/{mine}")
    with Interpreter(QUICK) as other:  # the next episode
        assert other.run(f"import os\nprint({TMP}, os.listdir('/dev/shm'))").stdout == "[] []\n"


def test_a_socket_cannot_reach_a_port_the_trainer_listens_on(py):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        result = py.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)")
        assert result.error and result.error.startswith(("OSError", "ConnectionRefusedError")), result  # its own lo
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing came


def test_a_forged_reply_kills_the_sandbox_and_answers_the_cell_as_an_error(py):
    py.run("x = 1")
    pids = tree(py.proc.pid)
    forged = py.run("import os, time\nfor fd in range(3, 64):\n    try:\n"
                    "        os.write(fd, b'{\"error\": null, \"limit\": null}\\n')\n    except OSError:\n        pass\n"
                    "time.sleep(20)")  # past the reply: a forged reply would have bought it time
    assert forged.error and "reply pipe" in forged.error and forged.exit == -signal.SIGKILL, forged
    assert alive(pids) == []
    assert py.run("print(globals().get('x'))").stdout == "None\n"  # the next cell gets its own reply


# a process that starts a sandbox whose cell runs `sleep SECONDS` (a command line of the test's own) and waits
OWNER = """import sys
from envs import sandbox
py = sandbox.Interpreter(sandbox.Limits(wall=300))
py.run(f"import subprocess, time\\nsubprocess.Popen(['sleep', '{sys.argv[1]}'], start_new_session=True)\\ntime.sleep(999)")
"""


def test_a_sandbox_dies_with_its_owner_killed_mid_cell():
    seconds = f"4321.{os.getpid()}"
    owner = subprocess.Popen([sys.executable, "-c", OWNER, seconds], cwd=ROOT)
    deadline = time.monotonic() + 30
    while not marked(f"sleep\0{seconds}") and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = tree(owner.pid)
    assert len(pids) > 2, "the owner's sandbox did not start"
    owner.kill()
    owner.wait()
    assert alive(pids) == []


# The attacks again as a user: a script that runs as uid 65534 with a Python that user can read,
# the trainer's files being that user's own (a 0600 token, a checkout it may write).
AS_USER = r"""
import json, os, socket, subprocess, sys, time
from envs import sandbox


def running(marker, until):  # the pids whose command line holds marker, polled until some are or none are
    deadline = time.monotonic() + 30
    while True:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f, open(f"/proc/{pid}/stat") as s:
                    zombie = s.read().rsplit(")", 1)[1].split()[0] == "Z"
                    found += [pid] if marker.encode() in f.read() and not zombie else []
            except OSError:
                pass
        if bool(found) == (until == "some") or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


here, out = os.getcwd(), {}
sleep, owners_sleep = f"4322.{os.getpid()}", f"4323.{os.getpid()}"  # command lines of this run's own
with sandbox.Interpreter(sandbox.Limits(cpu=2, wall=30.0)) as py, socket.socket() as listener:
    out["uid"] = py.run("import os\nprint(os.getuid())").stdout.strip()
    py.run("import resource, threading\nthreading.Thread(target=lambda: [None for _ in iter(int, 1)], daemon=True).start()")
    used = [float(py.run("print(resource.getrusage(resource.RUSAGE_SELF).ru_utime)").stdout) for _ in range(2)
            if not time.sleep(1.5)]  # the interpreter, pid 1 here, is stopped between cells, its thread with it
    out["between"] = used[1] - used[0]
    out["read"] = py.run(f"for p in ['token', 'answers.jsonl', 'checkout/train.py']:\n    try:\n"
                         f"        print(open(os.path.join({here!r}, p)).read())\n    except OSError:\n        pass").stdout
    out["wrote"] = py.run(f"open({here!r} + '/checkout/x', 'w')").error
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    out["connect"] = py.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)").error
    py.run(f"open('/tmp/{sleep}', 'w').write('a')")
    out["bomb"] = py.run("while True: os.fork()").limit
    out["forged"] = py.run("import time\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'{\"error\": null}\\n')\n"
                           "    except OSError:\n        pass\ntime.sleep(20)").error
    out["child"] = py.run(f"import subprocess\nsubprocess.Popen(['sleep', '{sleep}'])").error
    out["children_left"] = running(f"sleep\0{sleep}", until="none")
out["host_tmp"] = os.path.exists(f"/tmp/{sleep}")
with sandbox.Interpreter() as other:
    out["next_tmp"] = other.run("import os\nprint(os.listdir('/tmp'))").stdout
owner = subprocess.Popen([sys.executable, "-I", "-c", "import sys; sys.path.insert(0, '.')\n" + sys.argv[1], owners_sleep])
out["owner_started"] = running(f"sleep\0{owners_sleep}", until="some")
owner.kill()
owner.wait()
out["orphans"] = running(f"sleep\0{owners_sleep}", until="none")
print(json.dumps(out))
"""


def as_trainer(who, script, host_dir, argv=(), env=None):
    """The last line of stdout (JSON) of script, run from host_dir (given a copy of envs/) as a trainer run by
    root, or by a user (uid 65534 with a Python it can read; where we are not root, ourselves)."""
    python = "/usr/bin/python3"
    if who == "root" and os.geteuid() != 0:
        pytest.skip("runs as root")
    if who == "user" and os.geteuid() == 0 and not (shutil.which("setpriv") and os.access(python, os.X_OK)):
        pytest.skip("needs setpriv (to become uid 65534) and a Python that uid can read at /usr/bin/python3")
    os.makedirs(os.path.join(host_dir, "envs"), exist_ok=True)
    for name in ("__init__.py", "sandbox.py", "sandbox_process.py"):
        shutil.copy(os.path.join(ROOT, "envs", name), os.path.join(host_dir, "envs"))
    become = who == "user" and os.geteuid() == 0
    user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if become else []
    done = subprocess.run([*user, python if user else sys.executable, "-I", "-c",
                           f"import sys; sys.path.insert(0, '.'); sys.argv[1:] = {list(argv)!r}\n{script}"],
                          cwd=host_dir, env=dict(PATH="/usr/bin:/bin", HOME=host_dir, **(env or {})),
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_the_attacks_fail_as_a_user_too(host_dir):
    if os.geteuid() != 0:
        pytest.skip("needs root, to become uid 65534 and own the trainer's files")
    os.mkdir(os.path.join(host_dir, "checkout"))
    for name, mode in (("token", 0o600), ("answers.jsonl", 0o644), ("checkout/train.py", 0o644)):
        with open(os.path.join(host_dir, name), "w") as f:
            f.write("secret\n")
        os.chmod(os.path.join(host_dir, name), mode)
    for path in (host_dir, *(os.path.join(host_dir, p) for p in ("token", "checkout", "checkout/train.py"))):
        os.chown(path, 65534, 65534)  # the trainer's user owns its files
    out = as_trainer("user", AS_USER, host_dir, [OWNER])
    assert out["uid"] == "1000" and out["read"] == "" and out["wrote"].startswith(("PermissionError", "FileNotFound"))
    assert not os.path.exists(os.path.join(host_dir, "checkout/x")), out
    assert out["connect"].startswith(("OSError", "ConnectionRefusedError")) and out["bomb"] == "processes", out
    assert "reply pipe" in out["forged"] and out["child"] is None and out["children_left"] == [], out
    assert not out["host_tmp"] and out["next_tmp"] == "[]\n" and out["owner_started"] and out["orphans"] == [], out
    assert out["between"] < 1.0, out  # 1.5 s between the cells: a thread left running took none of it


# The kernel's doors, tried by a cell of a trainer run by root and by a user: the environment of the sandbox's
# pid 1 (bwrap: the code's own uid in a user namespace, not root), ptrace and another process's memory, the
# keys in the trainer's session keyring, nested user namespaces (in one the code could mount a tmpfs of any
# size), and files in / and /dev (only /tmp and /dev/shm are writable, of Limits.disk each).
KERNEL = r"""
import ctypes, json
from envs import sandbox

libc = ctypes.CDLL(None, use_errno=True)
key = libc.syscall(248, b"user", b"sandbox-test-key", b"hf_secret_key", 13, -3)  # add_key to our session keyring
cell = '''
import ctypes, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
def errno(nr, *args):  # 0 where the call went through
    return 0 if libc.syscall(nr, *args) >= 0 else ctypes.get_errno()
def forked(nr, *args):  # the call in a child that exits at once (a raw clone's own child exits too)
    if (pid := os.fork()) == 0:
        os._exit(errno(nr, *args))
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
try:
    environ = 'hf_secret_env' in open('/proc/1/environ').read()
except OSError as e:
    environ = type(e).__name__
payload = ctypes.create_string_buffer(64)
libc.syscall(250, 11, KEY, payload, 64)  # keyctl(KEYCTL_READ)
wrote = []
for path in ('/x', '/dev/x', '/usr/x', '/dev/null', '/dev/shm/x', '/tmp/x'):
    try:
        open(path, 'w').write('a')
        wrote.append(path)
    except OSError:
        pass
def lift():  # the CPU limit's hard value raised: refused (ValueError), or the limit it reached
    try:
        import resource
        resource.setrlimit(resource.RLIMIT_CPU, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        return 'lifted'
    except ValueError:
        return 'refused'
unbounded = [line.split('  ')[0] for line in open('/proc/1/limits')  # pid 1 is the interpreter, under every limit
             if line.startswith(('Max cpu time', 'Max processes', 'Max address space')) and 'unlimited' in line]
filled, fd = 0, os.open('/tmp/fill', os.O_WRONLY | os.O_CREAT)
try:
    while filled < 64 << 20:
        filled += os.write(fd, bytes(1 << 20))
except OSError:
    pass
print(dict(environ=environ, ptrace_pid1=forked(101, 0x4206, 1, 0, 0),  # PTRACE_SEIZE: it does not stop pid 1
           ptrace_child=forked(101, 0x4206, os.getpid(), 0, 0),  # its parent, the interpreter
           vm_read=errno(310, 1, 0, 0, 0, 0, 0), keyctl=errno(250, 0, -3, 0), payload=payload.value.decode(),
           getfd=errno(438, max(libc.syscall(434, 1, 0), 0), 0, 0),  # pidfd_getfd of pid 1's stdin
           listed='sandbox-test-key' in open('/proc/keys').read(), unshare=forked(272, 0x10000000),
           clone=forked(56, 0x10000000 | 17, 0, 0, 0, 0), clone3=errno(435, 0, 0), x32=errno(0x40000000 | 39),
           unshare_r=subprocess.run(['unshare', '-Ur', 'true'], capture_output=True).returncode,
           wrote=wrote, filled=filled, dev_null=subprocess.run(['sh', '-c', 'echo a > /dev/null']).returncode,
           pid=os.getpid(), uid=os.getuid(), pid1_uid=os.stat('/proc/1').st_uid, unbounded=unbounded, lift=lift(), pdeathsig=errno(157, 1, 0), keep=errno(157, 1, 9),
           memfd=errno(319, b'x', 0), memfd_secret=errno(447, 0), shmget=errno(29, 0, 1 << 20, 0o1600),
           semget=errno(64, 0, 8, 0o1600), msgget=errno(68, 0, 0o1600)))
'''
result = sandbox.run(cell.replace("KEY", str(key)), sandbox.Limits(cpu=5, wall=30.0, disk=8 << 20))
print(json.dumps(dict(key=key, stdout=result.stdout, error=result.error)))
"""


@pytest.mark.parametrize("who", ["root", "user"])
def test_the_kernel_attacks_fail(who, host_dir):
    if platform.machine() != "x86_64":
        pytest.skip("the cell calls x86_64's syscall numbers")
    out = as_trainer(who, KERNEL, host_dir, env=dict(HF_TOKEN="hf_secret_env"))
    assert out["error"] is None, out
    found = ast.literal_eval(out["stdout"])
    # the sandbox's pid 1 has nothing of the trainer's environment (as root its uid is not the code's)
    assert found["environ"] in (False, "PermissionError"), found
    eperm, enosys = 1, 38
    assert found["ptrace_pid1"] == found["ptrace_child"] == found["vm_read"] == found["keyctl"] == eperm, found
    assert found["getfd"] == eperm, found  # another process's files: pid 1's, as not root of the code's uid
    # the trainer's key is not the sandbox's to read (a user's code, of the trainer's uid, sees its name in
    # /proc/keys, not its payload); out["key"] < 0 where keys are refused to the trainer too (a container)
    assert out["key"] < 0 or (found["payload"] == "" and not (who == "root" and found["listed"])), (out, found)
    # no user namespace, by unshare, clone or unshare(1); clone3 is told ENOSYS (glibc falls back to clone)
    assert found["unshare"] == found["clone"] == eperm and found["unshare_r"] != 0 and found["clone3"] == enosys, found
    assert found["x32"] == eperm, found  # the x32 ABI's numbers, which a filter of x86_64's would miss
    assert found["wrote"] == ["/dev/null", "/dev/shm/x", "/tmp/x"] and found["dev_null"] == 0, found
    assert 7 << 20 <= found["filled"] <= 8 << 20, found  # /tmp takes Limits.disk, and no more
    # not root, pid 1 is the interpreter, under its limits (bwrap's reaper would be the code's uid); as root it is
    # bwrap's reaper, uid 0, out of the code's reach. The CPU limit's hard value is finite: a cell cannot lift it
    if who == "user":
        assert found["pid"] == 1 and found["unbounded"] == [], found
    else:
        assert found["pid"] != 1 and found["pid1_uid"] == 0 != found["uid"], found
    assert found["lift"] == "refused", found
    # its parent-death signal stays SIGKILL (it dies with bwrap, and so with its owner); setting SIGKILL again is fine
    assert found["pdeathsig"] == eperm and found["keep"] == 0, found
    # memory that no rlimit counts: a file in memory, SysV segments, semaphore sets and queues
    assert [found[k] for k in ("memfd", "memfd_secret", "shmget", "semget", "msgget")] == [eperm] * 5, found


def test_without_bwrap_it_refuses_to_start_unless_asked_to_run_unisolated(monkeypatch):
    with monkeypatch.context() as patch:
        patch.setenv("PATH", "/nonexistent")
        with pytest.raises(RuntimeError, match="apt-get install bubblewrap.*SANDBOX_ISOLATION=none"):
            sandbox.run("print(1)")
    with pytest.warns(UserWarning, match="unisolated"):
        result = sandbox.run("print(1)\nhog = bytearray(4 << 30)", Limits(isolation="none"))
    assert result.stdout == "1\n" and result.limit == "memory"  # its rlimits still hold
    with pytest.raises(ValueError, match="'bwrap' or 'none'"):
        Limits(isolation="off")


def test_probe_runs_a_cell_or_says_in_one_line_what_to_fix(monkeypatch):
    assert sandbox.probe() is None
    with monkeypatch.context() as patch:
        patch.setenv("PATH", "/nonexistent")  # no bwrap
        with pytest.raises(RuntimeError, match="apt-get install bubblewrap") as missing:
            sandbox.probe()
    # a sandbox that starts but does not answer as it should (here: it prints nothing)
    monkeypatch.setattr(sandbox, "run", lambda code, limits=None: sandbox.Result(stdout="", stderr="", error=None))
    with pytest.raises(RuntimeError, match="SANDBOX_ISOLATION=none") as wrong:
        sandbox.probe()
    assert "\n" not in str(missing.value) + str(wrong.value)

def test_the_python_tool_keeps_each_episodes_variables_and_counts_its_errors(tiny_model_dir, monkeypatch):
    """Two rows of two episodes through Environment.play with two tool workers: each episode counts
    in its own interpreter and /tmp, its failing cell is told and counted as tool_bad_calls,
    and every episode plays to its end, leaving nothing behind."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = Config(environment="envs.python_tool:PythonTool", tool_workers=2, tool_timeout=20.0, max_prompt_length=400,
                 response_length=1024, max_turns=4, num_samples_per_prompt_rollout=2)
    env = Environment(cfg.environment, tok, cfg)
    token = f"SANDBOX_TEST={os.getpid()}"  # the workers' environment, so their bwraps' (not the code's)
    monkeypatch.setenv(*token.split("="))
    env.start()
    rows = [dict(prompt="a"), dict(prompt="b")]
    try:
        with_prompts(env, tok, rows)
        script = [f"<python>import os\nn = globals().get('n', 0) + 1\nprint(n, {TMP})\n"
                  "open('/tmp/mine', 'w').close()</python>",
                  "<python>n += 1\nprint(n)</python>", "<python>1 / 0</python>", "done."]
        episodes, stats = env.play(ScriptedClient(tok, script), rows, 2, 0, cfg.temperature)
    finally:
        env.close()
    assert len(episodes) == 4 and all(e.turns == 4 and e.completion == "done." for e in episodes)
    answers = [[m["content"] for m in e.messages if m["role"] == "tool"] for e in episodes]
    assert [a[0] for a in answers] == ["1 []"] * 4 and [a[1] for a in answers] == ["2"] * 4  # nothing shared
    assert all(a[2].startswith("error: ZeroDivisionError: division by zero") for a in answers)
    assert sorted(kind for kind, _ in stats["tool_failures"]) == ["tool_bad_calls"] * 4
    assert alive(bwraps(token)) == []  # every sandbox ended
    assert PythonTool.call_time <= Config().tool_timeout  # the default timeout lets a call finish


def test_a_thread_left_running_takes_no_cpu_between_cells(py):
    py.run("import resource, threading\nthreading.Thread(target=lambda: [None for _ in iter(int, 1)], daemon=True).start()")
    before = float(py.run("print(resource.getrusage(resource.RUSAGE_SELF).ru_utime)").stdout)
    time.sleep(2.0)  # between cells: the interpreter is stopped, the thread with it
    after = float(py.run("print(resource.getrusage(resource.RUSAGE_SELF).ru_utime)").stdout)
    assert after - before < 0.5, (before, after)


def test_a_cell_that_ignores_its_cpu_limit_is_killed_at_the_hard_one():
    limits = Limits(cpu=1, cpu_total=3, wall=60.0)
    with Interpreter(limits) as py:
        started = time.monotonic()
        result = py.run("import resource, signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\n"
                        "resource.setrlimit(resource.RLIMIT_CPU, (4, 4))\nwhile True: pass")
        assert result.exit == -signal.SIGKILL and result.limit is None, result  # the kernel's, at 3 + 1 s of CPU
        assert time.monotonic() - started < 30  # long before the wall clock
        assert py.run("print(1)").stdout == "1\n"


@pytest.mark.parametrize("where", ["command", "Popen"])
def test_a_start_that_fails_leaves_no_descriptor_file_or_cgroup(monkeypatch, where):
    def cgroups():
        return sorted(n for parent in ("/sys/fs/cgroup/memory", "/sys/fs/cgroup") if os.path.isdir(parent)
                      for _, dirs, _ in os.walk(parent) for n in dirs if n.startswith(f"sandbox-{os.getpid()}-"))

    def broken(*args):
        raise ValueError("no command line")

    interpreter = Interpreter(QUICK)
    if where == "command":
        monkeypatch.setattr(sandbox, "command", broken)
    else:
        interpreter.scratch = "/nonexistent"  # its working directory: Popen raises FileNotFoundError
    fds, dirs = sorted(os.listdir("/proc/self/fd")), cgroups()
    with pytest.raises((ValueError, FileNotFoundError)):
        interpreter.run("print(1)")
    assert sorted(os.listdir("/proc/self/fd")) == fds and cgroups() == dirs


# Whose a wall clock is (faults.py, tool_starved): a cell kept from a CPU by five busy processes on its one core
# is ours; a cell that sleeps past it is the policy's. A script of its own: it pins itself to one core. The busy
# processes each start a session: the kernel's autogroups share a core among sessions first, and the sandbox is a
# session of its own.
STARVED = r"""
import json, os, subprocess, sys
from envs.python_tool import PythonTool
from envs.tool_calls import Starved, ToolError

os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # the sandbox and the busy processes inherit it
out, tool = {}, PythonTool()
tool.limits = type(tool.limits)(cpu=60, wall=4.0)
for name, code in [("loop", "while True: pass"), ("sleep", "import time; time.sleep(60)")]:
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            for _ in range(5 * (name == "loop"))]
    try:
        tool.step({}, [{"role": "assistant", "content": f"<python>{code}</python>"}])
    except (Starved, ToolError) as e:
        out[name] = [type(e).__name__, str(e)]
    finally:
        for p in busy:
            p.kill()
tool.close()
print(json.dumps(out))
"""


def test_the_wall_clock_is_ours_on_a_loaded_machine_and_the_codes_otherwise():
    done = subprocess.run([sys.executable, "-c", STARVED], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["loop"][0] == "Starved" and "waiting for a CPU" in out["loop"][1], out
    assert out["sleep"][0] == "ToolError" and "ran past 4 s" in out["sleep"][1], out


def test_a_cell_that_keeps_its_own_thread_waiting_is_not_starved(py):
    """The CPU that rule weighs is every process's of the sandbox, reaped children's included: a cell whose
    main thread waits behind processes of its own (it forks spinners, then lowers its own priority) got the CPU
    they used. Here two children each use 1 s of CPU, whatever the machine's load, and the cell counts 2 s."""
    burn = ("import os, time\npids = []\nfor _ in range(2):\n    if (pid := os.fork()) == 0:\n"
            "        while time.process_time() < 1.0: pass\n        os._exit(0)\n    pids.append(pid)\n"
            "for pid in pids:\n    os.waitpid(pid, 0)")
    result = py.run(burn)
    assert result.error is None and 1.9 <= result.cpu < 3.0, result
    limits = Limits(wall=4.0)
    assert Result("", "", "x", "wall", -9, waited=3.0, cpu=1.0).ours(limits)  # kept from a CPU: ours
    assert not Result("", "", "x", "wall", -9, waited=3.0, cpu=2.5).ours(limits)  # its own processes had the CPU
    assert not Result("", "", "x", "wall", -9, waited=0.1, cpu=0.0).ours(limits)  # it slept


# A thread of the cell's that forks once the interpreter has killed the cell's processes (while it writes its
# reply, or waits for the next cell): the new process would run between cells and wake the stopped interpreter
# (SIGCONT). The host kills it from outside (Interpreter.freeze), so an interpreter's thread counts no ticks.
RACE = """import os, signal, sys, threading, time
main, me = threading.main_thread().ident, os.getpid()
def race():
    while True:
        frame = sys._current_frames().get(main)
        if frame is not None and frame.f_code.co_name == "interpreter" and frame.f_lineno in LINES:
            if os.fork() == 0:
                signal.signal(signal.SIGXCPU, signal.SIG_IGN)
                while True:
                    os.kill(me, signal.SIGCONT)
                    open("/tmp/survivor", "w").write(str(time.process_time()))
            return
def tick():
    global ticks
    while True:
        time.sleep(0.01)
        ticks += 1
ticks = 0
threading.Thread(target=race, daemon=True).start()
threading.Thread(target=tick, daemon=True).start()"""


def test_nothing_a_cell_forks_late_runs_between_cells():
    import inspect

    lines = [i for i, line in enumerate(inspect.getsource(sandbox_process.interpreter).splitlines(), 1)
             if "os.write(reply_fd, (json" in line or "for line in cells" in line]
    for _ in range(3):  # the fork races the interpreter's reply: three tries
        with Interpreter(Limits(cpu=5, wall=30.0)) as py:
            assert py.run(f"LINES = {lines}\n{RACE}").error is None
            time.sleep(2.0)  # between the cells: a survivor would spin, and tick the interpreter's thread
            found = py.run("print(ticks, os.path.exists('/tmp/survivor') and open('/tmp/survivor').read() or 0)")
            ticks, survivor_cpu = found.stdout.split()
            assert int(ticks) < 30 and float(survivor_cpu) < 0.5, found  # 2 s running: ~190 ticks


def test_a_reply_forged_with_its_nonce_is_the_cells_error_and_raises_nothing(py):
    """The cell can find its nonce (the interpreter's frame): a reply in another shape than the interpreter's
    (a missing error, a limit it never reports) is the cell's error, its sandbox killed, never a KeyError of ours."""
    for fields in ("{}", "{'error': 'x', 'limit': 'nope'}", "{'error': None, 'limit': 'wall'}"):
        forge = ("import json, os, sys, time\nf = sys._getframe(1)\nos.write(f.f_locals['reply_fd'], (json.dumps("
                 f"dict(nonce=f.f_locals['request']['nonce'], **{fields})) + '\\n').encode())\ntime.sleep(30)")
        result = py.run(forge)
        assert "reply pipe" in result.error and result.exit == -signal.SIGKILL, (fields, result)
    assert py.run("print(1)").stdout == "1\n"
