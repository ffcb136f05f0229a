"""The math reward on hand-written completions, gold answers in GSM8K and MATH form, the
built-in math task (answers recomputed from the words), and a GSM8K-format file."""

import json
import os
import re

import pytest

import data
import rewards
from infra import user_code
from config import Config
from helpers import recompute
from infra.worker_pool import RewardPool

GSM8K_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "gsm8k_sample.jsonl")


@pytest.mark.parametrize("completion,gold,strict,lenient", [
    ("So the answer is \\boxed{12}.", "12", 1, 1),                        # boxed
    ("12 + 0 = 12\n#### 12", "12", 1, 1),                                   # GSM8K marker
    ("\\boxed{\\frac{3}{4}}", "0.75", 1, 1),                                # nested braces, a fraction = a decimal
    ("\\boxed{3/4}", "\\frac{3}{4}", 1, 1),
    ("\\boxed{\\dfrac{1}{2}} not \\boxed{7}", "7", 1, 1),                   # the last box counts
    ("\\boxed{1,000}", "1000", 1, 1),
    ("\\boxed{13}", "12", 0, 0),                                            # wrong
    ("I get 13, so \\boxed{12", "12", 0, 1),                                # malformed: the box never closes; last number 12
    ("The total is 12 apples.", "12", 0, 1),                                # no marked answer: only the lenient one reads 12
    ("I do not know.", "12", 0, 0),                                         # no answer at all
    ("", "12", 0, 0),
    ("\\boxed{}", "12", 0, 0),
    ("\\boxed{x^{2}}", "x^2", 1, 1),                                        # braces inside the answer
    ("#### 12", "Add them: 5 + 7 = <<5+7=12>>12.\n#### 12", 1, 1),          # gold in GSM8K form
    ("\\boxed{\\frac{1}{3}}", "so $x = \\boxed{\\frac{1}{3}}$.", 1, 1),      # gold in MATH form
])
def test_math_reward_on_hand_written_completions(completion, gold, strict, lenient):
    assert rewards.math_reward("", completion, {"answer": gold}) == strict
    assert rewards.math_reward_last_number("", completion, {"answer": gold}) == lenient


