"""Generation ahead of training (async_steps): the producer's order and bounds, errors, and
a 2-rank run with async_steps=1 against a real vLLM CPU server."""

import json
import threading
import time

import pytest

from infra.generator import Rollouts, drop_stale
from episodes import Sample
from helpers import train


def test_batches_come_in_order_and_at_most_k_steps_ahead():
    taken_when_made, lock = {}, threading.Lock()

    for ahead in (0, 1, 3):
        r = None

        def make(j):
            with lock:
                taken_when_made[j] = r.taken if r else 0
            time.sleep(0.01)
            return j

        r = Rollouts(make, 1, 12, ahead)
        time.sleep(0.1)  # a producer that ignored the bound would run far ahead here
        for step in range(1, 13):
            assert r.get(step) == step
            time.sleep(0.005)  # "training"
        r.close()
        assert sorted(taken_when_made) == list(range(1, 13))
        assert max(j - t for j, t in taken_when_made.items()) == ahead  # batch j waits for step j - k (0: made in get)
        taken_when_made.clear()


def test_an_error_while_making_a_batch_is_raised_for_that_step():
    def make(j):
        if j == 3:
            raise RuntimeError("server gone")
        return j

    r = Rollouts(make, 1, 10, 2)
    assert (r.get(1), r.get(2)) == (1, 2)
    with pytest.raises(RuntimeError, match="server gone"):
        r.get(3)
    r.close()


def test_stale_samples_are_labelled_and_dropped_by_whole_groups():
    samples = [Sample([1], [2], [-1.0], versions=(v, v + 1)) for v in (5, 5, 4, 4, 3, 3)]  # the first turn counts
    kept, m = drop_stale(samples, 5, 1, 2)
    assert [s.staleness for s in kept] == [0, 0, 1, 1]
    assert m == dict(staleness_mean=1.0, stale_dropped=2)
    # each episode is its own request: an update between two first turns of a group drops it whole
    samples = [Sample([1], [2], [-1.0], versions=(v,)) for v in (5, 4, 4, 3, 5, 5)]
    kept, m = drop_stale(samples, 5, 1, 2)
    assert [s.versions for s in kept] == [(5,), (4,), (5,), (5,)] and m["stale_dropped"] == 2


@pytest.mark.slow
def test_two_ranks_learn_with_generation_one_step_ahead(tiny_model_dir, tmp_path):
    out = train(["--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path), "--num_training_steps", "40",
                 "--eval_freq", "0", "--seed", "3", "--async_steps", "1",
                 "--truncated_importance_sampling_ratio_cap", "2.0"], nproc=2, timeout=1200)
    assert out.returncode == 0, out.stderr[-4000:]
    steps = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in steps] == list(range(1, 41))
    # Step 1 was made from the start weights. Later batches are requested while the step before
    # trains: a group whose request goes out before that step's weight sync is one update behind,
    # one sent after it (a race the machine's load decides) is not. After a step with no update
    # (every group filtered) nothing can be behind.
    assert steps[0]["staleness_mean"] == 0 and all(0 <= r["staleness_mean"] <= 1 for r in steps)
    assert all(r["staleness_mean"] == 0 for prev, r in zip(steps, steps[1:]) if "trained_tokens" not in prev)
    # generation did run ahead: 0.66 (a busy machine) and 0.98 of the groups were behind in two runs
    assert sum(r["staleness_mean"] for r in steps) / len(steps) > 0.25
    assert all(r["stale_dropped"] == 0 for r in steps)
    first = sum(r["reward_mean"] for r in steps[:10]) / 10
    last = sum(r["reward_mean"] for r in steps[-10:]) / 10
    assert last > first + 0.03, (first, last)
