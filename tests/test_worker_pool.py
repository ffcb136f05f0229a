"""The reward pool: rewards that hang, kill their own process or raise score NaN, are counted,
and scoring goes on with fresh workers (a hung worker's children end with it; a worker that
died idle is replaced without a failure); every number type a reward may return is accepted."""

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

import rewards
from infra.worker_pool import RewardPool

pytestmark = pytest.mark.subprocess  # every test here starts processes (ranks, workers)


def misbehaving(prompt, completion, example):
    """The completion as a number, except for completions that hang, die or raise."""
    if completion == "hang":
        time.sleep(3600)
    if completion == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    if completion == "raise":
        raise RuntimeError("bad reward")
    if completion == "slow raise":
        time.sleep(1.0)
        raise ValueError("slow bad reward")
    if completion.startswith("spawn "):  # a child that outlives its call: sleep 300, its pid in a file
        import subprocess

        child = subprocess.Popen(["sleep", "300"])
        open(completion.split(" ", 1)[1], "w").write(str(child.pid))
        time.sleep(3600)
    return float(completion)


def typed(prompt, completion, example):
    """A value of the type the completion names."""
    import numpy as np  # here: workers load this file, and torch is slow to import
    import torch

    return {"bool": True, "np": np.float32(0.25), "npint": np.int64(3), "tensor": torch.tensor(0.5), "int": 2,
            "float": 0.75, "text": "1.0", "vector": torch.ones(2), "nan": float("nan")}[completion]


NAN = float("nan")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC, TYPED = (f"{os.path.abspath(__file__)}:{name}" for name in ("misbehaving", "typed"))


def run(pool, completions):
    return pool.score(["p"] * len(completions), completions, [{}] * len(completions))


@pytest.mark.parametrize("workers", [0, 2])
def test_every_number_type_is_a_reward(workers):
    pool = RewardPool(TYPED, workers=workers, timeout=60)
    try:
        values, counts, first = run(pool, ["bool", "np", "npint", "tensor", "int", "float", "text", "vector", "nan"])
    finally:
        pool.close()
    assert values == pytest.approx([1.0, 0.25, 3.0, 0.5, 2.0, 0.75, NAN, NAN, NAN], nan_ok=True)
    assert counts == dict(reward_errors=3, reward_timeouts=0, reward_crashes=0, reward_none=0)
    assert "TypeError" in first and "'1.0'" in first


def test_hang_crash_and_raise_score_nan_and_the_pool_goes_on():
    pool = RewardPool(SPEC, workers=2, timeout=5.0)
    try:
        batch = ["0.5", "hang", "1", "die", "raise", "0.25", "hang", "die", "2"]
        values, counts, first = run(pool, batch)
        assert values == pytest.approx([0.5, NAN, 1.0, NAN, NAN, 0.25, NAN, NAN, 2.0], nan_ok=True)
        assert counts == dict(reward_errors=1, reward_timeouts=2, reward_crashes=2, reward_none=0)
        assert first is not None
        alive = [w.proc.pid for w in pool.workers]
        assert len(alive) == 2 and all(w.proc.is_alive() for w in pool.workers)
        values, counts, first = run(pool, ["0.5"] * 20)  # the rebuilt workers score the next batch
        assert values == [0.5] * 20 and first is None and sum(counts.values()) == 0
    finally:
        pool.close()


