"""Environments others wrote: SkyRL-Gym's environments by id (envs/skyrl_gym_adapter.py), on the real
package: a scripted gsm8k_multi_turn episode whose reward is the sum of the environment's turn-level
rewards, a dataset's answer column as its ground truth, and train.py training 2 steps on the tiny model
and a real vLLM server with the sync check holding."""

import pytest

from config import Config
from envs.environment import Environment
from helpers import family_tokenizer, metrics, ScriptedClient, train, with_prompts

pytest.importorskip("skyrl_gym", reason="skyrl-gym is installed by scripts/install.sh (the envs extra)")


def play(spec, script, max_turns):
    tok = family_tokenizer("qwen2.5-instruct")
    cfg = Config(environment=spec, tool_workers=0, max_prompt_length=500, response_length=400, max_turns=max_turns)
    env = Environment(cfg.environment, tok, cfg)
    env.start()
    try:
        rows = with_prompts(env, tok, [dict(prompt="What is 2 + 2?", answer="4")])
        assert rows[0]["messages"] == [{"role": "user", "content": "What is 2 + 2?"}]
        episodes, stats = env.play(ScriptedClient(tok, script, eos_id=tok.eos_token_id), rows, 2, 0, 1.0)
    finally:
        env.close()
    assert stats["tool_failures"] == [] and not any(e.failure for e in episodes)
    return episodes


def test_turn_level_rewards_add_up_to_the_episodes():
    """gsm8k_multi_turn (5 turns): a wrong answer in its format earns 0.2 / 5 and the environment's next
    instruction, the right one 1 and the end: 1.04. The row's answer is the ground truth."""
    episodes = play("envs.skyrl_gym_adapter:gsm8k_multi_turn", ["#### 3", "#### 4"], max_turns=5)
    assert [m["content"] for m in episodes[0].messages[1:]] == [
        "#### 3", "Please provide your step-by-step reasoning, and also include a tentative numeric answer at the "
        "end in the exact format: '#### ANSWER'.", "#### 4"]
    assert [e.env_reward for e in episodes] == [pytest.approx(0.2 / 5 + 1.0)] * 2


def test_a_turn_max_turns_cut_off_is_scored_by_the_environment():
    """max_turns 1 ends a 5-turn environment's episode after the first turn, which it still scores."""
    episodes = play("envs.skyrl_gym_adapter:gsm8k_multi_turn", ["#### 4"], max_turns=1)
    assert [e.env_reward for e in episodes] == [1.0, 1.0] and [e.turns for e in episodes] == [1, 1]
    assert [e.env_reward for e in play("envs.skyrl_gym_adapter:gsm8k", ["4"], max_turns=1)] == [0.0, 0.0]


def test_an_unknown_id_is_refused_in_one_line():
    with pytest.raises(ValueError, match="has no environment 'gsm9k'"):
        Environment("envs.skyrl_gym_adapter:gsm9k", family_tokenizer("qwen2.5-instruct"), Config())


@pytest.mark.slow
def test_train_two_steps_on_a_skyrl_gym_environment(tiny_model_dir, tmp_path):
    """--environment envs.skyrl_gym_adapter:gsm8k_multi_turn on the built-in math rows (their answer is the
    ground truth), with no glue: 2 steps on the tiny model, every episode scored, the server's logprobs
    the trainer's."""
    out = train([
        "--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path / "out"), "--num_training_steps", "2",
        "--eval_freq", "0", "--seed", "5", "--environment", "envs.skyrl_gym_adapter:gsm8k_multi_turn", "--dataset",
        "math", "--max_turns", "2", "--max_prompt_length", "256", "--response_length", "256",
        "--num_unique_prompts_rollout", "2", "--num_samples_per_prompt_rollout", "2", "--tool_workers", "2",
        "--filter_zero_std_samples", "false"])
    assert out.returncode == 0, out.stderr[-4000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2], rows
    for r in rows:
        assert r["unscored_groups"] == 0 and 1 <= r["turns"] <= 2 and r["trained_tokens"] > 0, r
        assert 0 < r["vllm_logp_diff_max"] < 1e-4, r
    assert any(r["turns"] > 1 for r in rows), rows  # the environment answered a turn: a second one was played
