"""train.py end to end: bad input stops in one line; a short run on 2 CPU ranks learns."""

import json
import os
import re
import subprocess
import sys

import pytest
from helpers import EAGER, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("args,fragment,nproc", [
    (["--model_name_or_path", "/nonexistent/model"], "make_tiny_model.py --out /nonexistent/model", 1),
    (["--dataset", "/nonexistent/data.jsonl"], "does not exist", 1),
    (["--reward_fn", "no_such_module:f"], "cannot import", 1),
    (["--environment", "no_such_env.py:env"], "environment file 'no_such_env.py' does not exist", 1),
    (["--fsdp_shard_size", "3"], "does not divide the world of 2 ranks", 2),
])
@pytest.mark.subprocess
def test_bad_input_is_one_line_before_anything_starts(args, fragment, nproc, tiny_model_dir, tmp_path):
    base = ["--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path / "out")]
    out = train(base + args, nproc=nproc)
    assert out.returncode == (2 if nproc == 1 else 1), out.stderr[-2000:]  # torchrun reports a failed rank as 1
    lines = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) >= 1 and fragment in lines[0], out.stderr[-2000:]
    assert not os.path.exists(tmp_path / "out" / "vllm.log")  # no server was started


@pytest.mark.slow
def test_two_cpu_ranks_learn_the_copy_task(tiny_model_dir, tmp_path):
    """The README's demo in small: a random 0.3 M model, a vLLM CPU server, 2 gloo ranks."""
    out_dir = tmp_path / "run"
    out = train(["--model_name_or_path", tiny_model_dir, "--output_dir", str(out_dir), "--num_training_steps", "80",
                 "--eval_freq", "30", "--seed", "3"], nproc=2, timeout=1200)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in open(out_dir / "metrics.jsonl")]
    steps = [r for r in rows if "reward_mean" in r]
    assert len(steps) == 80
    first = sum(r["reward_mean"] for r in steps[:10]) / 10
    last = sum(r["reward_mean"] for r in steps[-10:]) / 10
    assert last > first + 0.05 and last > 3 * first, (first, last)
    assert all(r["vllm_logp_diff_max"] < 1e-3 for r in steps)  # every sync took
    assert {"eval_accuracy", "tokens_per_s", "time_generate", "time_train", "time_sync", "grad_norm", "lr",
            "entropy", "clip_frac", "kl", "loss", "response_length", "reward_std"} <= set(steps[-1])


@pytest.mark.slow
def test_sigterm_stops_the_server_we_started(tiny_model_dir, tmp_path):
    import signal
    import time

    out_dir = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), "--model_name_or_path", tiny_model_dir,
                             "--output_dir", str(out_dir), "--num_training_steps", "1000", "--eval_freq", "0",
                             *EAGER], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics = out_dir / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:
        assert proc.poll() is None, "train.py exited early"
        time.sleep(1)
    served = str(out_dir / "vllm_model")
    running = lambda: subprocess.run(["pgrep", "-f", served], capture_output=True).returncode == 0  # noqa: E731
    assert running(), "the server should be up while training"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    time.sleep(2)
    assert not running(), "the vLLM server outlived the trainer"


@pytest.mark.slow
def test_a_reward_that_fails_on_half_the_samples_stops_the_run_in_one_line(tiny_model_dir, tmp_path):
    """A reward that raises on half the samples at random, groups of 8: an episode-count rule (stop when
    every episode fails) let the run go on training on the 1 group in 256 left whole, with a healthy
    reward_mean; the run now stops at the first step, on both ranks, in one line naming the exception
    (it goes on only if 3 of the 4 groups came through whole: about 1 run in 4 million)."""
    (tmp_path / "r.py").write_text("import random\n\n\ndef reward(prompt, completion, example):\n"
                                   "    if random.random() < 0.5:\n        raise KeyError('solution')\n"
                                   "    return 1.0\n")
    out = train(["--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path / "out"),
                 "--num_training_steps", "3", "--eval_freq", "0", "--reward_fn", f"{tmp_path}/r.py:reward",
                 "--num_unique_prompts_rollout", "4", "--num_samples_per_prompt_rollout", "8"],
                nproc=2, timeout=600)
    # no rank's traceback ("[rank0]: Traceback"); torchrun itself prints its summary of a rank's non-zero exit
    assert out.returncode != 0 and not re.search(r"\[rank\d\]:\s*Traceback", out.stderr), out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert lines and re.match(r"error: step 1: [34] of 4 groups left the batch with episodes that could not be "
                              r"scored \(more than unscored_stop=0.5 of them\); "
                              r"first: the reward: KeyError: 'solution'$", lines[0]), \
        out.stderr[-3000:]
    assert "Warning" not in out.stderr.split(lines[0], 1)[1], out.stderr[-3000:]  # nothing of ours after it
    assert not os.path.exists(tmp_path / "out" / "final")


def test_the_data_line_names_what_scores():
    """The data: line named exact_match when the environment scored its episodes itself."""
    from types import SimpleNamespace

    import train
    from config import Config
    from rewards import exact_match

    board = SimpleNamespace(scores=True, name="env.py:Board")
    assert train.what_scores(Config(environment="env.py:Board"), board, exact_match) == "env.py:Board's own"
    cfg = Config(environment="env.py:Board", reward_fn="r.py:fn")
    assert train.what_scores(cfg, board, exact_match) == "env.py:Board's own + r.py:fn"
    assert train.what_scores(Config(), SimpleNamespace(scores=False), exact_match) == "exact_match"
