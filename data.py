"""Prompts: built-in tasks made in code, user datasets, their rows rendered and tokenized for the
policy (tokenize_rows), and the seeded sampler that hands them out a batch at a time (PromptSampler).

A row is a dict with at least "prompt" (a string, or a list of {role, content} chat
messages) and usually "answer". Reward functions are in rewards.py; the model and its tokenizer
in model_files.py.

Built-in tasks (deterministic by seed; evaluation prompts are disjoint from training):
  copy  "copy: abca=" -> "abca". Partial credit per matching character, divided by
        max(len(answer), len(completion)): learnable by RL alone from a random 0.3 M model.
  add   "12+7=" -> "19". Exact match on the text before the first newline.
  math  "Ava has 7 apples. Ava finds 5 more. How many apples does Ava have now? Put the
        final answer in \\boxed{}." as a chat message -> "12", scored by rewards.math_reward.
        Difficulty: math_digits, math_operations, math_steps.
  calc  "What is 214 + 659?" -> "873", for the calculator environment
        (--environment envs.calculator:calculator), scored by rewards.number_reward. The same knobs;
        a factor of * has 2 digits.

User data: `--dataset` names a local .jsonl/.json/.parquet/.csv file or a hub dataset;
`--dataset_prompt_column` and `--dataset_answer_column` map its columns onto
"prompt" and "answer" (other columns are kept and reach the reward as `example`).
TRL's forms: a `prompt` of messages, and prompt-completion rows, whose `completion` is the
gold answer when there is no answer column. A prompt that ends with an assistant message
(TRL's whole-conversation `messages`) is refused: the answer would be in the prompt.
A --reward_fn of your own is called once at start-up on the first row and a made-up completion
(dry_call): a value of the wrong type or length stops the run before any server.
GSM8K rows (question; answer ending in "#### 72") and MATH rows (problem; solution with
\\boxed{}) train with `--reward_fn rewards:math_reward`, which reads the gold answer there.
"""

import json
import os
import random
import threading
import zlib

from rewards import copy_reward, exact_match, math_reward, number_reward
from infra.user_code import Reward, check_columns, load_reward_fns

# --- built-in tasks


def copy_task(rng):
    s = "".join(rng.choice("abcd") for _ in range(rng.randint(1, 4)))
    return {"prompt": f"copy: {s}=", "answer": s}


def add_task(rng):
    a, b = rng.randint(0, 49), rng.randint(0, 49)
    return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


NAMES = ["Ava", "Ben", "Chloe", "Dev", "Emma", "Finn", "Gia", "Hugo", "Iris", "Jon", "Kai", "Lena", "Mia", "Noah"]
ITEMS = ["apples", "marbles", "stickers", "books", "coins", "cards", "shells", "pencils", "stamps", "cookies"]
BOXED = "Put the final answer in \\boxed{}."


def math_task(rng, digits, operations, steps):
    """A word problem: a start count and `steps` operations drawn from `operations` (+, -, *),
    numbers of up to `digits` digits (a product's factor is 2 to 9); the count never goes
    below 0. One user message asking for a boxed answer; the answer is the final count."""
    name, item, top = rng.choice(NAMES), rng.choice(ITEMS), 10 ** digits - 1
    total = rng.randint(2, top)
    text = [f"{name} has {total} {item}."]
    for _ in range(steps):
        op = rng.choice(operations)
        op = "+" if op == "-" and total == 0 else op
        if op == "+":
            n = rng.randint(1, top)
            text.append(rng.choice([f"{name} finds {n} more.", f"A friend gives {name} {n} more {item}."]))
            total += n
        elif op == "-":
            n = rng.randint(1, min(total, top))
            text.append(rng.choice([f"{name} gives away {n}.", f"{name} loses {n} of them."]))
            total -= n
        else:
            n = rng.randint(2, 9)
            text.append(f"Then {name} ends up with {n} times as many {item} as that.")
            total *= n
    question = " ".join(text) + f" How many {item} does {name} have now? {BOXED}"
    return {"prompt": [{"role": "user", "content": question}], "answer": str(total)}


