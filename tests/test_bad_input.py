"""Bad input ends in one `error:` line naming the field and exit status 2, before any process
group, model or server starts: values Config refuses (through cli.parse_args_or_exit, the entry
of train.py) and what the config names outside the process (train.load_inputs: the model's
config.json, directories, servers you run). In-process, plus one run of train.py itself."""

import os
import subprocess
import sys

import pytest

from infra.cli import parse_args_or_exit
from config import Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_error_line(capsys, call):
    """Run call(); assert exit status 2 and exactly one stderr line, `error: ...`; return it."""
    with pytest.raises(SystemExit) as e:
        call()
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


# (flags, the field the line must name)
BAD_FLAGS = [
    (["--learning_rate", "nan"], "learning_rate"),
    (["--learning_rate", "inf"], "learning_rate"),
    (["--temperature", "inf"], "temperature"),
    (["--beta", "nan"], "beta"),
    (["--weight_decay", "nan"], "weight_decay"),
    (["--max_grad_norm", "inf"], "max_grad_norm"),
    (["--clip_higher", "inf"], "clip_higher"),
    (["--reward_timeout", "nan"], "reward_timeout"),
    (["--format_reward", "-inf"], "format_reward"),
    (["--vllm_importance_sampling_mask_cap", "inf"], "vllm_importance_sampling_mask_cap"),
    (["--loss_denominator", "inf"], "loss_denominator"),
    (["--truncated_importance_sampling_ratio_cap", "0.5"], "truncated_importance_sampling_ratio_cap"),
    (["--truncated_importance_sampling_ratio_cap", "nan"], "truncated_importance_sampling_ratio_cap"),
    (["--seed", str(2**31)], "seed"),
    (["--seed", "-1"], "seed"),
    (["--vllm_server_urls", "127.0.0.1:8000"], "vllm_server_urls"),
    (["--weight_sync_master_port", "70000"], "weight_sync_master_port"),
    (["--config", "/proc"], "config file"),
]


@pytest.mark.parametrize("argv,name", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_config_refuses_in_one_line(capsys, argv, name):
    assert name in one_error_line(capsys, lambda: parse_args_or_exit(Config, argv))


# (Config overrides, the field the line must name); the tiny model has 2 heads and 64 tokens
BAD_OUTSIDE = [
    (dict(beta=0.1, kl_estimator="topk", kl_topk=65), "kl_topk"),
    (dict(sequence_parallel_size=4), "sequence_parallel_size"),
    (dict(output_dir="/proc/flatgrpo"), "output_dir"),
    (dict(output_dir="A_FILE"), "output_dir"),
    (dict(checkpoint_state_dir="/proc/flatgrpo", checkpoint_state_freq=1), "checkpoint_state_dir"),
    (dict(weight_sync_dir="/proc/flatgrpo"), "weight_sync_dir"),
    (dict(vllm_server_urls=["http://127.0.0.1:9"]), "vllm_server_urls"),  # the discard port: nothing listens
]


@pytest.mark.parametrize("overrides,name", BAD_OUTSIDE, ids=[n for _, n in BAD_OUTSIDE])
def test_start_up_refuses_in_one_line(capsys, monkeypatch, tmp_path, tiny_model_dir, overrides, name):
    import train

    a_file = tmp_path / "a_file"
    a_file.write_text("")
    overrides = {k: str(a_file) if v == "A_FILE" else v for k, v in overrides.items()}
    # a world of 4 for sequence_parallel_size=4: the head check runs before any process group
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4" if overrides.get("sequence_parallel_size") else "1")
    cfg = Config(model_name_or_path=tiny_model_dir, **{"output_dir": str(tmp_path / "out"), **overrides})
    assert name in one_error_line(capsys, lambda: train.load_inputs(cfg))


def test_model_without_config_json_refused_in_one_line(capsys, monkeypatch, tmp_path, tiny_model_dir):
    """A directory with a tokenizer but no config.json: refused at start-up, not by the model load."""
    import shutil

    import train

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model, ignore=shutil.ignore_patterns("config.json", "*.safetensors"))
    monkeypatch.setenv("RANK", "0")
    cfg = Config(model_name_or_path=str(model), output_dir=str(tmp_path / "out"))
    assert "model_name_or_path" in one_error_line(capsys, lambda: train.load_inputs(cfg))


