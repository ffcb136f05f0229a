import math
from types import SimpleNamespace

import pytest
import torch

from config import Config
from loss import (cispo_loss, dapo_loss, group_advantages, grpo_loss, kl_k1, kl_k2, kl_k3, kl_k4, mismatch_keep,
                  step_denominator, token_logprobs)


def test_chunked_logprobs_equal_naive_values_and_gradients():
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (37,))
    logp, ent, head, ids = token_logprobs(hidden, weight, targets, temperature=0.7, chunk_size=8, head_size=3)  # 5 chunks
    logits = hidden @ weight.t() / 0.7
    ref = torch.log_softmax(logits, -1)
    ref_logp = ref.gather(-1, targets[:, None])[:, 0]
    assert torch.allclose(logp, ref_logp, atol=1e-12)
    assert torch.allclose(ent, -(ref.exp() * ref).sum(-1), atol=1e-12) and not ent.requires_grad
    assert torch.equal(ids, ref.topk(3, -1).indices) and torch.allclose(head, ref.topk(3, -1).values, atol=1e-12)
    given = torch.randint(0, 50, (37, 2))
    _, _, head2, ids2 = token_logprobs(hidden, weight, targets, temperature=0.7, chunk_size=8, head_ids=given)
    assert torch.equal(ids2, given) and torch.allclose(head2, ref.gather(-1, given), atol=1e-12)
    g = torch.randn(37, dtype=torch.float64)
    gh, gw = torch.autograd.grad((logp * g).sum(), (hidden, weight))
    rh, rw = torch.autograd.grad((ref_logp * g).sum(), (hidden, weight))
    assert torch.allclose(gh, rh, atol=1e-12) and torch.allclose(gw, rw, atol=1e-12)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_bf16_hidden_and_head_give_float32_accurate_logprobs(device):
    """What FSDP2's MixedPrecisionPolicy(param_dtype=bf16) hands token_logprobs on a GPU: bf16
    hidden states and a bf16 LM head, at Qwen2.5-0.5B's shape (hidden 896, vocab 151,936),
    logits of std ~4.5. Against float64 logprobs of the same bf16 values the error must be
    float32's, not bf16's (a bf16 product gave mean 0.012, max 0.049 here)."""
    g = torch.Generator().manual_seed(0)
    n, h, v = 128, 896, 151_936
    hidden = torch.randn(n, h, generator=g).to(torch.bfloat16).to(device)
    weight = (torch.randn(v, h, generator=g) * 4.5 / h ** 0.5).to(torch.bfloat16).to(device)
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    logp, _, _, _ = token_logprobs(hidden, weight, targets)
    assert logp.dtype == torch.float32
    exact = torch.log_softmax(hidden.double() @ weight.double().t(), -1).gather(-1, targets[:, None])[:, 0]
    err = (logp.double() - exact).abs()
    assert err.mean() <= 1e-3 and err.max() <= 1e-2, (err.mean().item(), err.max().item())


def test_logprobs_of_no_tokens_keep_the_graph():
    """A rank whose micro-batch is all padding must still run backward (FSDP hooks)."""
    hidden = torch.randn(0, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    logp, _, _, _ = token_logprobs(hidden, weight, torch.zeros(0, dtype=torch.long))
    logp.sum().backward()
    assert weight.grad is not None and weight.grad.abs().sum() == 0


def test_group_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv, std = group_advantages(rewards, 4, "standard")
    s = math.sqrt(1 / 3)  # Bessel-corrected std of [1, 0, 0, 1]
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]) / torch.tensor([s + 1e-6] * 4 + [1e-6] * 4))
    assert torch.allclose(std, torch.tensor([s] * 4 + [0.0] * 4))
    adv, _ = group_advantages(rewards, 4, "centered")
    assert torch.equal(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))


# rho and A chosen to hit every branch of max(-A rho, -A clip(rho, 0.8, 1.28))
RHO = torch.tensor([0.5, 0.9, 1.0, 1.5, 1.5, 0.5], dtype=torch.float64)
ADV = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0], dtype=torch.float64)


def test_dapo_by_hand():
    old = torch.zeros(6, dtype=torch.float64)
    logp = torch.log(RHO).requires_grad_()
    cfg = Config(clip_lower=0.2, clip_higher=0.28)
    per_token, trust, clipped = dapo_loss(logp, old, ADV, torch.arange(6), cfg, 1.0)
    assert not trust.any()
    assert torch.allclose(per_token, torch.tensor([-0.5, 0.9, -1.0, 1.5, -1.28, 0.8], dtype=torch.float64))
    assert clipped.tolist() == [0, 0, 0, 0, 1, 1]
    (grad,) = torch.autograd.grad(per_token.sum(), logp)  # d(-A rho)/dlogp = -A rho where unclipped, else 0
    assert torch.allclose(grad, torch.tensor([-0.5, 0.9, -1.0, 1.5, 0.0, 0.0], dtype=torch.float64))


def test_cispo_by_hand():
    old = torch.zeros(6, dtype=torch.float64)
    logp = torch.log(RHO).requires_grad_()
    per_token, trust, capped = cispo_loss(logp, old, ADV, torch.arange(6), Config(clip_higher=0.28), 1.0)
    assert not trust.any()
    w = torch.tensor([0.5, 0.9, 1.0, 1.28, 1.28, 0.5], dtype=torch.float64)
    assert torch.allclose(per_token, -w * ADV * torch.log(RHO)) and capped.tolist() == [0, 0, 0, 1, 1, 0]
    (grad,) = torch.autograd.grad(per_token.sum(), logp)
    assert torch.allclose(grad, -w * ADV)  # the capped weight is a constant: every token keeps a gradient


