import json

import pytest

import data
from infra import model_files
from infra import user_code
from config import Config


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_tasks_are_deterministic_and_eval_is_held_out():
    for task in data.TASKS:
        knobs = data.task_knobs(Config(dataset=task))  # the config's, at its defaults
        a = data.task_rows(task, 200, seed=3, split="train", **knobs)
        assert a == data.task_rows(task, 200, seed=3, split="train", **knobs)
        assert a != data.task_rows(task, 200, seed=4, split="train", **knobs)
        evals = data.task_rows(task, 50, seed=3, split="eval", **knobs)
        assert evals == data.task_rows(task, 50, seed=4, split="eval", **knobs) \
            == data.task_rows(task, 50, seed=1, split="eval", **knobs)
        assert not {json.dumps(r["prompt"]) for r in a} & {json.dumps(r["prompt"]) for r in evals}


@pytest.mark.parametrize("answer,completion,expected", [
    ("abca", "abca", 1.0), ("abca", "abcd", 0.75), ("abca", "abcaaaaa", 0.5), ("ab", "", 0.0), ("ab", "ba", 0.0),
    ("abc", "a", 1 / 3),
])
def test_copy_reward(answer, completion, expected):
    assert data.copy_reward("", completion, {"answer": answer}) == pytest.approx(expected)


@pytest.mark.parametrize("answer,completion,expected", [
    ("19", "19", 1.0), ("19", " 19 \nmore", 1.0), ("19", "190", 0.0), ("19", "", 0.0), (19, "19", 1.0),
])
def test_exact_match(answer, completion, expected):
    assert data.exact_match("", completion, {"answer": answer}) == expected


def test_task_answers_are_right():
    for row in data.task_rows("add", 20, 0, "train"):
        a, b = row["prompt"][:-1].split("+")
        assert int(row["answer"]) == int(a) + int(b)
    for row in data.task_rows("copy", 20, 0, "train"):
        assert row["prompt"] == f"copy: {row['answer']}=" and data.copy_reward("", row["answer"], row) == 1.0


def test_load_reward_fn(tmp_path):
    assert user_code.load_reward_fn("data:exact_match") is data.exact_match
    f = tmp_path / "my_reward.py"
    f.write_text("def length(prompt, completion, example):\n    return float(len(completion))\n")
    assert user_code.load_reward_fn(f"{f}:length")("", "abc", {}) == 3.0
    for bad, fragment in [("data.exact_match", "module:function"), ("nope_module:f", "cannot import"),
                          ("data:nope", "no function"), (f"{tmp_path}/missing.py:f", "does not exist")]:
        with pytest.raises(ValueError, match=fragment):
            user_code.load_reward_fn(bad)


ROWS = [{"question": f"{i}+1=", "solution": str(i + 1), "id": i} for i in range(30)]


def write(path, fmt):
    import datasets

    ds = datasets.Dataset.from_list(ROWS)
    {"jsonl": lambda: ds.to_json(path, lines=True), "json": lambda: ds.to_json(path, lines=False),
     "parquet": lambda: ds.to_parquet(path), "csv": lambda: ds.to_csv(path, index=False)}[fmt]()


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv"])
def test_load_local_formats_with_column_mapping(tmp_path, fmt, tokenizer):
    path = str(tmp_path / f"rows.{fmt}")
    write(path, fmt)
    cfg = Config(dataset=path, dataset_prompt_column="question", dataset_answer_column="solution",
                 num_eval_prompts=5)
    train, evals, skipped, reward_fn = data.load_prompts(cfg, tokenizer)
    assert len(train) == 25 and len(evals) == 5 and reward_fn is data.exact_match
    rows = {r["id"]: r for r in train + evals}
    assert sorted(rows) == list(range(30))
    r = rows[7]
    assert r["prompt"] == "7+1=" and str(r["answer"]) == "8" and tokenizer.decode(r["prompt_ids"]) == "7+1="


@pytest.mark.parametrize("setup,fragment", [
    (lambda p: None, "does not exist"),
    (lambda p: p.write_text(""), "no rows|could not be read"),
    (lambda p: p.write_text('{"text": "a"}\n'), "no column 'prompt' \\(columns: text\\)"),
])
def test_dataset_errors_name_the_fix(tmp_path, setup, fragment, tokenizer):
    path = tmp_path / "d.jsonl"
    setup(path)
    with pytest.raises(ValueError, match=fragment):
        data.load_prompts(Config(dataset=str(path)), tokenizer)


