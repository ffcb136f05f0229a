import os
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
