"""The teacher's scoring against a plain prefill of the same tokens, one vLLM CPU server.

    .venv/bin/python benchmarks/bench_teacher.py     # SmolLM2-135M as student and teacher (scripts/prepare_smollm2.py)

32 samples (4 prompts x 8 completions of 110 random token ids each, the math demo's batch) scored by
distill.teacher.Teacher.ask (prompt_logprobs=0, max_tokens=1) twice, then the same sequences sent
with max_tokens=1 alone: once with the prefix cache holding them, once after it is emptied. Prints
the seconds of each; compare them within one run.
"""

import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from config import Config  # noqa: E402
from distill import teacher  # noqa: E402
from episodes import Sample  # noqa: E402


def main():
    model = "models/smollm2-135m-instruct"
    out = tempfile.mkdtemp()
    cfg = Config(model_name_or_path=model, teacher_model_name_or_path=model, beta=1.0, output_dir=out,
                 max_prompt_length=128, response_length=128, kl_estimator="advantage")
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(4):
        prompt = torch.randint(100, 40000, (110,), generator=g).tolist()
        samples += [Sample(prompt, torch.randint(100, 40000, (110,), generator=g).tolist(), [0.0] * 110)
                    for _ in range(8)]
    ref = teacher.Teacher(cfg, 0)
    try:
        for attempt in (1, 2):
            start = time.perf_counter()
            ref.ask(samples)
            print(f"prompt_logprobs, round {attempt}: {time.perf_counter() - start:.2f} s", flush=True)
        plain = [dict(model=ref.client.model, prompt=s.prompt_ids + s.token_ids, max_tokens=1, temperature=1.0)
                 for s in samples]
        start = time.perf_counter()
        ref.client.map("/v1/completions", plain)
        print(f"prefill alone, prefix cache warm: {time.perf_counter() - start:.2f} s", flush=True)
        ref.client.post(ref.client.urls[0], "/reset_prefix_cache")
        start = time.perf_counter()
        ref.client.map("/v1/completions", plain)
        print(f"prefill alone, prefix cache emptied: {time.perf_counter() - start:.2f} s", flush=True)
    finally:
        ref.close()


if __name__ == "__main__":
    main()