@pytest.mark.parametrize("text,expected", [
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"), ("a \\boxed{1} b \\boxed{{2}}", "{2}"), ("\\boxed{1", None),
    ("no box", None), ("\\boxed{ 5 }", "5"),
])
def test_last_boxed(text, expected):
    assert rewards.last_boxed(text) == expected


def test_gold_and_format():
    assert rewards.gold_answer("steps\n#### 1,000") == "1,000" and rewards.gold_answer(7) == "7"
    assert rewards.gold_answer("so \\boxed{\\frac{1}{3}}.") == "\\frac{1}{3}"
    assert rewards.has_answer_format("\\boxed{3}") and rewards.has_answer_format("#### 3")
    assert not rewards.has_answer_format("3") and not rewards.has_answer_format("\\boxed{3")


@pytest.mark.parametrize("digits,operations,steps", [(1, "+-", 1), (2, "+-*", 3), (3, "-", 4)])
def test_math_task_answers_follow_the_words(digits, operations, steps):
    rows = data.task_rows("math", 200, 5, "train", digits=digits, operations=operations, steps=steps)
    assert rows == data.task_rows("math", 200, 5, "train", digits=digits, operations=operations, steps=steps)
    for row in rows:
        (message,) = row["prompt"]
        q = message["content"]
        assert message["role"] == "user" and q.endswith(data.BOXED)
        assert int(row["answer"]) == recompute(q) >= 0
        numbers = [int(x) for x in re.findall(r"\d+", q)]
        assert max(numbers) < 10 ** digits or "*" in operations
        assert sum(q.count(w) for w in (" more", "gives away", "loses", "times as many")) == steps
    evals = data.task_rows("math", 50, 5, "eval", digits=digits, operations=operations, steps=steps)
    assert not {json.dumps(r["prompt"]) for r in rows} & {json.dumps(r["prompt"]) for r in evals}


@pytest.mark.parametrize("completion,gold,expected", [
    ("<calc>193 + 600</calc> \\boxed{793}", "793", 1.0), ("\\boxed{193 + 600}", "793", 0.0),  # computed, not boxed
    ("\\boxed{ -12 }", "-12", 1.0), ("\\boxed{1,000}", "1000", 1.0), ("\\boxed{792}", "793", 0.0),
    ("793", "793", 0.0), ("\\boxed{2.5}", "2.5", 1.0)])
def test_number_reward_wants_a_boxed_number(completion, gold, expected):
    assert rewards.number_reward("", completion, {"answer": gold}) == expected


@pytest.mark.parametrize("digits,operations,steps", [(3, "+-*", 1), (2, "+-*", 3)])
def test_calc_task_answers_are_the_expressions_values(digits, operations, steps):
    rows = data.task_rows("calc", 200, 5, "train", digits=digits, operations=operations, steps=steps)
    for row in rows:
        (message,) = row["prompt"]
        expression = re.fullmatch(r"What is (.*)\?", message["content"]).group(1)
        terms = expression.split(" ")
        assert len(terms) == 2 * steps + 1 and set(terms[1::2]) <= set(operations)
        factors = [int(terms[i + 1]) for i in range(1, len(terms), 2) if terms[i] == "*"]
        assert all(10 <= f <= 99 for f in factors)
        assert all(len(t) == digits for i, t in enumerate(terms[::2]) if not (i and terms[2 * i - 1] == "*"))
        assert int(row["answer"]) == eval(expression)  # noqa: S307 - digits and + - * only, checked above
    evals = data.task_rows("calc", 50, 5, "eval", digits=digits, operations=operations, steps=steps)
    assert not {json.dumps(r["prompt"]) for r in rows} & {json.dumps(r["prompt"]) for r in evals}


def test_math_task_through_the_config(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = Config(dataset="math", math_digits=2, math_operations="+-*", math_steps=2, max_prompt_length=512)
    train, evals, skipped, reward_fn = data.load_prompts(cfg, tok)
    assert reward_fn is rewards.math_reward and len(evals) == cfg.num_eval_prompts and len(train) >= 4096
    assert train[0]["prompt_text"].startswith("<|im_start|>user\n")
    for bad in (dict(math_operations="+/"), dict(math_operations=""), dict(math_digits=0), dict(math_steps=0)):
        with pytest.raises(ValueError, match="math_"):
            Config(dataset="math", **bad)


def test_a_gsm8k_file_loads_and_scores_with_the_math_reward(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = Config(dataset=GSM8K_FILE, dataset_prompt_column="question", reward_fn="rewards:math_reward",
                 num_eval_prompts=1, max_prompt_length=512)
    train, evals, skipped, reward_fn = data.load_prompts(cfg, tok)
    assert reward_fn is rewards.math_reward and len(train) == 5 and len(evals) == 1
    golds = {"12", "90", "1,000", "3.5", "0", "7"}
    assert {rewards.gold_answer(r["answer"]) for r in train + evals} == golds
    for r in train + evals:
        gold = rewards.gold_answer(r["answer"])
        assert reward_fn(r["prompt_text"], f"The answer is \\boxed{{{gold}}}.", r) == 1.0
        assert reward_fn(r["prompt_text"], "Work...\n#### 11", r) == 0.0
    three_and_a_half = next(r for r in train + evals if "cakes" in r["prompt"])
    assert reward_fn("", "\\boxed{\\frac{7}{2}}", three_and_a_half) == 1.0


def ours_with_default(prompt, completion, example, scale=1.0):
    return scale


class Scorer:
    def __call__(self, prompt, completion, example):
        return 1.0


@pytest.mark.parametrize("fn,form", [
    (rewards.math_reward, "ours"), (ours_with_default, "ours"), (Scorer(), "ours"), (lambda *args: 1.0, "ours"),
    (lambda completions, **kwargs: [1.0], "trl"), (lambda prompts, completions, answer: [1.0], "trl"),
    (lambda completions: [1.0], "trl")])
def test_the_reward_form_is_read_off_the_signature(fn, form):
    assert user_code.reward_form(fn) == form


@pytest.mark.parametrize("source", ["def r(x):\n    return 1.0\n", "def r(prompt, completion):\n    return 1.0\n",
                                    "def r(prompt, completion, example, *, k):\n    return 1.0\n",
                                    "def r(**kwargs):\n    return [1.0]\n"])
def test_a_reward_that_fits_neither_form_is_refused_at_load(tmp_path, source):
    """Before: accepted, and every sample of every step failed with a TypeError while the run went on."""
    from infra.worker_pool import RewardPool

    f = tmp_path / "r.py"
    f.write_text(source)
    for load in (user_code.load_reward_fn, lambda spec: RewardPool(spec, workers=0)):
        with pytest.raises(ValueError) as e:
            load(f"{f}:r")
        line = str(e.value)
        assert "\n" not in line and "fits neither" in line and "reward(prompt, completion, example)" in line
        assert "reward(completions, **kwargs)" in line


def test_a_trl_reward_that_names_a_missing_column_is_refused_at_load(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    f = tmp_path / "r.py"
    f.write_text("def r(completions, solution):\n    return [float(c == s) for c, s in zip(completions, solution)]\n")
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match="takes 'solution', which is no column of the dataset \\(columns: answer\\)"):
        data.load_prompts(Config(dataset="add", reward_fn=f"{f}:r"), tok)
    f.write_text("def r(completions, answer):\n    return [float(c == a) for c, a in zip(completions, answer)]\n")
    assert data.load_prompts(Config(dataset="add", reward_fn=f"{f}:r"), tok)[3].__name__ == "r"


def several_rewards(tmp_path):
    """Two reward files, ours and TRL's form: the spec --reward_fn takes for both."""
    (tmp_path / "a.py").write_text("def length(prompt, completion, example):\n    return float(len(completion))\n")
    (tmp_path / "b.py").write_text("def starts_x(completions, **kwargs):\n"
                                   "    return [None if c == 'skip' else float(c.startswith('x')) for c in completions]\n"
                                   "def never(completions, **kwargs):\n    return [None for _ in completions]\n")
    return f"{tmp_path}/a.py:length,{tmp_path}/b.py:starts_x"


@pytest.mark.parametrize("workers", [0, pytest.param(1, marks=pytest.mark.subprocess)])
def test_several_rewards_with_weights_as_trl_users_write_them(tmp_path, workers):
    """--reward_fn a.py:f,b.py:g (our form and TRL's, mixed) with reward_weights: a sample's reward is the
    weighted sum, a None counts in no sum (TRL's rule), and each function's values come back apart (a step
    logs rewards/NAME/mean); all None is unscored and counted. Before: the list was read as one module path."""
    pool = RewardPool(several_rewards(tmp_path), workers=workers, weights=[0.5, 2.0])
    try:
        values, counts, first = pool.score(["p"] * 3, ["xab", "ab", "skip"], [{}] * 3)
    finally:
        pool.close()
    assert values == [0.5 * 3 + 2.0 * 1, 0.5 * 2 + 2.0 * 0, 0.5 * 4] and first is None
    assert counts["rewards/length"] == [3.0, 2.0, 4.0] and counts["rewards/starts_x"] == [1.0, 0.0]
    nothing = RewardPool(f"{tmp_path}/b.py:starts_x, {tmp_path}/b.py:never", workers=0)  # weights 1 each
    values, counts, first = nothing.score(["p"] * 2, ["x", "skip"], [{}] * 2)
    assert values[0] == 1.0 and values[1] != values[1] and counts["reward_none"] == 1 and first.startswith("sample 1")
    twice = RewardPool(f"{tmp_path}/a.py:length,{tmp_path}/a.py:length", workers=0)  # one name twice: logged apart
    assert twice.score(["p"], ["ab"], [{}])[1]["rewards/length_1"] == [2.0]


def test_reward_weights_are_refused_in_one_line_when_they_do_not_fit(tmp_path):
    spec = several_rewards(tmp_path)
    with pytest.raises(ValueError, match="reward_weights has 1 weights for the 2 reward_fn function"):
        Config(reward_fn=spec, reward_weights=[1.0])
    with pytest.raises(ValueError, match="reward_weights act only with reward_fn set"):
        Config(reward_weights=[1.0])
    with pytest.raises(ValueError, match="names no function"):
        Config(reward_fn=" , ")
    (tmp_path / "old.py").write_text("from no_such_module import x\n\ndef f(prompt, completion, example):\n"
                                     "    return 0.0\n")
    with pytest.raises(ValueError, match="cannot import .*old.py.*'no_such_module'.*fix the file's imports"):
        user_code.load_reward_fns(f"{tmp_path}/old.py:f")
    with pytest.raises(ValueError, match=r"reward_fn file '.*nowhere.py' does not exist"):
        user_code.load_reward_fns(f"{tmp_path}/a.py:length,{tmp_path}/nowhere.py:f")