def test_a_reward_that_cannot_load_in_a_worker_is_an_error(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("import os\nif os.getpid() != PARENT:\n    raise SystemExit(3)\ndef r(p, c, e):\n    return 1.0\n")
    f.write_text(f.read_text().replace("PARENT", str(os.getpid())))
    pool = RewardPool(f"{f}:r", workers=1, timeout=5)
    try:
        with pytest.raises(RuntimeError, match="cannot be loaded in a worker"):
            run(pool, ["x"])
    finally:
        pool.close()


def test_math_reward_in_the_pool_matches_serial():
    completions = ["\\boxed{7}", "#### 8", "so 7", "\\boxed{\\frac{14}{2}}", "\\boxed{7"]
    examples = [{"answer": "7"}] * 5
    pool = RewardPool(rewards.math_reward, workers=2, timeout=30)
    try:
        values, counts, _ = pool.score([""] * 5, completions, examples)
    finally:
        pool.close()
    assert values == [rewards.math_reward("", c, e) for c, e in zip(completions, examples)] == [1, 0, 0, 1, 0]


def running(pid):
    """True while pid is a live process (a zombie, killed and not yet reaped by init, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_timed_out_call_ends_its_children_with_it(tmp_path):
    pool = RewardPool(SPEC, workers=1, timeout=6.0)
    try:
        values, counts, _ = run(pool, [f"spawn {tmp_path}/pid", "1"])
        child = int((tmp_path / "pid").read_text())
        assert values == pytest.approx([NAN, 1.0], nan_ok=True) and counts["reward_timeouts"] == 1
        deadline = time.monotonic() + 10
        while running(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running(child)  # the worker's process group was killed, its sleep 300 with it
    finally:
        pool.close()


@pytest.mark.parametrize("when", ["idle", "loading"])
def test_a_worker_that_died_idle_is_replaced_without_a_failure(when):
    """Killed from outside (the kernel's OOM killer, say) while idle after a batch, or right after
    its start, before the pool has read its "ready": replaced, and no call fails."""
    pool = RewardPool(SPEC, workers=2, timeout=30.0)
    try:
        if when == "idle":  # one worker may have scored both (the other still loading): either is idle
            assert run(pool, ["1", "2"])[0] == [1.0, 2.0]
        for w in pool.workers:
            os.kill(w.proc.pid, signal.SIGKILL)
            w.proc.join()
        values, counts, first = run(pool, ["0.5", "1", "2"])
        assert values == [0.5, 1.0, 2.0] and sum(counts.values()) == 0 and first is None
        assert all(w.proc.is_alive() for w in pool.workers)
    finally:
        pool.close()


def test_the_first_failure_described_is_the_first_sample_s_whichever_worker_ends_first():
    """Sample 0 fails after 1 s, sample 1 at once in the other worker: sample 0's failure is the one
    described (it used to be whichever came first in time, so a run's printed failure varied)."""
    pool = RewardPool(SPEC, workers=2, timeout=30.0)
    try:
        run(pool, ["1", "2", "3", "4"])  # both workers loaded
        values, counts, first = run(pool, ["slow raise", "raise"])
    finally:
        pool.close()
    assert values == pytest.approx([NAN, NAN], nan_ok=True) and counts["reward_errors"] == 2
    assert first == "sample 0: ValueError: slow bad reward"


def trl_reward(completions, prompts, completion_ids, answer, **kwargs):
    """TRL's form, as GRPOTrainer calls it: 1 for the answer (a messages prompt's completion is one assistant
    message), 10 more for a messages prompt, 0.01 per completion token; None (not applicable) for "skip"."""
    assert kwargs.pop("trainer_state") is None and set(kwargs) <= {"level"}, kwargs  # no prompt_text, prompt_ids
    values = []
    for c, p, ids, a in zip(completions, prompts, completion_ids, answer, strict=True):
        if isinstance(p, list):
            assert len(c) == 1 and c[0]["role"] == "assistant", c
            c = c[0]["content"]
        values.append(None if c == "skip" else float(c == a) + 10 * isinstance(p, list) + 0.01 * len(ids))
    return values


def trl_kwargs_only(completions, **kwargs):
    """TRL's form with the dataset's columns read from **kwargs, a tuple back."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return tuple(float(t == s) * level for t, s, level in zip(texts, kwargs["solution"], kwargs["level"]))


def trl_wrong(completions, **kwargs):
    """What a TRL-form reward must not return for one completion."""
    return {"none": [], "number": 1.0, "two": [1.0, 1.0], "text": ["1"], "ok": [0.5]}[completions[0]]


TRL, TRL_KWARGS, TRL_WRONG = (f"{os.path.abspath(__file__)}:{name}" for name in ("trl_reward", "trl_kwargs_only",
                                                                                  "trl_wrong"))
CHAT = [{"role": "user", "content": "1+1="}]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_trl_reward_scores_standard_and_conversational_prompts(workers):
    """TRL's `reward(completions, **kwargs) -> list` runs unmodified: one-element lists per sample, the row's
    prompt as `prompts` (a string, or messages: then each completion is an assistant message), the sampled ids,
    the dataset's columns by name. None is "not applicable": the only reward of its sample, it leaves the sample
    unscored (NaN), counted and said (reward_none), where it used to score 0, a reward nobody earned; beside
    another reward (alone=False) it adds 0. Before: every sample a TypeError, scored 0."""
    rows = [dict(prompt="1+1=", answer="2", level=1, prompt_text="1+1=", prompt_ids=[1, 2]),
            dict(prompt=CHAT, answer="2", level=3, prompt_text="<chat>1+1=", prompt_ids=[5], completion="2")]
    examples, completions, ids = [rows[0], rows[1], rows[0], rows[1]], ["2", "2", "3", "skip"], [[7, 8], [7], [], [1]]
    pools = [RewardPool(spec, workers=workers, timeout=60) for spec in (TRL, TRL_KWARGS)]
    try:
        renamed = [dict(r, solution=r.pop("answer")) for r in [dict(r) for r in examples]]
        values, counts, first = pools[1].score(["p"] * 4, ["2", "3", "3", "2"], renamed)  # no completion_ids
        assert values == [1.0, 0.0, 0.0, 3.0] and first is None
        values, counts, first = pools[0].score([r["prompt_text"] for r in examples], completions, examples, ids)
        assert values == pytest.approx([1.02, 11.01, 0.0, NAN], nan_ok=True) and counts["reward_none"] == 1
        assert sum(counts.values()) == 1 and first == "sample 3: the reward returned None (not applicable), and no " \
                                                      "other reward scores the sample"
        values, counts, _ = pools[0].score([r["prompt_text"] for r in examples], completions, examples, ids,
                                           [True, True, True, False])
        assert values == [1.02, 11.01, 0.0, 0.0] and sum(counts.values()) == 0
    finally:
        for pool in pools:
            pool.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_trl_reward_that_returns_the_wrong_thing_is_an_error(workers):
    """A list of another length, a bare number or a non-number: counted and described with its type and
    message (the caller sees a call whose every sample failed: counts summing to the samples)."""
    pool = RewardPool(TRL_WRONG, workers=workers, timeout=60)
    try:
        values, counts, first = run(pool, ["none", "number", "two", "text", "ok"])
    finally:
        pool.close()
    assert values == pytest.approx([NAN, NAN, NAN, NAN, 0.5], nan_ok=True) and counts["reward_errors"] == 4
    assert first == "sample 0: ValueError: returned 0 values for 1 completion; a TRL-form reward returns one per " \
                    "completion"
    values, counts, first = RewardPool(TRL_WRONG, workers=0).score(["p"], ["number"], [{}])
    assert sum(counts.values()) == len(values) and first.startswith("sample 0: TypeError: returned 1.0, not a list")


def test_a_failed_sample_is_nan_unless_the_caller_says_otherwise():
    """A failed sample must never read as a real reward of 0. Before: RewardPool's fallback was 0.0 (train.py
    passed NaN, every other caller got 0)."""
    values, counts, _ = run(RewardPool(SPEC, workers=0), ["raise", "1"])
    assert values == pytest.approx([NAN, 1.0], nan_ok=True) and counts["reward_errors"] == 1
    assert run(RewardPool(SPEC, workers=0, fallback=-1.0), ["raise"])[0] == [-1.0]


def test_the_scratch_of_a_killed_trainer_goes_with_the_next_pool(tmp_path, monkeypatch):
    """A trainer killed by SIGKILL cannot remove its workers' scratch directories; the next pool made on
    the machine removes them (their owner is dead), and not those of a pool whose owner lives.
    Before: each killed run left them in /tmp."""
    code = ("import time\nfrom infra import worker_pool\n"
            "pool = worker_pool.RewardPool('rewards:number_reward', workers=1)\n"
            "print(pool.workers[0].scratch, flush=True)\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, TMPDIR=str(tmp_path)), cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    left = proc.stdout.readline().strip()
    proc.kill()
    proc.wait()
    assert os.path.isdir(left), left
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the next run's temporary directory: the same
    pools = [RewardPool(SPEC, workers=1, timeout=30)]
    try:
        assert not os.path.exists(left)
        pools.append(RewardPool(SPEC, workers=1, timeout=30))
        assert os.path.isdir(pools[0].workers[0].scratch)  # its owner, this process, lives
    finally:
        for pool in pools:
            pool.close()
