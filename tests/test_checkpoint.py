"""checkpoint.py: DCP checkpoints that restore everything bit for bit, on the same or
another world size; partial checkpoints are never chosen; exports load as they are."""

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "ckpt_worker.py")


def worker(mode, model_dir, out, nproc, port=29631):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
                str(port)] if nproc > 1 else [sys.executable]
    p = subprocess.run(launcher + [WORKER, mode, model_dir, str(out)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]


def same(a, b, path="state"):
    """Bit-identical nested state (tensors, numbers, lists, dicts)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


STATE = ("policy", "ref", "master", "optimizer", "scheduler", "lr", "position")


@pytest.fixture(scope="module")
def saved_on_two_ranks(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt2")
    worker("save", tiny_model_dir, out, 2)
    return out


@pytest.mark.subprocess
def test_two_rank_checkpoint_restores_everything_bit_for_bit(saved_on_two_ranks):
    saved, loaded = (torch.load(saved_on_two_ranks / f, weights_only=False) for f in ("saved.pt", "loaded_2.pt"))
    assert loaded["found"] == "step_00000003" and loaded["step"] == 3
    # keep_last=2 pruned step 1 only after step 3 was complete; the partial and the incomplete dirs were never chosen
    assert loaded["listing"] == ["step_00000002", "step_00000003", "step_00000009.partial", "step_00000010"]
    for k in STATE + ("rng",):
        same(saved[k], loaded[k], k)
    assert saved["master"].keys() == saved["ref"].keys() and saved["ref"]["lm_head.weight"].dtype == torch.bfloat16
    moved = saved["master"]["lm_head.weight"] - saved["ref"]["lm_head.weight"].float()
    assert moved.abs().max() > 0, "the fp32 master carries what bf16 rounds away; the test must see both"
    assert saved["optimizer"]["state"], "AdamW moments were saved"


@pytest.mark.subprocess
def test_a_two_rank_checkpoint_loads_into_one_process(saved_on_two_ranks, tiny_model_dir):
    worker("load", tiny_model_dir, saved_on_two_ranks, 1)
    saved, loaded = (torch.load(saved_on_two_ranks / f, weights_only=False) for f in ("saved.pt", "loaded_1.pt"))
    for k in STATE:  # resharded by DCP: same values; the RNG of rank 0 came back too
        same(saved[k], loaded[k], k)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_export_loads_in_transformers_unchanged(tied, tiny_model_dir, tied_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infra import checkpoint
    from config import Config

    src = tied_model_dir if tied else tiny_model_dir
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    checkpoint.export(Config(output_dir=str(tmp_path)), model, AutoTokenizer.from_pretrained(src), 0, "m")
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), dtype=torch.float32)
    ids = torch.tensor([[5, 9, 17, 30, 41, 2]])
    assert torch.equal(model(ids).logits, again(ids).logits)
    assert (again.lm_head.weight.data_ptr() == again.model.embed_tokens.weight.data_ptr()) == tied
    assert AutoTokenizer.from_pretrained(str(tmp_path / "m"))("copy: ab=")["input_ids"]
    assert not os.path.exists(tmp_path / "m.partial")


@pytest.mark.subprocess
def test_a_checkpoint_of_another_model_is_refused_in_one_line(saved_on_two_ranks, tmp_path):
    import make_tiny_model

    other = str(tmp_path / "three_layers")
    make_tiny_model.main(["--out", other, "--layers", "3"])
    root = saved_on_two_ranks / "ckpt"
    before = sorted(n for n in os.listdir(root) if not n.endswith(".partial"))  # partials are removed at start
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--model_name_or_path", other,
                        "--checkpoint_state_dir", str(root), "--checkpoint_state_freq", "2", "--output_dir",
                        str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode != 0
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: cannot resume from")]
    # the saved config names the change before any tensor is read
    assert len(errors) == 1 and "step_00000003" in errors[0] and "model_name_or_path" in errors[0], p.stderr[-2000:]
    assert sorted(os.listdir(root)) == before  # nothing removed or written
    assert not os.path.exists(tmp_path / "out" / "vllm.log")  # no server was started


def test_resume_refuses_a_changed_run_and_allows_harmless_changes():
    from dataclasses import asdict

    from infra.checkpoint import check_resumable
    from config import Config

    saved = asdict(Config(beta=0.1, num_mini_batches=2))
    check_resumable(saved, Config(beta=0.1, num_mini_batches=2, num_training_steps=500, eval_freq=0, output_dir="o",
                                  vllm_request_timeout=5.0, activation_checkpointing=True), "ckpt/step_00000004")
    with pytest.raises(ValueError) as e:
        check_resumable(saved, Config(beta=0.1, loss_fn="cispo", num_mini_batches=4), "ckpt/step_00000004")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("cannot resume from ckpt/step_00000004")
    assert "loss_fn ('dapo' -> 'cispo')" in msg and "num_mini_batches (2 -> 4)" in msg and "beta" not in msg
    decaying = asdict(Config(lr_scheduler_type="cosine"))
    with pytest.raises(ValueError, match="num_training_steps"):  # a decaying schedule's length is its shape
        check_resumable(decaying, Config(lr_scheduler_type="cosine", num_training_steps=500), "c")
    older = {k: v for k, v in saved.items() if k != "active_sampling"}  # written before the field existed
    check_resumable(older, Config(beta=0.1, num_mini_batches=2), "c")
    with pytest.raises(ValueError, match="active_sampling"):
        check_resumable(older, Config(beta=0.1, num_mini_batches=2, active_sampling=True), "c")
    tools = asdict(Config(environment="envs.calculator:calculator"))
    with pytest.raises(ValueError, match="environment"):
        check_resumable(tools, Config(environment="envs.calculator:calculator_tool"), "c")