def test_unknown_extension_and_missing_hub_dataset(tmp_path, tokenizer, monkeypatch):
    import datasets
    from huggingface_hub import constants

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # read once, at their first import (an earlier test's, on a machine with no offline variables): without
    # these the missing dataset is asked of a hub that does not answer, for 20 s of retries
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(ValueError, match="unknown type"):
        data.load_prompts(Config(dataset=str(tmp_path / "d.txt")), tokenizer)
    with pytest.raises(ValueError, match="neither a built-in task"):
        data.load_prompts(Config(dataset="no-such-org/no-such-dataset"), tokenizer)


def test_bad_rows_are_skipped_and_counted(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "   ", "answer": "0"},
            {"prompt": "9" * 100, "answer": "0"}, {"prompt": [{"role": "user", "content": "hi"}], "answer": "x"},
            {"prompt": [{"no_role": 1}], "answer": "0"}]
    path.write_text("\n".join(json.dumps(r) for r in rows[:3]) + "\n")
    train, _, skipped, _ = data.load_prompts(Config(dataset=str(path), max_prompt_length=64, num_eval_prompts=0), tokenizer)
    assert len(train) == 1 and skipped == {"empty": 1, "malformed": 0, "too_long": 1}
    with pytest.raises(ValueError, match="over max_prompt_length=64"):
        data.load_prompts(Config(dataset=str(path), skip_long_prompts=False, num_eval_prompts=0), tokenizer)
    kept, skipped = data.tokenize_rows(rows[3:], tokenizer, Config())
    assert len(kept) == 1 and skipped["malformed"] == 1
    assert kept[0]["prompt_text"] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_on_string_prompts(tokenizer):
    train, evals, _, reward_fn = data.load_prompts(Config(dataset="add", apply_chat_template=True), tokenizer)
    assert train[0]["prompt_text"].startswith("<|im_start|>user\n") and reward_fn is data.exact_match
    ids = train[0]["prompt_ids"]
    assert tokenizer.convert_ids_to_tokens(ids[0]) == "<|im_start|>"


def test_sampler_is_seeded_epoch_shuffled_and_resumable():
    rows = list(range(10))
    s = data.PromptSampler(rows, seed=1)
    first = s.next_batch(10)
    assert sorted(first) == rows and first != rows
    s2 = data.PromptSampler(rows, seed=1)
    s2.position = 4
    assert s2.next_batch(10) == first[4:] + data.PromptSampler(rows, seed=1).next_batch(20)[10:14]


