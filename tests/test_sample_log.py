"""The sample log: (prompt, completion, episode, reward) rows in samples.jsonl, on the console and to a
tracker; a resumed run keeps the rows up to its checkpoint."""

import json

from infra import tracking


def rows(step):
    return [dict(step=step, prompt=f"<|im_start|>user\nq{i}  with\nspace", completion=f"answer {i}",
                 episode=f"answer {i}<|im_end|>", reward=i / 2) for i in range(3)]


def test_samples_go_to_the_file_the_console_and_the_tracker(tmp_path, capsys):
    sent = []
    log = tracking.MetricsLog(str(tmp_path), 0, tracker=lambda m, step: sent.append((step, m)))
    log.write_samples(None)  # a step without samples writes nothing
    assert not (tmp_path / "samples.jsonl").exists()
    log.write_samples(rows(10))
    log.write_samples(rows(20))
    lines = [json.loads(line) for line in open(tmp_path / "samples.jsonl")]
    assert lines == rows(10) + rows(20)
    out = capsys.readouterr().out
    assert "sample reward=0.5 | <|im_start|>user q1 with space | answer 1<|im_end|>" in out
    assert [(step, m["samples"]) for step, m in sent] == [(10, rows(10)), (20, rows(20))]
    log.write_samples([dict(rows(30)[0], reward=None)])  # an episode that could not be scored (rollout.show_episode)
    assert "sample reward=unscored | " in capsys.readouterr().out


def test_a_resumed_run_rewrites_the_samples_after_its_checkpoint(tmp_path):
    log = tracking.MetricsLog(str(tmp_path), 0)
    for step in (10, 20, 30):
        log.write_samples(rows(step))
    log = tracking.MetricsLog(str(tmp_path), 20)  # resumed from the checkpoint of step 20
    log.write_samples(rows(30))
    assert [json.loads(line)["step"] for line in open(tmp_path / "samples.jsonl")] == [10] * 3 + [20] * 3 + [30] * 3


def test_one_line():
    assert tracking.one_line("a\n b  c", 10) == "a b c"
    assert tracking.one_line("abcdefgh", 3) == "abc..." and tracking.one_line("abcdefgh", 3, end=True) == "...fgh"
