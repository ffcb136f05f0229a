"""Reward functions: plain callables, in either of two forms, told apart by their signature at load.

    reward(prompt: str, completion: str, example: dict) -> a number                 # ours
    reward(completions, **kwargs) -> a list of numbers (or None), one per completion  # TRL's

Ours: `example` is the dataset row (its "answer" is the gold answer). A reward may return a
bool, int, float, numpy scalar or 0-d tensor (`to_float`); worker_pool.py runs it in
worker processes with a timeout, so a reward that hangs, crashes or raises leaves its sample
unscored (rollout.score: its group is not trained on) and cannot stop the run.
TRL's (GRPOTrainer's `reward_func(prompts=, completions=, completion_ids=, **columns)`): see
`Reward`, which calls either form one sample at a time.

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

import inspect
import logging
import math
import re

from user_code import load_object

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


# --- user rewards


def to_float(r):
    """A reward value as a float: bool, int, float, numpy scalars, 0-d arrays and tensors.
    TypeError for anything else, ValueError when it is not finite."""
    if isinstance(r, (bool, int, float)):
        value = float(r)
    elif getattr(r, "ndim", None) == 0 and hasattr(r, "item"):  # numpy scalar, 0-d array or tensor
        value = float(r.item())
    else:
        raise TypeError(f"returned {r!r}, not a number (bool, int, float, numpy scalar or 0-d tensor)")
    if not math.isfinite(value):
        raise ValueError(f"returned {value}, not a finite number")
    return value


def load_reward_fn(path):
    """The function `path` names, refused here (at start-up) when it fits neither form (reward_form)."""
    fn = load_object(path)
    if not callable(fn):
        raise ValueError(f"reward_fn={path!r} is not a function")
    reward_form(fn, f"reward_fn={path!r}")
    return fn


# --- the two forms

FORMS = ("`reward(prompt, completion, example)` returning a number, or TRL's `reward(completions, **kwargs)` "
         "returning a list of numbers")
TRL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state")  # what GRPOTrainer passes by name
# Row keys that are no column for a TRL reward: TRL's own exclusions (prompt, completion, completion_ids; the
# prompt arrives as `prompts`), and the prompt's rendering and tokens, which data.tokenize_rows adds
NOT_COLUMNS = {"prompt", "completion", "completion_ids", "prompt_text", "prompt_ids"}


def reward_form(fn, name="reward_fn"):
    """"trl" for a function with a `completions` parameter (TRL's GRPOTrainer passes everything by name),
    "ours" for one that takes (prompt, completion, example) by position; a ValueError naming both otherwise."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable without a signature to read: taken at its word
        return "ours"
    if any(p.name == "completions" and p.kind is not p.POSITIONAL_ONLY for p in params):
        return "trl"
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in params)
    keyword_only = [p for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    if len(required) <= 3 and (len(positional) >= 3 or varargs) and not keyword_only:
        return "ours"
    raise ValueError(f"{name}: a reward {getattr(fn, '__name__', 'function')}{inspect.signature(fn)} fits neither "
                     f"accepted form; write {FORMS}")


def trl_keywords(fn):
    """The keywords a TRL-form fn takes: None when it takes **kwargs (all of them)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def check_columns(fn, row, name="reward_fn"):
    """Refuse at load a TRL-form reward that needs a column the rows lack: it would fail on every sample."""
    if reward_form(fn, name) != "trl":
        return
    given = set(TRL_KEYWORDS) | (set(row) - NOT_COLUMNS)
    params = inspect.signature(fn).parameters.values()
    missing = [p.name for p in params if p.default is p.empty and p.name not in given
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if missing:
        raise ValueError(f"{name}: the reward takes {missing[0]!r}, which is no column of the dataset (columns: "
                         f"{', '.join(sorted(set(row) - NOT_COLUMNS))}); rename the parameter, or map a column onto "
                         f"`answer` with --dataset_answer_column")


class Reward:
    """A reward function in either form, called one sample at a time: reward(prompt, completion, example,
    completion_ids) -> its value. It reaches a pool worker pickled as its spec (a "module:name" /
    "file.py:name" string, or a module-level function) and loads it again there as it is unpickled.

    A TRL-form reward gets one-element lists, as TRL's GRPOTrainer would pass a batch of one: `prompts` the
    row's prompt as the dataset holds it (a string, or messages), `completions` the completion (for a
    messages prompt, [{"role": "assistant", "content": text}]: with an environment, the last turn only; the
    whole conversation is the `messages` keyword), `completion_ids` its sampled token ids, `trainer_state`
    None (there is no Trainer), and every other column of the row by name. One sample a call keeps the pool's
    per-sample timeout and failure counts, and its workers busy in parallel; a TRL reward cannot rely on a
    batch's make-up anyway (GRPOTrainer splits a batch, and its groups, across processes). None for a sample
    is TRL's "not applicable" (returned as None): with no other reward to score the sample it is unscored and
    counted (reward_none), where GRPOTrainer's nansum would give it 0, a reward nobody earned. (Ours
    returning None is an error: a `return` forgotten.)"""

    def __init__(self, spec):
        self.spec = spec
        self.fn = load_reward_fn(spec) if isinstance(spec, str) else spec
        if not callable(self.fn):
            raise ValueError(f"reward {spec!r} is not a function")
        self.form = reward_form(self.fn, f"reward {spec!r}")
        self.keywords = trl_keywords(self.fn) if self.form == "trl" else None

    def __getstate__(self):
        return self.spec

    def __setstate__(self, spec):
        self.__init__(spec)

    def __repr__(self):
        return repr(self.spec)

    def __call__(self, prompt, completion, example, completion_ids=None):
        if self.form == "ours":
            return to_float(self.fn(prompt, completion, example))  # None too is an error: a `return` forgotten
        prompt = example.get("prompt", prompt)
        kwargs = {k: [v] for k, v in example.items() if k not in NOT_COLUMNS}
        kwargs.update(prompts=[prompt], completion_ids=[completion_ids], trainer_state=None, completions=[
            [{"role": "assistant", "content": completion}] if isinstance(prompt, list) else completion])
        if self.keywords is not None:  # no **kwargs: only what it names (check_columns saw to the rest)
            kwargs = {k: v for k, v in kwargs.items() if k in self.keywords}
        value = one_value(self.fn(**kwargs))
        return None if value is None else to_float(value)


def one_value(values):
    """The value of a TRL-form reward's answer for one completion: a list (tuple, 1-d array or tensor) of
    one number, or of None (not applicable: RewardPool.score counts it, and the sample is unscored)."""
    try:
        n = len(values)
    except TypeError:  # a number, None, a 0-d tensor
        n = None
    if n is None or isinstance(values, (str, bytes, dict)):
        raise TypeError(f"returned {values!r}, not a list; a TRL-form reward (it takes `completions`) returns "
                        f"a list of one number per completion")
    if n != 1:
        raise ValueError(f"returned {n} values for 1 completion; a TRL-form reward returns one per completion")
    return values[0]
