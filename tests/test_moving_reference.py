"""experiments/moving_reference.py's measure of how far a policy has moved: the exact KL to the
initial policy on first turns sampled from the policy (the tiny model, no server)."""

import os
import sys
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
import moving_reference  # noqa: E402


def test_kl_to_the_initial_policy_is_zero_for_itself_and_grows_with_the_distance(tiny_model_dir, tmp_path):
    args = SimpleNamespace(model=tiny_model_dir, tiny=True, out=str(tmp_path), steps=2)
    initial = moving_reference.InitialPolicy(args, moving_reference.flags(args, "tools", "fixed", 1))
    assert len(initial.prompts) == 8 and initial.max_new == 16  # the tiny run's held-out prompts and budget
    assert initial.kl(tiny_model_dir) == 0.0
    kls = []
    for scale in (0.01, 0.1):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        with torch.no_grad():
            model.lm_head.weight.add_(scale * torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(0)))
        model.save_pretrained(tmp_path / str(scale))
        kls.append(initial.kl(str(tmp_path / str(scale))))
    assert 0 < kls[0] < kls[1]
    assert kls[0] == initial.kl(str(tmp_path / "0.01"))  # the same samples each time (seeded)