def calc_task(rng, digits, operations, steps):
    """Arithmetic for the calculator environment: "What is 214 + 659?", `steps` operations from
    `operations` on numbers of `digits` digits (a factor of * has 2 digits), the usual precedence."""
    low, top = 10 ** (digits - 1), 10 ** digits - 1
    terms = [rng.randint(low, top)]  # the value's terms: * binds to the last one, + and - start a new one
    expression = str(terms[0])
    for _ in range(steps):
        op = rng.choice(operations)
        n = rng.randint(10, 99) if op == "*" else rng.randint(low, top)
        expression += f" {op} {n}"
        if op == "*":
            terms[-1] *= n
        else:
            terms.append(n if op == "+" else -n)
    return {"prompt": [{"role": "user", "content": f"What is {expression}?"}], "answer": str(sum(terms))}


TASKS = {"copy": (copy_task, copy_reward), "add": (add_task, exact_match), "math": (math_task, math_reward),
         "calc": (calc_task, number_reward)}


def is_eval_prompt(prompt, eval_fraction=0.2):
    """A fixed, seed-independent 20% of distinct prompts is held out for evaluation."""
    key = prompt if isinstance(prompt, str) else json.dumps(prompt)
    return zlib.crc32(key.encode()) % 1000 < eval_fraction * 1000


def task_knobs(cfg):
    """The built-in task's settings from the config (`math` and `calc` have them)."""
    return dict(digits=cfg.math_digits, operations=cfg.math_operations, steps=cfg.math_steps) \
        if cfg.dataset in ("math", "calc") else {}


def task_rows(task, n, seed, split, **knobs):
    """n rows of a built-in task from its train or eval part, deterministic in (seed, split, knobs).
    The eval rows do not depend on the seed, so every seed of an experiment is scored on the same
    prompts (a fixed draw: seed 1's, whatever the run's seed)."""
    make, _ = TASKS[task]
    rng = random.Random(f"{task}-{seed if split == 'train' else 1}-{split}")
    rows = []
    while len(rows) < n:
        row = make(rng, **knobs)
        if is_eval_prompt(row["prompt"]) == (split == "eval"):
            rows.append(row)
    return rows


# --- user datasets


def load_rows(cfg):
    """Rows of `cfg.dataset` with columns renamed to prompt/answer. Errors name the fix."""
    import datasets

    ext = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
    suffix = os.path.splitext(cfg.dataset)[1].lower()
    if suffix in ext:
        if not os.path.isfile(cfg.dataset):
            raise ValueError(f"dataset file {cfg.dataset!r} does not exist; pass a local file or a built-in task "
                             f"({', '.join(TASKS)})")
        try:
            ds = datasets.load_dataset(ext[suffix], data_files=cfg.dataset, split="train")
        except Exception as e:  # noqa: BLE001 - the library raises many kinds
            raise ValueError(f"dataset file {cfg.dataset!r} could not be read as {ext[suffix]}: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    elif os.path.exists(cfg.dataset) and not os.path.isdir(cfg.dataset):
        raise ValueError(f"dataset file {cfg.dataset!r} has an unknown type; use .jsonl, .json, .parquet or .csv")
    else:
        try:
            ds = datasets.load_dataset(cfg.dataset, split=cfg.dataset_split)
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"dataset {cfg.dataset!r} is neither a built-in task ({', '.join(TASKS)}), a local "
                             f"file, nor a loadable hub dataset: {str(e).splitlines()[0] if str(e) else e!r}") from None
    if len(ds) == 0:
        raise ValueError(f"dataset {cfg.dataset!r} has no rows")
    if cfg.dataset_prompt_column not in ds.column_names:
        raise ValueError(f"dataset {cfg.dataset!r} has no column {cfg.dataset_prompt_column!r} "
                         f"(columns: {', '.join(ds.column_names)}); set --dataset_prompt_column")
    # TRL's prompt-completion form: without an answer column, the completion is the gold answer
    gold = cfg.dataset_answer_column if cfg.dataset_answer_column in ds.column_names else \
        "completion" if "completion" in ds.column_names and cfg.dataset_prompt_column != "completion" else None
    rows = []
    for row in ds:
        row = dict(row)
        row["prompt"] = row.pop(cfg.dataset_prompt_column)
        if gold == "completion":  # kept too: our reward sees it in example, TRL's form does not (as in TRL)
            row["answer"] = completion_answer(row["completion"])
        elif gold:
            row["answer"] = row.pop(gold)
        rows.append(row)
    return rows


def completion_answer(completion):
    """A prompt-completion row's completion as a gold answer: a string as it is, messages (TRL's
    conversational form, [{"role": "assistant", "content": ...}]) as the last one's content."""
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return completion[-1].get("content")
    return completion


