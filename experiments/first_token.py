"""Whether the calculator's student moves to the tool (scripts/demo.sh --distill-context): the probability it
gives the first token of "<calc>" at its first position, against the teacher's (the same model with the worked
example before the question), on the first 32 held-out prompts of the demo's task. Measured: 0.0003 untrained,
0.001-0.005 after the reverse KL, 0.20-0.26 after the forward KL, the teacher 0.27 (BENCHMARKS.md).

    .venv/bin/python experiments/first_token.py                              # the untrained student
    .venv/bin/python experiments/first_token.py output/demo-distill-context/final   # a trained one
"""

import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data import task_rows  # noqa: E402
from envs.calculator import calculator, calculator_plain  # noqa: E402

MODEL = "models/smollm2-135m-instruct"


def first_token_probs(model, tokenizer, env, rows, token):
    """p(token) at the first position of the model's answer to each row's prompt as env opens it."""
    probs = []
    with torch.no_grad():
        for row in rows:
            text = tokenizer.apply_chat_template(env.reset(row), tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
            probs.append(torch.softmax(model(ids).logits[0, -1].double(), -1)[token].item())
    return probs


def main(student_path=MODEL):
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    rows = task_rows("calc", 64, 1, "eval", digits=3, operations="+-*", steps=1)[:32]
    token = tokenizer("<calc>", add_special_tokens=False)["input_ids"][0]
    for name, path, env in (("student", student_path, calculator_plain), ("teacher", MODEL, calculator)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        p = first_token_probs(model, tokenizer, env, rows, token)
        print(f"{name} ({path}): p({tokenizer.decode([token])!r}) first, mean {sum(p) / len(p):.3g}, "
              f"range {min(p):.3g}-{max(p):.3g} over {len(p)} held-out prompts")


if __name__ == "__main__":
    main(*sys.argv[1:])
