"""The GPU scripts (benchmarks/gpu_checks.sh, benchmarks/gpu_colocated.sh) have never run on a GPU. What
runs here: they parse, say what they need, and refuse in one line on a machine without a GPU, before
anything starts; and the colocated run's instrument (benchmarks/colocated_phases.py), on the CPU's
colocated path (the same sleep and wake calls: vLLM's CPU build frees nothing)."""

import json
import shutil
import subprocess
import sys

import pytest

from helpers import EAGER, ENV, ROOT

SCRIPTS = ["benchmarks/gpu_checks.sh", "benchmarks/gpu_colocated.sh"]
no_gpu = pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU machine: the scripts would run")


def bash(*args, **env):
    return subprocess.run(["bash", *args], cwd=ROOT, env=dict(ENV, **env), capture_output=True, text=True, timeout=60)


@pytest.mark.subprocess
@pytest.mark.parametrize("script", SCRIPTS + ["benchmarks/gpu_common.sh", "scripts/launch_multinode.sh"])
def test_the_scripts_parse(script):
    assert bash("-n", script).returncode == 0


@pytest.mark.subprocess
@pytest.mark.parametrize("script", SCRIPTS)
def test_help_says_what_the_script_needs(script):
    out = bash(script, "--help")
    assert out.returncode == 0 and "Needs:" in out.stdout and "NEVER RUN" in out.stdout, out.stdout
    assert "set -uo" not in out.stdout  # the header only


@no_gpu
@pytest.mark.subprocess
@pytest.mark.parametrize("script", SCRIPTS)
def test_without_a_gpu_the_script_refuses_in_one_line(script, tmp_path):
    """Exit 2, one `error:` line naming the script and what it needs, and nothing written: no output
    directory, no stage started (the model directories are checked after the GPUs, so they are set)."""
    out = bash(script, OUT=str(tmp_path / "out"), MODEL_05B=str(tmp_path))
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.splitlines() == [f"error: no GPU here (nvidia-smi not found): {script} needs 1 CUDA GPU(s)"]
    assert out.stdout == "" and not (tmp_path / "out").exists()


@pytest.mark.subprocess
def test_gpu_checks_takes_no_arguments():
    out = bash("benchmarks/gpu_checks.sh", "--steps", "3")
    assert out.returncode == 2 and out.stderr.splitlines() == [
        "error: benchmarks/gpu_checks.sh takes no arguments (settings are environment variables: --help)"]


@pytest.mark.slow
def test_the_colocated_instrument_times_each_phase_in_order(tiny_model_dir, tmp_path):
    """benchmarks/colocated_phases.py on the CPU's colocated path, 2 steps in one process: every step has
    its four phases in the loop's order (generate, sleep, train, wake_sync), rank 0's calls to the server
    inside them (the sleep in sleep; wake weights, reload, wake KV cache in that order in wake_sync), and
    the report prints the sync check's gap of each step as metrics.jsonl has it, and vLLM's own sleep and
    wake times (two of each)."""
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "benchmarks/colocated_phases.py", "run", "--model_name_or_path",
                          tiny_model_dir, "--output_dir", str(out), "--num_training_steps", "2", "--eval_freq", "0",
                          "--vllm_colocate", "true", "--filter_zero_std_samples", "false", "--seed", "5", *EAGER],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    phases = [json.loads(line) for line in open(out / "phases_rank0.jsonl")]
    for step in (1, 2):
        mine = sorted((r for r in phases if r["step"] == step), key=lambda r: r["start"])
        top = [r["phase"] for r in mine if not r["phase"].startswith("server_")]
        assert top == ["generate", "sleep", "train", "wake_sync"], top
        spans = {r["phase"]: r for r in mine}
        calls = [r["phase"] for r in mine if r["phase"].startswith("server_")]
        assert calls == ["server_sleep", "server_wake_weights", "server_reload", "server_wake_kv_cache"], calls
        inside = lambda inner, outer: spans[outer]["start"] <= spans[inner]["start"] <= spans[inner]["end"] \
            <= spans[outer]["end"]  # noqa: E731
        assert inside("server_sleep", "sleep") and all(inside(c, "wake_sync") for c in calls[1:])
        assert all(r["host_used"] > 0 and r["seconds"] >= 0 for r in mine)
    report = subprocess.run([sys.executable, "benchmarks/colocated_phases.py", "report", str(out)], cwd=ROOT, env=ENV,
                            capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    for r in (json.loads(line) for line in open(out / "metrics.jsonl")):
        assert (f"step {r['step']}: vllm_logp_diff_mean {r['vllm_logp_diff_mean']:.3g}, "
                f"vllm_logp_diff_max {r['vllm_logp_diff_max']:.3g}") in report.stdout
    assert "fall asleep: 2 times" in report.stdout and "wake up weights: 2 times" in report.stdout
    assert "wake up kv_cache: 2 times" in report.stdout