def prompt_text(prompt, tokenizer, chat, tools=None):
    """The prompt as the text the model sees: chat messages (or a string when `chat`) go
    through the tokenizer's chat template (with an environment's tools) with the generation
    prompt appended."""
    if isinstance(prompt, list) or chat:
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        if not tokenizer.chat_template:
            raise ValueError("chat prompts need a tokenizer with a chat_template; this one has none "
                             "(set apply_chat_template=False and use string prompts)")
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return prompt


def tokenize_rows(rows, tokenizer, cfg, env=None):
    """Add "prompt_text" and "prompt_ids" (and with an environment its first "messages", from
    which they are made). Empty or malformed rows are skipped, prompts longer than
    max_prompt_length are skipped or refused (skip_long_prompts).
    Returns (rows, counts of what was skipped)."""
    kept, skipped, shortest = [], {"empty": 0, "malformed": 0, "too_long": 0}, None
    for row in rows:
        p = row.get("prompt")
        ok = isinstance(p, str) or (isinstance(p, list) and all(
            isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m for m in p))
        if not ok:
            skipped["malformed"] += 1
            continue
        if not (p.strip() if isinstance(p, str) else p):
            skipped["empty"] += 1
            continue
        if isinstance(p, list) and p[-1]["role"] == "assistant":  # a whole conversation (TRL's `messages`)
            raise ValueError(f"a prompt ends with an assistant message ({p[-1]['content'][:40]!r}), which would put "
                             f"the answer into the prompt; split each row into TRL's prompt-completion form (`prompt`: "
                             f"the messages before the answer, `completion`: the answer), or set "
                             f"--dataset_prompt_column to a column that holds only the prompt")
        # an environment's conversation, over any dataset column of that name; without one a "messages"
        # column stays the dataset's own, for the reward (Environment.play reads it; an agent's reward sees its
        # conversation)
        extra = {"messages": env.reset(row)} if env else {}
        text = prompt_text(extra["messages"], tokenizer, True, env.tools) if env else \
            prompt_text(p, tokenizer, cfg.apply_chat_template)
        # an environment's first messages are its text: control-token strings in them stay text (envs/chat.py)
        ids = env.chat.prompt_ids(extra["messages"]) if env else tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > cfg.max_prompt_length:
            if not cfg.skip_long_prompts:
                raise ValueError(f"a prompt has {len(ids)} tokens, over max_prompt_length={cfg.max_prompt_length}: "
                                 f"{text[:60]!r}...; raise max_prompt_length or set skip_long_prompts=True")
            skipped["too_long"] += 1
            shortest = min(len(ids), shortest or len(ids))
            continue
        kept.append({**row, **extra, "prompt_text": text, "prompt_ids": ids})
    if not kept and skipped["too_long"] == len(rows):
        raise ValueError(f"all {len(rows)} prompts of {cfg.dataset!r} are longer than max_prompt_length="
                         f"{cfg.max_prompt_length} tokens, the shortest {shortest}; raise max_prompt_length to at "
                         f"least {shortest}")
    if not kept:
        long = f", {skipped['too_long']} over max_prompt_length={cfg.max_prompt_length} tokens (the shortest " \
               f"{shortest})" if shortest else ""
        raise ValueError(f"no usable prompts in {cfg.dataset!r}: {skipped['empty']} empty, {skipped['malformed']} "
                         f"malformed{long}; check --dataset_prompt_column (a string, or a list of "
                         f"{{role, content}} messages)")
    return kept, skipped


