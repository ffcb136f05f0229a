"""A --reward_fn is called once at start-up on the first prompt row and a made-up completion
(data.dry_call, from train.load_inputs), before any server: a value of the wrong type or length is
refused in one line then, not found 2.5 minutes in when the server is up. The made-up completion may be
garbage to the reward: its own exception, our form's None and a hang are warnings; TRL's None is fine."""

import os
import subprocess
import sys
import time

import pytest

import data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REWARDS = '''
import time


def two(completions, **kwargs):  # a list reward returning the wrong number of values
    return [1.0, 0.0]


def text(completions, **kwargs):
    return ["1.0"]


def ours_text(prompt, completion, example):
    return "high"


def good(completions, answer, **kwargs):  # a column by name, as TRL passes it
    return [float(c == a) for c, a in zip(completions, answer)]


def not_applicable(completions, **kwargs):
    return [None]


def ours(prompt, completion, example):
    return len(completion) / 10


def parses(prompt, completion, example):  # fails on garbage: the made-up completion is no real one
    return float(int(completion.split("=")[1]) == 4)


def forgot(prompt, completion, example):
    if "boxed" in completion:
        return 1.0


def hangs(completions, **kwargs):
    time.sleep(30)
    return [1.0]
'''
ROW = {"prompt": "2+2=", "answer": "4", "prompt_text": "2+2=", "prompt_ids": [1, 2]}


def call(tmp_path, names, weights=None, timeout=5.0, row=ROW, multi_turn=False):
    (tmp_path / "r.py").write_text(REWARDS)
    return data.dry_call(",".join(f"{tmp_path}/r.py:{n}" for n in names), weights, row, [0], timeout, multi_turn)


@pytest.mark.parametrize("names,says", [
    (["two"], "two returned 2 values for 1 completion"),
    (["text"], "text returned '1.0', not a number"),
    (["ours", "ours_text"], "ours_text returned 'high', not a number"),
])
def test_a_value_of_the_wrong_length_or_type_is_refused_in_one_line(tmp_path, names, says):
    with pytest.raises(ValueError) as e:
        call(tmp_path, names)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"reward_fn='{tmp_path}/r.py:{names[0]}") and says in line, line
    assert "called at start-up on the first prompt and the made-up completion '0'" in line, line


def test_what_a_made_up_completion_may_cause_is_a_warning(tmp_path):
    assert call(tmp_path, ["good", "ours", "not_applicable"], weights=[1.0, 0.5, 2.0]) == []
    warnings = call(tmp_path, ["parses", "forgot"])
    assert len(warnings) == 2, warnings
    assert "parses raised IndexError: list index out of range on the made-up completion '0'" in warnings[0]
    assert "forgot returned None on the made-up completion" in warnings[1]
    start = time.monotonic()
    assert "did not answer within reward_timeout=0.5 s" in call(tmp_path, ["hangs"], timeout=0.5)[0]
    assert time.monotonic() - start < 5


def test_weights_of_the_wrong_length_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"reward_weights=\[1.0\] has 1 weights for 2 reward functions"):
        call(tmp_path, ["good", "ours"], weights=[1.0])


def test_with_a_conversation_the_reward_sees_it_end_with_the_made_up_turn(tmp_path):
    (tmp_path / "c.py").write_text('''
def last(prompt, completion, example):
    assert example["messages"][-1] == {"role": "assistant", "content": completion} and len(example["messages"]) == 2
    return 1.0
''')
    row = dict(ROW, messages=[{"role": "user", "content": "2+2="}])
    assert data.dry_call(f"{tmp_path}/c.py:last", None, row, [0], 5.0, True) == []


@pytest.mark.subprocess
def test_train_py_refuses_a_list_reward_of_the_wrong_length_within_seconds(tmp_path, tiny_model_dir):
    """The whole entry point: exit 2, one line, before any vLLM server starts (none is named or reachable:
    the dry call comes first)."""
    (tmp_path / "r.py").write_text(REWARDS)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    start = time.monotonic()
    p = subprocess.run([sys.executable, "train.py", "--model_name_or_path", tiny_model_dir, "--output_dir",
                        str(tmp_path / "out"), "--reward_fn", f"{tmp_path}/r.py:two"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=dict(env, OMP_NUM_THREADS="1"))
    took = time.monotonic() - start
    err = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(err) == 1, p.stderr[-2000:]
    assert err[0].startswith(f"error: reward_fn='{tmp_path}/r.py:two': two returned 2 values for 1 completion"), err
    assert "vllm" not in p.stdout.lower() and took < 120, (took, p.stdout[-2000:])
    print(f"refused {took:.1f} s after start")
