"""Environments others wrote: reasoning-gym's datasets by name (envs/reasoning_gym_adapter.py), on the real
package: the item a row's seed draws is its prompt, the dataset's own score_answer of the answer in tags
is the reward, a subclass's config reaches the dataset, and train.py trains 2 steps on the tiny model and
a real vLLM server with the sync check holding."""

import pytest

from config import Config
from envs.environment import Environment
from helpers import family_tokenizer, metrics, ScriptedClient, train, with_prompts

pytest.importorskip("reasoning_gym", reason="reasoning-gym is installed by scripts/install.sh (the envs extra)")

LEGS = "envs.reasoning_gym_adapter:leg_counting"
# leg_counting's item 0 of seed 5, its legs counted by hand: butterflies 3 * 6, crabs 2 * 10, sea slugs 6 * 0,
# praying mantises 8 * 6, giraffes 14 * 4, flatworms 4 * 0, cockroaches 7 * 6
QUESTION = "3 butterflys, 2 crabs, 6 sea slugs, 8 praying mantiss, 14 giraffes, 4 flatworms, 7 cockroachs"
LEGS_5 = 3 * 6 + 2 * 10 + 6 * 0 + 8 * 6 + 14 * 4 + 4 * 0 + 7 * 6


def play(spec, rows, script):
    tok = family_tokenizer("qwen2.5-instruct")
    cfg = Config(environment=spec, tool_workers=0, max_prompt_length=1000, response_length=100)
    env = Environment(cfg.environment, tok, cfg)
    env.start()
    try:
        rows = with_prompts(env, tok, rows)
        episodes, stats = env.play(ScriptedClient(tok, script, eos_id=tok.eos_token_id), rows, 2, 0, 1.0)
    finally:
        env.close()
    assert stats["tool_failures"] == [] and not any(e.failure for e in episodes)
    return rows, episodes


@pytest.mark.parametrize("reply, reward", [(f"<answer>{LEGS_5}</answer>", 1.0), (f"{LEGS_5}", 0.0),
                                           (f"<answer>{LEGS_5 + 1}</answer>", 0.0)], ids=["right", "untagged", "wrong"])
def test_the_rows_item_is_asked_and_scored_by_its_dataset(reply, reward):
    """Seed 5's item is the prompt, after reasoning-gym's system prompt; one turn, scored by score_answer
    of the tagged answer."""
    rows, episodes = play(LEGS, [dict(prompt="", seed=5)], [reply])
    system, user = rows[0]["messages"]
    assert system["role"] == "system" and "<answer>answer here</answer>" in system["content"]
    assert user["role"] == "user" and QUESTION in user["content"]
    assert [e.env_reward for e in episodes] == [reward, reward] and [e.turns for e in episodes] == [1, 1]


def test_rows_pick_their_items_and_a_subclass_sets_the_datasets_config(tmp_path):
    from envs.reasoning_gym_adapter import __getattr__ as by_name

    legs = by_name("leg_counting")

    def question(row, **seed):
        return legs().reset(row, **seed)[1]["content"]

    assert question(dict(prompt="a")) == question(dict(prompt="a")) != question(dict(prompt="b"))
    assert question(dict(prompt="a"), seed=5) == question(dict(prompt="b", seed=5)) != question(dict(prompt="b"))
    (tmp_path / "legs.py").write_text("from envs.reasoning_gym_adapter import ReasoningGym\n\n\n"
                                      "class Legs(ReasoningGym):\n"
                                      "    name, config = 'leg_counting', dict(min_animals=2, max_animals=2)\n")
    rows, _ = play(f"{tmp_path}/legs.py:Legs", [dict(prompt="", seed=s) for s in range(4)], ["<answer>0</answer>"])
    assert all(r["messages"][1]["content"].split("if you have ")[1].count(",") == 1 for r in rows)  # 2 animals
    with pytest.raises(ValueError, match="has no environment 'leg_countin'"):
        Environment("envs.reasoning_gym_adapter:leg_countin", family_tokenizer("qwen2.5-instruct"), Config())


@pytest.mark.slow
def test_train_two_steps_on_a_reasoning_gym_dataset(tiny_model_dir, tmp_path):
    """--environment envs.reasoning_gym_adapter:leg_counting with no glue: 2 steps on the tiny model,
    every episode scored, the server's logprobs the trainer's."""
    out = train([
        "--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path / "out"), "--num_training_steps", "2",
        "--eval_freq", "0", "--seed", "5", "--environment", LEGS, "--dataset", "copy", "--max_prompt_length", "1024",
        "--response_length", "64", "--num_unique_prompts_rollout", "2", "--num_samples_per_prompt_rollout", "2",
        "--tool_workers", "2", "--filter_zero_std_samples", "false"])
    assert out.returncode == 0, out.stderr[-4000:]
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2], rows
    for r in rows:
        assert r["unscored_groups"] == 0 and r["turns"] == 1 and r["trained_tokens"] > 0, r
        assert 0 < r["vllm_logp_diff_max"] < 1e-4, r
