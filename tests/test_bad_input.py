"""Bad input ends in one `error:` line naming the field and exit status 2, before any process
group, model or server starts: values Config refuses (through cli.parse_args_or_exit, the entry
of train.py) and what the config names outside the process (train.load_inputs: the model's
config.json, directories, servers you run). In-process, plus one run of train.py itself."""

import os
import subprocess
import sys

import pytest

from cli import parse_args_or_exit
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
    assert name in one_error_line(capsys, lambda: parse_args_or_exit(argv))


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
