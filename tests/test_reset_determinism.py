"""A reset must give the prompt it was rendered from (envs/calls.py, envs/environment.py). The prompt is
rendered once at load time from reset(row); every episode resets again in its worker. A Gym-style
environment whose unseeded reset draws a random board is refused at start-up in one line; the same
class taking a `seed` is given one derived from the row and plays the board its prompt showed; and a
reset that drifts after start-up is caught in each episode (tool_reset_mismatch, ours)."""

import pytest

from config import Config
from data import tokenize_rows
from envs.calls import row_seed
from envs.environment import Environment
from helpers import ScriptedClient

PUZZLE = '''
import os, random


class Puzzle:
    """A 15-puzzle: the policy is shown a shuffled board. Unseeded, reset draws a new board on every
    call, as Gym-style libraries (TextArena's FifteenPuzzle) do."""

    def reset(self, row):
        return self.deal(row, random.Random())

    def deal(self, row, rng):
        self.board = rng.sample(range(16), 16)
        return [{"role": "user", "content": f"{row['prompt']} {self.shown()}"}]

    def shown(self):
        return " ".join(str(n) for n in self.board)

    def step(self, row, messages):  # the board this episode's instance holds, once
        return [] if len(messages) > 2 else [{"role": "user", "content": f"board {self.shown()}"}]


class SeededPuzzle(Puzzle):
    def reset(self, row, seed=None):
        return self.deal(row, random.Random(seed))


class Drifting:
    """The same messages for its first two resets (start-up's check), another board after."""

    def reset(self, row):
        path = os.path.join(os.path.dirname(__file__), "count")  # beside this file: every process counts
        n = int(open(path).read()) + 1 if os.path.exists(path) else 1
        with open(f"{path}.{os.getpid()}", "w") as f:  # replaced whole: a worker reading it beside another's
            f.write(str(n))  # write never sees it empty (and counts from 1: board A)
        os.replace(f"{path}.{os.getpid()}", path)
        return [{"role": "user", "content": f"{row['prompt']} board {'A' if n <= 2 else 'B'}"}]

    def step(self, row, messages):
        return []
'''


def load(tmp_path, tiny_model_dir, name, workers=0):
    """The environment `name` of PUZZLE and a Config, as train.py makes them before the prompts."""
    from transformers import AutoTokenizer

    (tmp_path / "env.py").write_text(PUZZLE)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = Config(environment=f"{tmp_path}/env.py:{name}", tool_workers=workers, tool_timeout=20.0,
                 max_prompt_length=200, response_length=256, max_turns=3, num_samples_per_prompt_rollout=2)
    return Environment(cfg.environment, tok, cfg), tok, cfg


def test_an_unseeded_random_reset_is_refused_at_start_up_in_one_line(tiny_model_dir, tmp_path):
    env, tok, cfg = load(tmp_path, tiny_model_dir, "Puzzle")
    with pytest.raises(ValueError) as e:
        tokenize_rows([dict(prompt="Solve:", answer="x")], tok, cfg, env)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"environment={cfg.environment!r} is not deterministic: "), line
    assert "seed your reset (take a `seed` parameter" in line and "derive its state from the row" in line, line


@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=pytest.mark.subprocess)])
def test_a_seeded_reset_plays_the_board_its_prompt_showed(tiny_model_dir, tmp_path, workers):
    """Seeded by the row: accepted at start-up, the same board in the prompt and in each episode's
    instance (its step shows the board it holds), a different board for a different row."""
    import random

    env, tok, cfg = load(tmp_path, tiny_model_dir, "SeededPuzzle", workers)
    rows = [dict(prompt="Solve:", answer="x"), dict(prompt="Solve this:", answer="y")]
    rows, _ = tokenize_rows(rows, tok, cfg, env)
    boards = [" ".join(map(str, random.Random(row_seed(r)).sample(range(16), 16))) for r in rows]  # by hand
    assert [r["messages"][0]["content"] for r in rows] == [f"Solve: {boards[0]}", f"Solve this: {boards[1]}"]
    assert boards[0] != boards[1]
    env.start()
    try:
        episodes, stats = env.play(ScriptedClient(tok, ["left", "up"]), rows, 2, 0, cfg.temperature)
    finally:
        env.close()
    assert stats["tool_failures"] == [] and all(e.failure is None for e in episodes)
    assert [e.messages[2]["content"] for e in episodes] == [f"board {b}" for b in boards for _ in range(2)]


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.subprocess)])
def test_a_reset_that_drifts_after_start_up_is_caught_in_each_episode(tiny_model_dir, tmp_path, workers):
    """Start-up's two resets agree; the episodes' resets give another board: each episode ends unscored,
    counted as tool_reset_mismatch (ours), naming both boards and the fix."""
    env, tok, cfg = load(tmp_path, tiny_model_dir, "Drifting", workers)
    rows, _ = tokenize_rows([dict(prompt="Solve:", answer="x")], tok, cfg, env)
    assert rows[0]["messages"] == [{"role": "user", "content": "Solve: board A"}]
    env.start()
    try:
        episodes, stats = env.play(ScriptedClient(tok, ["left", "up"]), rows, 2, 0, cfg.temperature)
    finally:
        env.close()
    assert [kind for kind, _ in stats["tool_failures"]] == ["tool_reset_mismatch"] * 2, stats["tool_failures"]
    for e in episodes:
        assert e.failure.startswith("its environment call failed (tool_reset_mismatch): reset gave 'Solve: board B' "
                                    "where the prompt was rendered from 'Solve: board A' (message 0); seed your "
                                    "reset"), e.failure