@pytest.mark.subprocess
def test_train_py_names_a_server_that_is_not_there(tmp_path, tiny_model_dir):
    """The whole entry point: no traceback, one line, status 2."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    p = subprocess.run([sys.executable, "train.py", "--model_name_or_path", tiny_model_dir, "--output_dir",
                        str(tmp_path / "out"), "--vllm_server_urls", "http://127.0.0.1:9", "--vllm_request_timeout",
                        "5"], cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(env, OMP_NUM_THREADS="1"))
    err = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(err) == 1 and err[0].startswith("error: vllm_server_urls"), p.stderr[-2000:]


def test_a_gpu_run_whose_server_has_no_gpu_is_refused_before_any_model(capsys, monkeypatch, tmp_path):
    """On GPUs with vllm_colocate=False and no vllm_server_urls the server we launch has no GPU: refused
    in one line naming the launcher, before the tokenizer or any model is loaded (the model named here
    does not even exist). By default the server shares the training GPUs (test_colocate.py)."""
    import torch

    import train

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(train, "load_tokenizer", lambda cfg: pytest.fail("the tokenizer was loaded first"))
    monkeypatch.setenv("RANK", "0")
    cfg = Config(model_name_or_path=str(tmp_path / "no_model"), output_dir=str(tmp_path / "out"), vllm_colocate=False)
    line = one_error_line(capsys, lambda: train.load_inputs(cfg))
    assert "bash scripts/launch_8gpu.sh" in line and "leave vllm_colocate unset" in line


def test_a_model_that_is_nowhere_fails_in_seconds(monkeypatch, tmp_path):
    """Not a local directory, and the hub out of reach (a closed port stands for it here): refused
    at once naming the fix, where transformers retried for about a minute. A name the hub cache
    holds loads from there, offline; a directory is taken as it is."""
    import time

    from huggingface_hub import constants

    from infra import model_files

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"'models/nowhere' is not a local directory, and the hub .* cannot be "
                                         r"reached .*make_tiny_model.py --out models/nowhere"):
        model_files.locate_model("models/nowhere")
    assert time.monotonic() - start < 20
    with pytest.raises(ValueError, match="not a local directory, nor a hub model id"):
        model_files.locate_model("./models/nowhere")
    model_files.locate_model(str(tmp_path))
    snapshot = tmp_path / "hub" / "models--org--cached" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--org--cached" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--cached" / "refs" / "main").write_text("0" * 40)
    model_files.locate_model("org/cached")
    assert constants.HF_HUB_OFFLINE and os.environ["HF_HUB_OFFLINE"] == "1"


@pytest.mark.subprocess
def test_train_py_without_its_model_fails_in_seconds(tmp_path):
    """The README's `train.py` on a fresh clone, where models/tiny is not built yet, and no hub (a
    closed port stands for it): one line naming the command that builds it. Before: the same
    start-up took 57 s of transformers' retries (measured on the 2-core machine), now 10 s, most of
    it imports; the message is asserted, not the time."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "HF_HUB_OFFLINE",
                                                            "TRANSFORMERS_OFFLINE")}
    p = subprocess.run([sys.executable, "train.py", "--model_name_or_path", "models/not-built-yet", "--output_dir",
                        str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(env, OMP_NUM_THREADS="1", HF_ENDPOINT="http://127.0.0.1:9"))
    err = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(err) == 1, p.stderr[-2000:]
    assert "cannot be reached" in err[0] and ".venv/bin/python scripts/make_tiny_model.py --out models/not-built-yet" \
        in err[0], err[0]


# (what the run is given, what its one line must say); before, the first two started and the third
# printed a dict of counts
BAD_DATA = [
    ("reward", "fits neither accepted form; write `reward(prompt, completion, example)`"),
    ("conversation", "ends with an assistant message"),
    ("too_long", "are longer than max_prompt_length=4 tokens, the shortest 5; raise max_prompt_length to at least 5"),
]


@pytest.mark.parametrize("what,says", BAD_DATA, ids=[w for w, _ in BAD_DATA])
def test_bad_rewards_and_rows_are_refused_in_one_line(capsys, monkeypatch, tmp_path, tiny_model_dir, what, says):
    import json

    import datasets

    import train

    reward, rows = tmp_path / "r.py", tmp_path / "d.jsonl"
    reward.write_text("def r(x):\n    return 1.0\n")
    chat = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]
    rows.write_text("".join(json.dumps({"messages": chat, "prompt": "12345"}) + "\n" for _ in range(5)))
    overrides = {"reward": dict(reward_fn=f"{reward}:r"), "too_long": dict(max_prompt_length=4),
                 "conversation": dict(dataset_prompt_column="messages")}[what]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg = Config(model_name_or_path=tiny_model_dir, output_dir=str(tmp_path / "out"), dataset=str(rows),
                 num_eval_prompts=0, **overrides)
    datasets.disable_progress_bars()  # its "Generating train split" bars on stderr are no error lines
    try:
        assert says in one_error_line(capsys, lambda: train.load_inputs(cfg))
    finally:
        datasets.enable_progress_bars()