def test_kl_estimators_by_hand():
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -0.5], dtype=torch.float64)
    d = torch.tensor([0.5, -1.0, 0.0], dtype=torch.float64)
    assert torch.allclose(kl_k1(logp, ref), d)
    assert torch.allclose(kl_k2(logp, ref), d ** 2 / 2)
    assert torch.allclose(kl_k3(logp, ref), torch.exp(-d) - 1 + d) and (kl_k3(logp, ref) >= 0).all()
    old = torch.tensor([-1.2, -2.0, -0.4], dtype=torch.float64)
    rho = torch.exp(logp - old)
    k4 = kl_k4(logp, ref, rho)
    assert torch.allclose(k4, rho * d)
    (grad,) = torch.autograd.grad(k4.sum(), logp)
    assert torch.allclose(grad, rho.detach() * (d + 1))  # d/dlogp (rho d) = rho d + rho


def test_beta_kl_enters_the_loss():
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, sums = grpo_loss(logp, logp, adv, torch.arange(2), 2.0, Config(beta=0.1, kl_estimator="k3"), ref_logp=ref)
    k3 = torch.exp(-(logp - ref)) - 1 + (logp - ref)
    assert torch.isclose(loss, ((-adv) + 0.1 * k3).sum() / 2) and torch.isclose(sums["kl"], k3.sum())


def test_token_denominator_weighs_per_token_across_uneven_micro_batches():
    """A 3-token and a 300-token sequence in separate micro-batches of one optimizer step:
    every token must get the same weight 1/303, not 1/(2*3) and 1/(2*300)."""
    torch.manual_seed(0)
    short = torch.randn(3, dtype=torch.float64).requires_grad_()
    long = torch.randn(300, dtype=torch.float64).requires_grad_()
    adv_s, adv_l = torch.full((3,), 2.0, dtype=torch.float64), torch.full((300,), -1.0, dtype=torch.float64)
    denom = step_denominator("token", n_tokens=303, n_sequences=2)
    total = sum(grpo_loss(lp, lp.detach(), a, torch.zeros(len(lp), dtype=torch.long), denom, Config())[0]
                for lp, a in ((short, adv_s), (long, adv_l)))
    total.backward()
    assert torch.allclose(short.grad, torch.full((3,), -2.0 / 303, dtype=torch.float64))
    assert torch.allclose(long.grad, torch.full((300,), 1.0 / 303, dtype=torch.float64))
    assert math.isclose(total.item(), (-2.0 * 3 + 300.0) / 303)  # on-policy: rho = 1, loss = mean(-A)
    per_micro_mean = 0.5 * (-2.0 + 1.0)
    assert not math.isclose(total.item(), per_micro_mean)


def test_constant_denominator():
    assert step_denominator("1024", n_tokens=77, n_sequences=8) == 1024 * 8
    assert step_denominator("token", n_tokens=77, n_sequences=8) == 77
    assert step_denominator("token", n_tokens=0, n_sequences=0) == 1  # nothing to train on: no division by zero


def test_tis_weight_multiplies_policy_term_only():
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    w = torch.tensor([0.5, 2.0], dtype=torch.float64)
    loss, _ = grpo_loss(logp, logp, adv, torch.arange(2), 1.0, Config(beta=0.1), ref_logp=ref, tis_weight=w)
    k3 = torch.exp(-(logp - ref)) - 1 + (logp - ref)
    assert torch.isclose(loss, (-adv * w).sum() + 0.1 * k3.sum())


def test_mismatch_masks_by_hand():
    """Ratios pi_old/pi_vllm of 5 tokens in 2 sequences (3 + 2 tokens), band [1/2, 2]."""
    vllm = torch.zeros(5, dtype=torch.float64)
    old = torch.log(torch.tensor([1.0, 2.5, 1.1, 0.6, 0.45], dtype=torch.float64))
    seq = torch.tensor([0, 0, 0, 1, 1])
    assert mismatch_keep(old, vllm, seq, "token", 2.0).tolist() == [1, 0, 1, 1, 0]
    # geometric means: (1 * 2.5 * 1.1)^(1/3) = 1.40 (kept), (0.6 * 0.45)^(1/2) = 0.52 (kept)
    assert mismatch_keep(old, vllm, seq, "sequence", 2.0).tolist() == [1, 1, 1, 1, 1]
    # with a tighter band [1/1.3, 1.3] the first sequence leaves, the second too (0.52 < 0.77)
    assert mismatch_keep(old, vllm, seq, "sequence", 1.3).tolist() == [0, 0, 0, 0, 0]
    assert mismatch_keep(old, vllm, seq, "sequence", 1.45).tolist() == [1, 1, 1, 0, 0]
    assert mismatch_keep(old[:0], vllm[:0], seq[:0], "sequence", 2.0).numel() == 0


def test_mask_drops_the_policy_term_only():
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -1.0], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    keep = torch.tensor([0.0, 1.0], dtype=torch.float64)
    loss, sums = grpo_loss(logp, logp.detach(), adv, torch.arange(2), 1.0, Config(beta=0.1), ref_logp=ref, keep=keep)
    k3 = torch.exp(-(logp - ref)) - 1 + (logp - ref)
    assert torch.isclose(loss, -adv[1] + 0.1 * k3.sum()) and torch.isclose(sums["pg_loss"], -adv[1])
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0] == 0.1 * (1 - torch.exp(-(logp[0] - ref[0])))  # only the KL moves a masked token


def test_unknown_loss_fn():
    """Config refuses the name first; an object that is not a Config gets one line too."""
    with pytest.raises(ValueError, match="not implemented"):
        grpo_loss(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1, dtype=torch.long), 1.0,
                  SimpleNamespace(loss_fn="ppo"))
