"""The sandbox (sandbox.py): each limit fires on the code that needs it, ends as a counted error
with the interpreter (or the next one) working, and leaves no process and no scratch directory
behind; and the PythonTool environment through the trainer's episodes."""

import contextlib
import os
import socket
import time

import pytest

import sandbox
from config import Config
from environments import Environment
from rollout import play
from sandbox import Interpreter, Limits
from helpers import ScriptedClient, with_prompts

pytestmark = pytest.mark.subprocess  # every test here starts sandboxed processes

QUICK = Limits(cpu=1, wall=30.0)  # a CPU limit of 1 s comes well before the wall clock, even on a busy machine


def survivors(uid, scratch, wait=10.0):
    """The sandbox's processes still there after up to `wait` seconds: those of its uid (as root),
    else those started with its scratch directory as HOME."""
    def mine():
        if uid is not None:
            return list(sandbox.processes_of(uid))
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    found += [int(pid)] if f"HOME={scratch}".encode() in f.read().split(b"\0") else []
            except OSError:
                pass
        return found
    deadline = time.monotonic() + wait
    while mine() and time.monotonic() < deadline:
        time.sleep(0.05)
    return mine()


@contextlib.contextmanager
def checked(limits):
    """An interpreter; at the end, closed, with nothing of it left."""
    interpreter = Interpreter(limits)
    yield interpreter
    interpreter.close()
    assert survivors(interpreter.uid, interpreter.scratch) == []
    assert not os.path.exists(interpreter.scratch)


@pytest.fixture
def py():
    with checked(QUICK) as interpreter:
        yield interpreter


def test_a_one_shot_run_answers_and_leaves_nothing():
    result = sandbox.run("import os\nprint(2 ** 10, os.getcwd())")
    answer, scratch = result.stdout.split()
    assert answer == "1024" and result.error is None and not os.path.exists(scratch)


def test_variables_last_between_cells_of_one_interpreter_and_not_between_two(py):
    assert py.run("x = 41").error is None
    assert py.run("print(x + 1)").stdout == "42\n"
    with Interpreter(QUICK) as other:
        assert other.run("print(x)").error == "NameError: name 'x' is not defined"
        assert other.scratch != py.scratch and (py.uid is None or other.uid != py.uid)
    result = py.run("1 / 0")
    assert result.error == "ZeroDivisionError: division by zero" and result.stderr.endswith(
        "ZeroDivisionError: division by zero\n") and result.exit is None
    assert py.run("print(x)").stdout == "41\n"  # an exception leaves the interpreter as it was


def test_an_infinite_loop_is_stopped_by_the_cpu_limit(py):
    py.run("x = 1")
    result = py.run("while True: pass")
    assert result.limit == "cpu" and result.exit is not None and "1 s of CPU" in result.error
    assert survivors(py.uid, py.scratch) == []  # the process and its namespace went with it
    assert py.run("print(globals().get('x'))").stdout == "None\n"  # restarted, empty


def test_a_timeout_kills_the_process_group_and_restarts_the_interpreter_empty():
    with checked(Limits(wall=2.0)) as py:
        py.run("x = 1")
        t = time.monotonic()
        result = py.run("import subprocess, time\nsubprocess.Popen(['sleep', '1000'])\nprint('started')\n"
                        "time.sleep(1000)")
        assert time.monotonic() - t < 2.0 + 5
        assert result.limit == "wall" and result.stdout == "started\n" and "variables are gone" in result.error
        assert survivors(py.uid, py.scratch) == []  # the sleep went with the group
        assert py.run("print(globals().get('x'))").stdout == "None\n"


def test_a_fork_bomb_is_bounded_by_the_process_limit(py):
    # the processes a cell can hold at once: all of the sandbox's, less the interpreter and its parent
    held = py.run("import os, time\npids = []\ntry:\n    while True:\n        if (pid := os.fork()) == 0:\n"
                  "            time.sleep(60)\n            os._exit(0)\n        pids.append(pid)\n"
                  "finally:\n    print(len(pids))")
    assert held.limit == "processes" and held.exit is None
    # as root the limit is the sandbox's own; otherwise it counts the user's other processes, which come and go
    assert 0 < int(held.stdout) <= QUICK.processes + (0 if py.uid is not None else 64)
    py.run("for pid in pids:\n    os.kill(pid, 9)\n    os.waitpid(pid, 0)")
    bomb = py.run("while True: os.fork()")
    assert bomb.limit == "processes" and "limit of 32 processes" in bomb.error and bomb.exit is None
    assert py.run("print(len(pids))").stdout == held.stdout  # the interpreter lived through it all
    if sandbox.namespaces() or py.uid is not None:  # else a process that leaves the group outlives a kill
        # once the bomb's processes are gone, one in a session of its own; the fixture checks it is gone too
        escape = py.run("import subprocess\nfor _ in range(100):\n    try:\n"
                        "        subprocess.Popen(['sleep', '1000'], start_new_session=True)\n        break\n"
                        "    except BlockingIOError:\n        time.sleep(0.1)")
        assert escape.error is None


