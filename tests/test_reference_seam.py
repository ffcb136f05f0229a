"""Every kind of reference behind one seam (reference.py): it moves only when due, and a
checkpoint holds its own weights only where it has some (no process group: plain modules)."""

import torch

from reference import EMAReference, Reference


def linear(value):
    layer = torch.nn.Linear(2, 2, bias=False)
    torch.nn.init.constant_(layer.weight, value)
    return layer


def test_a_fixed_reference_never_moves_and_an_ema_one_moves_every_n_steps():
    policy = linear(1.0)
    fixed, ema = Reference(linear(0.0)), EMAReference(linear(0.0), policy, 0.5, every=2)
    assert not any(p.requires_grad for p in fixed.model.parameters())
    seen = []
    for step in range(1, 5):
        fixed.step(step)
        ema.step(step)
        seen.append((fixed.model.weight[0, 0].item(), ema.model.weight[0, 0].item()))
    assert seen == [(0.0, 0.0), (0.0, 0.5), (0.0, 0.5), (0.0, 0.75)]  # lerp toward 1 at steps 2 and 4
    assert ema.updates == 2


def test_a_checkpoint_holds_the_reference_s_own_weights_and_nothing_for_a_view():
    policy = linear(1.0)
    fixed = Reference(linear(0.25))
    state = fixed.state_dict()
    assert list(state) == ["ref"] and torch.equal(state["ref"]["weight"], torch.full((2, 2), 0.25))
    saved = {"ref": {k: v.clone() for k, v in state["ref"].items()}}  # state's tensors are the parameters' own
    fixed.model.weight.data.fill_(9.0)
    fixed.load_state_dict(saved)
    assert fixed.model.weight[0, 0].item() == 0.25

    class View:  # what LoRA's references are: the policy's module seen through another adapter
        def sequence_logprobs(self, *args, **kwargs):
            return policy(*args)

    assert Reference(View()).state_dict() == {}
    assert EMAReference(View(), policy, 0.5, params=([], [])).state_dict() == {}
    assert Reference(View()).logprobs(lambda model, b: model.sequence_logprobs(b), torch.ones(1, 2)).sum() == 4.0
