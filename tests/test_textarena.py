"""Environments others wrote: TextArena's games by id (envs/textarena_adapter.py), on the real package:
a scripted game of GuessTheNumber whose reward is the game's, the board of FifteenPuzzle (drawn at
random on every unseeded reset) the same at the prompt's render and in the episode, and train.py
training 2 steps on the tiny model and a real vLLM server with the sync check holding."""

import pytest

from config import Config
from envs.environment import Environment
from helpers import family_tokenizer, metrics, ScriptedClient, train, with_prompts

pytest.importorskip("textarena", reason="textarena is installed by scripts/install.sh (the envs extra)")

GUESS = "envs.textarena_adapter:GuessTheNumber-v0"


def test_a_game_is_played_turn_by_turn_and_pays_the_games_reward():
    """Seed 7 draws 11 (GuessTheNumber: 1 to 20): a low guess gets the game's hint, only what it added to
    its observation, and the right guess ends the game with its reward, 1; a guess out of range is
    warned once, and a second ends the game with 0."""
    tok = family_tokenizer("qwen2.5-instruct")
    cfg = Config(environment=GUESS, tool_workers=0, max_prompt_length=1500, response_length=400, max_turns=4,
                 num_samples_per_prompt_rollout=2)
    env = Environment(cfg.environment, tok, cfg)
    env.start()
    try:
        rows = with_prompts(env, tok, [dict(prompt="", seed=7), dict(prompt="", seed=7)])
        assert rows[0]["messages"][0]["content"].startswith("[GAME] You are Player 0. You are playing Guess The Number")
        won, _ = env.play(ScriptedClient(tok, ["[5]", "[11]"], eos_id=tok.eos_token_id), rows[:1], 1, 0, 1.0)
        lost, _ = env.play(ScriptedClient(tok, ["[50]", "[50]"], eos_id=tok.eos_token_id), rows[1:], 1, 0, 1.0)
    finally:
        env.close()
    (won,), (lost,) = won, lost
    assert [m["content"] for m in won.messages[1:]] == [
        "[5]", "[Player] [5]\n[GAME] The target number is higher.", "[11]"]
    assert won.env_reward == 1.0 and won.turns == 2 and won.failure is None
    assert lost.env_reward == 0.0 and lost.turns == 2 and lost.failure is None


def test_a_turn_max_turns_cut_off_is_judged_by_the_game():
    """max_turns 1 ends the episode after its first turn, before the game saw it: the game is stepped with
    it at the end, and the right guess wins (1) where an out-of-range one leaves the game undecided (0)."""
    tok = family_tokenizer("qwen2.5-instruct")
    cfg = Config(environment=GUESS, tool_workers=0, max_prompt_length=1500, response_length=400, max_turns=1)
    env = Environment(cfg.environment, tok, cfg)
    env.start()
    try:
        rows = with_prompts(env, tok, [dict(prompt="", seed=7)])
        won, _ = env.play(ScriptedClient(tok, ["[11]"], eos_id=tok.eos_token_id), rows, 2, 0, 1.0)
        undecided, _ = env.play(ScriptedClient(tok, ["[50]"], eos_id=tok.eos_token_id), rows, 2, 0, 1.0)
    finally:
        env.close()
    assert [e.env_reward for e in won] == [1.0, 1.0] and [e.env_reward for e in undecided] == [0.0, 0.0]
    assert not any(e.failure for e in won + undecided)


def test_a_random_board_is_the_rows_board_in_every_episode():
    """FifteenPuzzle draws its board on each reset; the adapter seeds it with the seed the trainer gives
    (envs/calls.row_seed: the row's "seed", else a hash of the row) or, called alone, the same rule, so the
    prompt's board is the one every episode plays."""
    from envs.calls import row_seed
    from envs.textarena_adapter import __getattr__ as by_id

    puzzle = by_id("FifteenPuzzle-v0")

    def board(row, **seed):
        return puzzle().reset(row, **seed)[0]["content"]

    assert board(dict(prompt="a")) == board(dict(prompt="a")) != board(dict(prompt="b"))
    assert board(dict(prompt="a", seed=3)) == board(dict(prompt="b", seed=3)) != board(dict(prompt="a", seed=4))
    assert board(dict(prompt="a"), seed=3) == board(dict(prompt="c", seed=3)) != board(dict(prompt="a"))  # given
    for row in (dict(prompt="a"), dict(prompt="b", seed=4)):  # what the trainer gives is the rule's own seed
        assert board(row, seed=row_seed(row)) == board(row)
    with pytest.raises(ValueError, match="has no environment 'NoSuchGame-v0'"):
        Environment("envs.textarena_adapter:NoSuchGame-v0", family_tokenizer("qwen2.5-instruct"), Config())


@pytest.mark.slow
def test_train_two_steps_on_a_textarena_game(tiny_model_dir, tmp_path):
    """--environment envs.textarena_adapter:GuessTheNumber-v0 with no glue: 2 steps on the tiny model, the
    game's prompt (about 560 characters: a token each for the tiny tokenizer) and its reward, every
    episode scored, the server's logprobs the trainer's."""
    out = train([
        "--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path / "out"), "--num_training_steps", "2",
        "--eval_freq", "0", "--seed", "5", "--environment", GUESS, "--dataset", "copy", "--max_turns", "2",
        "--max_prompt_length", "1024", "--response_length", "256", "--num_unique_prompts_rollout", "2",
        "--num_samples_per_prompt_rollout", "2", "--tool_workers", "2", "--filter_zero_std_samples", "false"])
    assert out.returncode == 0, out.stderr[-4000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2], rows
    for r in rows:
        assert r["unscored_groups"] == 0 and 1 <= r["turns"] <= 2 and r["trained_tokens"] > 0, r
        assert 0 < r["vllm_logp_diff_max"] < 1e-4, r
    assert any(r["turns"] > 1 for r in rows), rows  # the environment answered a turn: a second one was played
