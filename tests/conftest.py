import multiprocessing.process
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))


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