@pytest.fixture(scope="module")
def llama_like_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a generation_config.json that lists two stop ids, the tokenizer's EOS (2)
    and <|im_end|> (4), as Llama-3.1-Instruct lists <|eom_id|> and <|eot_id|> beside its EOS."""
    import shutil

    out = tmp_path_factory.mktemp("two_stops") / "model"
    shutil.copytree(tiny_model_dir, out)
    gen = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps(dict(gen, eos_token_id=[2, 4])))
    return str(out)


def test_stop_token_ids_join_tokenizer_eos_and_generation_config(tiny_model_dir, llama_like_dir, tokenizer):
    from transformers import AutoTokenizer

    assert model_files.stop_token_ids(tokenizer, tiny_model_dir) == [2]
    assert model_files.stop_token_ids(AutoTokenizer.from_pretrained(llama_like_dir), llama_like_dir) == [2, 4]


def test_completion_text_strips_any_stop_id(llama_like_dir):
    """A completion that ended on the extra stop id is scored without it; one cut at the length
    limit keeps its last token, whatever it is."""
    from transformers import AutoTokenizer

    from episodes import completion_text

    tok = AutoTokenizer.from_pretrained(llama_like_dir)
    a, b = tok.convert_tokens_to_ids(["a", "b"])
    assert completion_text(tok, dict(token_ids=[a, b, 4], finish_reason="stop")) == "ab"
    assert completion_text(tok, dict(token_ids=[a, b, 2], finish_reason="stop")) == "ab"
    assert completion_text(tok, dict(token_ids=[a, b, 4], finish_reason="length")) == "ab<|im_end|>"



class KeepExamples:
    """A RewardPool stand-in: scores 0 and keeps the examples the reward would see."""

    def score(self, prompts, completions, examples, completion_ids=None, alone=None):
        self.examples = examples
        return [0.0] * len(prompts), {}, None


def test_messages_column_in_a_single_turn_dataset(tmp_path, tokenizer):
    """Without an environment a dataset's own "messages" column is no episode's conversation: it
    reaches the reward as written, a list, a missing value (None) or a string. (Before: the None row
    crashed episodes.Episode with a TypeError, and the string reached the reward as characters.)"""
    from episodes import Episode
    from rollout import score

    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "2"}]
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "answer": "2", "messages": chat}) + "\n"
                    + json.dumps({"prompt": "2+2=", "answer": "4"}) + "\n")  # datasets fills in None
    text = tmp_path / "t.jsonl"
    text.write_text(json.dumps({"prompt": "3+3=", "answer": "6", "messages": "user: hi"}) + "\n")
    seen = {}
    for dataset in (path, text):
        train, _, _, _ = data.load_prompts(Config(dataset=str(dataset), num_eval_prompts=0), tokenizer)
        pool = KeepExamples()
        score(pool, [Episode(k, row, 8) for k, row in enumerate(train)])
        seen.update({e["prompt"]: e["messages"] for e in pool.examples})
    assert seen == {"1+1=": chat, "2+2=": None, "3+3=": "user: hi"}


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("column", ["prompt", "messages"])
def test_a_prompt_that_ends_with_the_assistant_s_answer_is_refused(tmp_path, tokenizer, column):
    """TRL's conversational `messages` rows (the whole conversation) given as the prompt: before, accepted,
    and the gold answer was in every prompt."""
    chat = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]
    path = jsonl(tmp_path / "d.jsonl", [{column: chat}] * 6)
    with pytest.raises(ValueError) as e:
        data.load_prompts(Config(dataset=path, dataset_prompt_column=column, num_eval_prompts=0), tokenizer)
    line = str(e.value)
    assert "\n" not in line and "ends with an assistant message ('2')" in line
    assert "prompt-completion" in line and "--dataset_prompt_column" in line


@pytest.mark.parametrize("conversational", [False, True])
def test_a_prompt_completion_dataset_trains_with_the_completion_as_the_answer(tmp_path, tokenizer, conversational):
    """TRL's prompt-completion form: the completion is the gold answer when no answer column exists (and
    stays in the row). Before: no "answer", so the default reward raised KeyError on every sample."""
    def row(i):
        if conversational:
            return {"prompt": [{"role": "user", "content": f"{i}+1="}],
                    "completion": [{"role": "assistant", "content": str(i + 1)}]}
        return {"prompt": f"{i}+1=", "completion": str(i + 1)}
    path = jsonl(tmp_path / "d.jsonl", [row(i) for i in range(10)])
    train, evals, _, reward_fn = data.load_prompts(Config(dataset=path, num_eval_prompts=2), tokenizer)
    assert len(train) == 8 and len(evals) == 2 and reward_fn is data.exact_match
    for r in train + evals:
        assert r["answer"] == str(int(data.completion_answer(r["completion"])))
        question = r["prompt"][0]["content"] if conversational else r["prompt"]
        assert reward_fn(r["prompt_text"], str(int(question.split("+")[0]) + 1), r) == 1.0
    with_answers = jsonl(tmp_path / "a.jsonl", [dict(row(i), answer="x") for i in range(10)])
    train, _, _, _ = data.load_prompts(Config(dataset=with_answers, num_eval_prompts=0), tokenizer)
    assert {r["answer"] for r in train} == {"x"}  # an answer column, when there is one, is the answer


def test_all_prompts_too_long_is_said_in_one_line(tmp_path, tokenizer):
    """Before: "no usable prompts ... (skipped: {'empty': 0, 'malformed': 0, 'too_long': 3})", without the
    lengths or the value that would do."""
    path = jsonl(tmp_path / "d.jsonl", [{"prompt": "x" * n, "answer": "1"} for n in (30, 12, 50)])
    with pytest.raises(ValueError) as e:
        data.load_prompts(Config(dataset=path, max_prompt_length=10, num_eval_prompts=0), tokenizer)
    assert str(e.value) == (f"all 3 prompts of {path!r} are longer than max_prompt_length=10 tokens, the shortest "
                            "12; raise max_prompt_length to at least 12")
    with pytest.raises(ValueError, match=r"^all 4096 prompts of 'add' are longer than max_prompt_length=3 tokens, "
                                         r"the shortest 4; raise max_prompt_length to at least 4$"):
        data.load_prompts(Config(dataset="add", max_prompt_length=3), tokenizer)
    mixed = jsonl(tmp_path / "m.jsonl", [{"prompt": "x" * 30}, {"prompt": " "}, {"prompt": 5}])
    with pytest.raises(ValueError, match=r"^no usable prompts in .*: 1 empty, 1 malformed, 1 over "
                                         r"max_prompt_length=10 tokens \(the shortest 30\); check"):
        data.load_prompts(Config(dataset=mixed, max_prompt_length=10, num_eval_prompts=0), tokenizer)
