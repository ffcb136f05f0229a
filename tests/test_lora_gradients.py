"""LoRA's gradients: what the adapter learns is the full model's gradient projected onto it. For
W' = W + s B A (s = lora_alpha / lora_rank) and G = dL/dW', the chain rule gives

    dL/dB = s G A^T        dL/dA = s B^T G

so the adapters' gradients, through the trainer's own forward (sequence_logprobs on the module
adapters.add_adapters builds), must equal those of a plain model holding the merged weights. A wrong
scale, an adapter the loss does not reach or a dropout left on would break the equality. In the
test process, on the tiny model, with lora_B drawn away from 0 (at 0, dL/dA is 0 by the formula)."""

import types

import torch
from transformers import AutoModelForCausalLM

from lora import adapters
from lora import sync as lora_sync
from infra.policy import sequence_logprobs
from update import make_optimizer
from helpers import lora_model

IDS = torch.tensor([[5, 17, 30, 9, 44, 12, 3, 27, 51, 8, 14, 2], [40, 41, 7, 7, 23, 60, 31, 19, 11, 4, 6, 50]])


def loss_of(model, weights):
    """A weighted sum of the completion tokens' logprobs (the last 8 of each row), as a policy-gradient loss."""
    mask = torch.zeros(IDS.shape[0], IDS.shape[1] - 1, dtype=torch.bool)
    mask[:, 3:] = True
    logp = model.sequence_logprobs(IDS, mask, 0.7, position_ids=torch.arange(IDS.shape[1]).expand_as(IDS))[0]
    return (weights * logp).sum()


def test_the_adapters_gradients_are_the_full_models_projected_onto_them(tiny_model_dir):
    cfg, model = lora_model(tiny_model_dir)  # every linear layer of the decoder, the EMA reference adapter beside
    scale = cfg.lora_alpha / cfg.lora_rank
    merged = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    merged.load_state_dict(lora_sync.merge(model.state_dict(), cfg))
    merged.sequence_logprobs = types.MethodType(sequence_logprobs, merged)
    weights = torch.randn(2 * 8, generator=torch.Generator().manual_seed(3))
    loss_of(model, weights).backward()
    loss_of(merged, weights).backward()
    trained = adapters.adapter_parameters(model, adapters.ADAPTER)
    assert len(trained) == 2 * 7 * model.config.num_hidden_layers
    for name, p in trained:
        layer = name.split(".lora_")[0]
        grad_w = merged.get_parameter(f"{layer}.weight").grad  # G = dL/dW', (out, in)
        a, b = (model.get_parameter(f"{layer}.lora_{x}.{adapters.ADAPTER}.weight").detach() for x in "AB")
        want = scale * grad_w @ a.T if ".lora_B." in name else scale * b.T @ grad_w
        assert p.grad is not None and p.grad.abs().max() > 0, name  # every adapter learns from one backward
        assert (p.grad - want).abs().max() <= 1e-4 * want.abs().max(), name
    # the frozen base and the reference adapter take no gradient; the optimizer holds the trained adapter alone
    assert all(p.grad is None for n, p in model.named_parameters() if not adapters.is_adapter(n, adapters.ADAPTER))
    optimizer, _ = make_optimizer(cfg, model, 10, torch.device("cpu"))
    held = [p for group in optimizer.param_groups for p in group["params"]]
    assert len(held) == len(trained) and {id(p) for p in held} == {id(p) for _, p in trained}


def test_the_scale_is_peft_s_and_the_adapters_forward_is_the_merged_model_s(tiny_model_dir):
    """The s of the formula above is PEFT's own scaling in every layer (no rsLoRA, no per-layer alpha),
    and the merged weights carry that scale: the two forwards agree."""
    cfg, model = lora_model(tiny_model_dir)
    assert {layer.scaling[adapters.ADAPTER] for layer in adapters.tuner_layers(model)} == {cfg.lora_alpha / cfg.lora_rank}
    merged = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    merged.load_state_dict(lora_sync.merge(model.state_dict(), cfg))
    merged.sequence_logprobs = types.MethodType(sequence_logprobs, merged)
    with torch.no_grad():
        weights = torch.ones(2 * 8)
        assert abs(loss_of(model, weights) - loss_of(merged, weights)) < 1e-4
