"""Code a user names by flag, as `module:name` or `path/to/file.py:name`: a reward (--reward_fn),
an environment (--environment), an agent (--agent), an objective (--loss_fn). load_object loads it
and names the flag in every error; load_once loads it once per process (an objective's row, which
Config.objective asks for on every micro-batch; loss.check_objective checks it, so that loss.py
stays pure functions). What a user's function returns is read by to_float.

A reward of your own comes in either of two forms, told apart by its signature at load:

    reward(prompt: str, completion: str, example: dict) -> a number                 # ours
    reward(completions, **kwargs) -> a list of numbers (or None), one per completion  # TRL's

Ours: `example` is the dataset row. A reward may return a bool, int, float, numpy scalar or 0-d
tensor (to_float). TRL's (GRPOTrainer's `reward_func(prompts=, completions=, completion_ids=,
**columns)`): see Reward, which calls either form one sample at a time.
"""

import functools
import importlib
import importlib.util
import inspect
import math
import os


def load_object(path, flag="reward_fn", kind="function"):
    """`module:name` (importable) or `path/to/file.py:name`; errors name the flag it came from."""
    module_name, sep, name = path.rpartition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"{flag}={path!r} must look like 'module:{kind}' or 'file.py:{kind}'")
    if module_name.endswith(".py") and not os.path.isfile(module_name):
        raise ValueError(f"{flag} file {module_name!r} does not exist; give a path to a .py file")
    try:
        if module_name.endswith(".py"):
            spec = importlib.util.spec_from_file_location(f"user_{flag}", module_name)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as e:  # a file's own import, or the module named
        fix = "fix the file's imports or install what it needs" if module_name.endswith(".py") else "check the module path"
        raise ValueError(f"{flag}={path!r}: cannot import {module_name!r} ({e}); {fix}") from None
    except Exception as e:  # noqa: BLE001 - a SyntaxError, or whatever the file raises when it runs
        where = f" (line {e.lineno})" if isinstance(e, SyntaxError) and e.lineno else ""
        raise ValueError(f"{flag}={path!r}: {module_name!r} does not load: {type(e).__name__}{where}: "
                         f"{getattr(e, 'msg', e)}; fix the file") from None
    obj = getattr(module, name, None)
    if obj is None:
        raise ValueError(f"{flag}={path!r}: {module_name!r} has no {kind} {name!r}")
    return obj


@functools.cache  # its file runs once per process and spec: Config.objective asks on every micro-batch
def load_once(path, flag, kind):
    """load_object, once per process for each (path, flag, kind)."""
    return load_object(path, flag, kind)


def reward_specs(spec):
    """The functions a --reward_fn names: one, or several separated by commas (TRL's reward_funcs)."""
    if isinstance(spec, (list, tuple)):
        return list(spec)
    return [s.strip() for s in spec.split(",") if s.strip()] if isinstance(spec, str) else [spec]


def load_reward_fn(path):
    """The function `path` names, refused here (at start-up) when it fits neither form (reward_form)."""
    fn = load_object(path)
    if not callable(fn):
        raise ValueError(f"reward_fn={path!r} is not a function")
    reward_form(fn, f"reward_fn={path!r}")
    return fn


def load_reward_fns(spec):
    """Every function --reward_fn names, each refused at start-up as load_reward_fn refuses it."""
    return [load_reward_fn(s) for s in reward_specs(spec)]


# --- a reward of your own: its value, its two forms


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

    def __init__(self, spec, weights=None):
        self.spec, self.weights, self.parts = spec, list(weights or []), []
        for one in reward_specs(spec):
            fn = load_reward_fn(one) if isinstance(one, str) else one
            if not callable(fn):
                raise ValueError(f"reward {one!r} is not a function")
            form = reward_form(fn, f"reward {one!r}")
            self.parts.append((fn, form, trl_keywords(fn) if form == "trl" else None))
        if self.weights and len(self.weights) != len(self.parts):
            raise ValueError(f"reward_weights={self.weights} has {len(self.weights)} weights for {len(self.parts)} "
                             "reward functions; give one weight a function, or none (1 each)")
        names = [getattr(fn, "__name__", f"reward_{j}") for j, (fn, _, _) in enumerate(self.parts)]
        self.names = [n if names.count(n) == 1 else f"{n}_{names[:j].count(n)}" for j, n in enumerate(names)]
        self.several = len(self.parts) > 1 or bool(self.weights)  # then a call returns each function's value

    def __getstate__(self):
        return self.spec, self.weights

    def __setstate__(self, state):
        self.__init__(*state)

    def __repr__(self):
        return repr(self.spec)

    def __call__(self, prompt, completion, example, completion_ids=None):
        """The reward's value; with several functions (or weights) each one's, combine makes the sum."""
        values = tuple(self.call(part, prompt, completion, example, completion_ids) for part in self.parts)
        return values if self.several else values[0]

    def combine(self, values):
        """TRL's weighted sum of the functions' values (weights 1 each unless given): a None (not applicable)
        counts in no sum, and a sample all of whose functions said None is None."""
        given = [w * v for w, v in zip(self.weights or [1.0] * len(values), values) if v is not None]
        return sum(given) if given else None

    @staticmethod
    def call(part, prompt, completion, example, completion_ids):
        fn, form, keywords = part
        if form == "ours":
            return to_float(fn(prompt, completion, example))  # None too is an error: a `return` forgotten
        prompt = example.get("prompt", prompt)
        kwargs = {k: [v] for k, v in example.items() if k not in NOT_COLUMNS}
        kwargs.update(prompts=[prompt], completion_ids=[completion_ids], trainer_state=None, completions=[
            [{"role": "assistant", "content": completion}] if isinstance(prompt, list) else completion])
        if keywords is not None:  # no **kwargs: only what it names (check_columns saw to the rest)
            kwargs = {k: v for k, v in kwargs.items() if k in keywords}
        value = one_value(fn(**kwargs))
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