def load_prompts(cfg, tokenizer, env=None):
    """(train rows, eval rows, skipped counts, reward function) for the config.

    Built-in tasks generate fresh, disjoint train and eval prompts. A user dataset keeps its first
    min(num_eval_prompts, a fifth of its rows) rows, after a seeded shuffle, for evaluation and trains
    on the rest.
    """
    if cfg.dataset in TASKS:
        n_train = max(4096, 4 * cfg.num_unique_prompts_rollout)
        train = task_rows(cfg.dataset, n_train, cfg.seed, "train", **task_knobs(cfg))
        evals = task_rows(cfg.dataset, cfg.num_eval_prompts, cfg.seed, "eval", **task_knobs(cfg))
        default_reward = TASKS[cfg.dataset][1]
    else:
        rows = load_rows(cfg)
        random.Random(cfg.seed).shuffle(rows)
        n_eval = min(cfg.num_eval_prompts, len(rows) // 5)
        train, evals = rows[n_eval:] if n_eval else rows, rows[:n_eval]
        default_reward = exact_match
    reward_fns = load_reward_fns(cfg.reward_fn) if cfg.reward_fn else [default_reward]
    train, skipped = tokenize_rows(train, tokenizer, cfg, env)
    evals = tokenize_rows(evals, tokenizer, cfg, env)[0] if evals else []
    for fn in reward_fns:  # a TRL reward's named columns
        check_columns(fn, train[0], f"reward_fn={cfg.reward_fn!r}")
    return train, evals, skipped, reward_fns[0] if len(reward_fns) == 1 else reward_fns


# --- a user's reward, called once at start-up (train.load_inputs)


DRY_COMPLETION = "0"  # the made-up completion of the dry call: an answer, if a wrong one


class Raised(Exception):
    """The reward's own exception in the dry call: the made-up completion may be garbage to it."""


def dry_call(spec, weights, row, completion_ids, timeout, multi_turn=False):
    """Call the reward (--reward_fn: one function or several, either form) once on a real prompt row and a
    made-up completion, as the pool would call it (user_code.Reward.call), before any server starts, and
    nothing of it recorded. A value of the wrong type, or a TRL-form list of the wrong length, raises
    ValueError naming the function and the fix: it would fail on every sample. Returns warning lines:
    an exception of the reward's own, a None from our form, or no answer within `timeout` (reward_timeout)
    may come of the made-up completion alone, so each is a warning, not a refusal; a TRL-form None is
    TRL's "not applicable", and fine."""
    reward = Reward(spec, weights)  # a reward_weights of the wrong length is refused here too
    example = dict(row, messages=[*row.get("messages", []), {"role": "assistant", "content": DRY_COMPLETION}]) \
        if multi_turn else row
    done, out = threading.Event(), {}

    def run():
        out["result"] = [one(part, name, row["prompt_text"], example, completion_ids)
                         for part, name in zip(reward.parts, reward.names)]
        done.set()

    threading.Thread(target=run, daemon=True, name="dry-reward").start()  # a hang is left behind, a daemon
    if not done.wait(timeout):
        return [f"reward_fn={spec!r} did not answer within reward_timeout={timeout:g} s on a made-up completion "
                f"({DRY_COMPLETION!r}); each sample that slow is unscored (reward_timeouts)"]
    wrong = [why for kind, why in out["result"] if kind == "wrong"]
    if wrong:
        raise ValueError(f"reward_fn={spec!r}: {wrong[0]}, called at start-up on the first prompt and the made-up "
                         f"completion {DRY_COMPLETION!r}; fix it to return one number per completion")
    return [f"reward_fn={spec!r}: {why} on the made-up completion {DRY_COMPLETION!r} at start-up; on every real "
            f"completion that would leave the sample unscored (reward_errors)" for kind, why in out["result"] if kind]


def one(part, name, prompt, example, completion_ids):
    """One function's dry call: (None, None) when it gave a number or TRL's None, ("wrong", why) for a
    value of the wrong type or length, ("warn", why) for its own exception or our form's None."""
    fn, form, keywords = part
    got = {}

    def guarded(*args, **kwargs):
        try:
            got["value"] = fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - user code may raise anything
            raise Raised(f"{name} raised {type(e).__name__}: {e}") from None
        return got["value"]

    try:
        Reward.call((guarded, form, keywords), prompt, DRY_COMPLETION, example, completion_ids)
    except Raised as e:
        return "warn", str(e)
    except Exception as e:  # noqa: BLE001 - to_float's and one_value's: its value is of the wrong type or length
        if form == "ours" and got.get("value", 0) is None:
            return "warn", f"{name} returned None"
        return "wrong", f"{name} {e}"
    return None, None


class PromptSampler:
    """Endless, seeded, epoch-wise shuffled batches of rows; `position` makes it resumable."""

    def __init__(self, rows, seed):
        self.rows, self.seed, self.position = rows, seed, 0

    def next_batch(self, n):
        batch = []
        for _ in range(n):
            epoch, i = divmod(self.position, len(self.rows))
            if getattr(self, "_epoch", None) != epoch:
                self._epoch, self._order = epoch, list(range(len(self.rows)))
                random.Random(self.seed * 1_000_003 + epoch).shuffle(self._order)
            batch.append(self.rows[self._order[i]])
            self.position += 1
        return batch
