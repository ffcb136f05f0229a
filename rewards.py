"""The built-in reward functions, in our form: reward(prompt, completion, example) -> a number, where
`example` is the dataset row (its "answer" is the gold answer). A reward of your own may be in this
form or TRL's; user_code.Reward tells them apart and calls either, and worker_pool.py runs it in
worker processes with a timeout, so a reward that hangs, crashes or raises leaves its sample
unscored (rollout.score: its group is not trained on) and cannot stop the run.

Math answers (the built-in `math` task, GSM8K and MATH style files):
  math_reward              the answer in the completion's last \\boxed{...} (nested braces
                           allowed), else after its last GSM8K-style `#### `; no such
                           answer scores 0. Compared with the gold answer by math-verify
                           (`parse` then `verify`: 3/4 = \\frac{3}{4} = 0.75, 1,000 = 1000).
  math_reward_last_number  the same, but a completion with neither takes its last number:
                           for models that rarely box their answer (SmolLM2-135M boxes
                           about one answer in six when asked).
The gold answer is read the same way from example["answer"] (a GSM8K solution ending in
`#### 72`, a MATH solution with \\boxed{}, or the bare answer). math-verify's own timeouts
use signals, which fail outside the main thread; they are switched off here and the
pool's per-sample timeout guards instead.
"""

import logging
import re


# math-verify warns once per process that its timeouts are off; the pool is the guard
logging.getLogger("math_verify").setLevel(logging.ERROR)

# --- built-in task rewards


def copy_reward(prompt, completion, example):
    """Fraction of answer characters reproduced in place; extra characters cost too."""
    answer = example["answer"]
    hits = sum(a == c for a, c in zip(answer, completion))
    return hits / max(len(answer), len(completion), 1)


def exact_match(prompt, completion, example):
    """1.0 when the completion's first line, stripped, equals the answer."""
    first_line = completion.strip().split("\n")[0].strip()
    return float(first_line == str(example["answer"]).strip())


# --- math answers


def last_boxed(text):
    """Content of the last \\boxed{...} in text, braces matched (\\boxed{\\frac{1}{2}} -> \\frac{1}{2});
    None when there is none or it is not closed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j].strip()
    return None


NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")  # 7, -12, 1,000, 2.5


def marked_answer(text):
    """The answer a solution marks: its last \\boxed{} content, else what follows its last
    `####` up to the end of that line (GSM8K). None when neither is there."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().split("\n")[0].strip() or None
    return None


def has_answer_format(completion):
    """True when the completion marks an answer (\\boxed{} or ####): what format_reward pays for."""
    return marked_answer(completion) is not None


def gold_answer(answer):
    """The gold answer from a dataset's answer field: marked (#### or \\boxed{}) or bare."""
    text = str(answer)
    return marked_answer(text) or text.strip()


def same_answer(gold, pred):
    """math-verify's judgement of two answer strings (no signal timeouts: see the docstring)."""
    from math_verify import parse, verify

    g, p = (parse("\\boxed{" + s + "}", parsing_timeout=None) for s in (gold, pred))
    return bool(g) and bool(p) and verify(g, p, timeout_seconds=None)


def math_reward(prompt, completion, example):
    """1.0 when the completion's \\boxed{} (or ####) answer equals the gold answer, else 0.0."""
    pred = marked_answer(completion)
    return float(pred is not None and same_answer(gold_answer(example["answer"]), pred))


def math_reward_last_number(prompt, completion, example):
    """math_reward, falling back to the completion's last number when no answer is marked."""
    pred = marked_answer(completion)
    if pred is None:
        numbers = NUMBER.findall(completion)
        pred = numbers[-1] if numbers else None
    return float(pred is not None and same_answer(gold_answer(example["answer"]), pred))


def number_reward(prompt, completion, example):
    """1.0 when the completion's last \\boxed{} holds a plain number (7, -12, 1,000, 2.5) equal to
    the gold answer. An expression does not count: math-verify would accept \\boxed{193 + 600} for
    793, and a calculator environment's policy must compute, not box the question."""
    pred = last_boxed(completion)
    if pred is None or NUMBER.fullmatch(pred) is None:
        return 0.0
    gold = gold_answer(example["answer"]).replace(",", "")
    return float(NUMBER.fullmatch(gold) is not None and float(pred.replace(",", "")) == float(gold))