def test_a_memory_hog_fails_and_the_trainer_is_fine(py):
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    py.run("x = 1")
    result = py.run("hog = bytearray(4 << 30)")
    assert result.limit == "memory" and "MemoryError" in result.stderr and result.exit is None
    assert py.run("print(x)").stdout == "1\n"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB: the trainer did not grow


def test_a_1gb_file_write_stops_at_the_file_size_limit(py):
    result = py.run("with open('big', 'wb') as f:\n    for _ in range(1024):\n        f.write(b'x' * (1 << 20))")
    assert result.limit == "file size" and "File too large" in result.stderr
    sizes = [os.path.getsize(os.path.join(py.scratch, name)) for name in os.listdir(py.scratch)]
    assert sizes and sum(sizes) <= QUICK.file_size
    # printing a gigabyte: the output file stops at the same limit, and the trainer reads a bounded head
    printed = py.run("for _ in range(1024):\n    print('y' * (1 << 20))")
    assert printed.limit == "file size" and printed.stdout == "y" * QUICK.output + " [cut]"


def test_open_files_are_limited(py):
    result = py.run("files = [open('/dev/null') for _ in range(1000)]")
    assert result.limit == "open files" and result.exit is None


def test_the_code_cannot_read_the_trainers_environment(py, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_sandbox_test")
    result = py.run(f"import os\nprint(dict(os.environ))\ntry:\n    print(open('/proc/{os.getpid()}/environ').read())\n"
                    "except OSError as e:\n    print(type(e).__name__)")
    assert result.error is None and "hf_secret_sandbox_test" not in result.stdout, result.stdout
    assert "HF_TOKEN" not in result.stdout and f"'HOME': '{py.scratch}'" in result.stdout
    if py.uid is None and not sandbox.namespaces():
        pytest.skip("neither root nor namespaces: the code runs as the trainer's user and can read its /proc")
    assert result.stdout.rstrip().endswith(("PermissionError", "FileNotFoundError"))


def test_a_socket_cannot_reach_a_port_the_trainer_listens_on(py):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        result = py.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)")
        if not sandbox.namespaces():
            pytest.skip("unshare cannot make a network namespace here (neither root nor user namespaces)")
        assert result.error and result.error.startswith("OSError"), result
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing came


def test_the_python_tool_keeps_each_episodes_variables_and_counts_its_errors(tiny_model_dir):
    """Two rows of two episodes through rollout.play with two tool workers: each episode counts
    in its own interpreter and directory, its failing cell is told and counted as tool_bad_calls,
    and every episode plays to its end, leaving nothing behind."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = Config(environment="sandbox:PythonTool", tool_workers=2, tool_timeout=20.0, max_prompt_length=400,
                 response_length=1024, max_turns=4, num_samples_per_prompt_rollout=2)
    env = Environment(cfg.environment, tok, cfg)
    env.start()
    rows = [dict(prompt="a"), dict(prompt="b")]
    try:
        with_prompts(env, tok, rows)
        script = ["<python>import os\nn = globals().get('n', 0) + 1\nprint(n, os.getcwd(), os.getuid())</python>",
                  "<python>n += 1\nprint(n)</python>", "<python>1 / 0</python>", "done."]
        episodes, stats = play(cfg, ScriptedClient(tok, script), rows, 2, 0, tok, env)
    finally:
        env.close()
    assert len(episodes) == 4 and all(e.turns == 4 and e.answer == "done." for e in episodes)
    answers = [[m["content"] for m in e.messages if m["role"] == "tool"] for e in episodes]
    firsts = [a[0].split() for a in answers]
    assert [n for n, _, _ in firsts] == ["1"] * 4 and [a[1] for a in answers] == ["2"] * 4  # no shared variables
    assert len({cwd for _, cwd, _ in firsts}) == 4
    assert all(a[2].startswith("error: ZeroDivisionError: division by zero") for a in answers)
    assert sorted(kind for kind, _ in stats["tool_failures"]) == ["bad_calls"] * 4
    for _, cwd, uid in firsts:  # each episode's close removed its directory and ended its processes
        assert not os.path.exists(cwd) and survivors(int(uid) if os.geteuid() == 0 else None, cwd) == []
