import fcntl
import multiprocessing.process
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
# The two pytest processes (below) share the cores, so a server of one computes on cores the other's
# processes want. OpenMP threads that spin at each barrier while a sibling is descheduled then wait a
# whole time slice per barrier: the tiny model's server beside one busy process generated 137-194
# tokens/s, and 6,997 with passive waiting (benchmarks/bench_generation.py, BENCHMARKS.md). Every
# process the tests start inherits this; it changes when threads sleep, not what they compute.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """An untied random 0.3 M Qwen2 model with the character tokenizer, built once."""
    import make_tiny_model

    out = str(tmp_path_factory.mktemp("tiny"))
    make_tiny_model.main(["--out", out])
    return out


@pytest.fixture(scope="session")
def tied_model_dir(tmp_path_factory):
    import make_tiny_model

    out = str(tmp_path_factory.mktemp("tiny_tied"))
    make_tiny_model.main(["--out", out, "--tie-word-embeddings", "--seed", "1"])
    return out


@pytest.fixture(autouse=True)
def no_process_outside_its_tier(request, monkeypatch):
    """The quick tier (-m "not slow and not subprocess") runs in this process only: a test that
    starts a process (torchrun ranks, train.py, a vLLM server, worker pools) must be marked
    subprocess (or slow), and fails here until it is."""
    if request.node.get_closest_marker("slow") or request.node.get_closest_marker("subprocess"):
        return

    def refuse(*args, **kwargs):
        raise RuntimeError(f"{request.node.nodeid} starts a process: mark it @pytest.mark.subprocess")
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


# The suite runs as two pytest processes (pytest-xdist, pyproject's addopts), each taking a whole test
# file at a time (--dist loadfile: a module's server starts once). Memory is the limit on a 24 GB machine:
# a vLLM CPU server of the tiny model holds about 3 GB, SmolLM2's tests about 15 GB (2 ranks, their
# server, 5,632-token micro-batches). So a file with slow tests (vLLM servers) holds a lock while it runs,
# its module-scoped servers included: shared among the tiny model's files, and exclusive for SmolLM2's,
# which runs beside files that start no server. The files go longest first (--durations=0, seconds on 2
# cores): SmolLM2's, then those without servers, then the other servers' files, so that neither process
# waits long on the lock or is left alone with a long file at the end.
ALONE = {"test_smollm2.py"}
LONGEST = ["test_smollm2.py", "test_faults.py", "test_lora.py", "test_agents_e2e.py", "test_train.py",
           "test_distributed.py", "test_vllm.py", "test_doors.py", "test_two_runs.py", "test_sequence_parallel.py",
           "test_generation_config.py", "test_async.py", "test_ending.py", "test_multinode.py", "test_ranks.py"]
SERVERS = pytest.StashKey()


def pytest_collection_modifyitems(config, items):
    servers = config.stash[SERVERS] = {item.path.name for item in items if item.get_closest_marker("slow")}
    longest = {name: k for k, name in enumerate(LONGEST)}
    items.sort(key=lambda item: (0 if item.path.name in ALONE else 2 if item.path.name in servers else 1,
                                 longest.get(item.path.name, len(LONGEST))))


@pytest.fixture(scope="module", autouse=True)
def memory_share(request, tmp_path_factory):
    """The lock of a file with servers (above), in the directory both pytest processes share."""
    if request.path.name not in request.config.stash.get(SERVERS, ()):
        yield
        return
    with open(tmp_path_factory.getbasetemp().parent / "servers.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if request.path.name in ALONE else fcntl.LOCK_SH)
        yield
