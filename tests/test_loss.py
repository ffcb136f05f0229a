import math
from types import SimpleNamespace

import pytest
import torch

from config import Config
from loss import (cispo_loss, dapo_loss, group_advantages, grpo_loss, kl_k1, kl_k2, kl_k3, kl_k4, mismatch_mask,
                  step_denominator)
from infra.policy import token_logprobs


def naive_logprobs(hidden, weight, targets, temperature, head_ids):
    """The reference: log_softmax over the full (N, V) logits, in float64."""
    logp_all = torch.log_softmax(hidden.double() @ weight.double().t() / temperature, -1)  # (N, V)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, targets[:, None])[:, 0], entropy, logp_all.gather(-1, head_ids), logp_all


@pytest.mark.parametrize("n, chunk_size, temperature, heads", [
    (37, 8, 1.0, 0),  # plain: 5 chunks, the last one short, no head
    (37, 8, 0.7, 3),  # temperature, this policy's top 3
    (37, 8, 1.3, "given"),  # head ids given (repeats and the target among them allowed)
    (16, 8, 0.7, 2),  # N a multiple of the chunk
    (5, 8, 0.7, "given"),  # N below one chunk
    (0, 8, 0.7, 3),  # an empty selection
])
def test_chunked_logprobs_match_float64_log_softmax(n, chunk_size, temperature, heads):
    """Values and the gradients of hidden and weight through logp and head_logp, against the
    full log_softmax; the gradient of the chunks is written by hand (_ChunkedLogprobs)."""
    g = torch.Generator().manual_seed(n)
    hidden = torch.randn(n, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (n,), generator=g)
    given = torch.randint(0, 50, (n, 4), generator=g) if heads == "given" else None
    logp, ent, head, ids = token_logprobs(hidden, weight, targets, temperature, chunk_size, head_ids=given,
                                          head_size=0 if heads == "given" else heads)
    ref_logp, ref_ent, ref_head, ref_all = naive_logprobs(hidden, weight, targets, temperature, ids)
    expected_ids = given if heads == "given" else ref_all.topk(heads, -1).indices
    assert torch.equal(ids, expected_ids) and head.shape == (n, expected_ids.shape[1])
    assert torch.allclose(logp, ref_logp, atol=1e-12) and torch.allclose(head, ref_head, atol=1e-12)
    assert torch.allclose(ent, ref_ent, atol=1e-12) and not ent.requires_grad
    c, c_head = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(head.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((c * logp).sum() + (c_head * head).sum(), (hidden, weight))
    ref_grads = torch.autograd.grad((c * ref_logp).sum() + (c_head * ref_head).sum(), (hidden, weight))
    for got, ref in zip(grads, ref_grads):
        assert torch.allclose(got, ref, atol=1e-12), (got - ref).abs().max()


def test_chunked_logprobs_gradcheck():
    """Finite differences in float64 on a tiny shape: 3 chunks, temperature, head ids given."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 4, generator=g, dtype=torch.float64, requires_grad=True)
    targets, given = torch.randint(0, 11, (7,), generator=g), torch.randint(0, 11, (7, 2), generator=g)
    fn = lambda h, w: token_logprobs(h, w, targets, 0.7, chunk_size=3, head_ids=given)[::2]  # noqa: E731 logp, head_logp
    assert torch.autograd.gradcheck(fn, (hidden, weight))


@pytest.mark.parametrize("grad_of", ["hidden", "weight"])
def test_chunked_logprobs_with_one_input_frozen(grad_of):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(20, 16, generator=g, dtype=torch.float64, requires_grad=grad_of == "hidden")
    weight = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=grad_of == "weight")
    targets = torch.randint(0, 50, (20,), generator=g)
    logp, _, head, ids = token_logprobs(hidden, weight, targets, 0.7, chunk_size=8, head_size=2)
    ref_logp, _, ref_head, _ = naive_logprobs(hidden, weight, targets, 0.7, ids)
    leaf = hidden if grad_of == "hidden" else weight
    got, = torch.autograd.grad(logp.sum() + head.sum(), leaf)
    ref, = torch.autograd.grad(ref_logp.sum() + ref_head.sum(), leaf)
    assert torch.allclose(got, ref, atol=1e-12)


def test_bf16_gradients_come_back_in_bf16_from_float32_sums():
    """bf16 hidden and head (FSDP2's mixed precision): the gradients are summed in float32 and
    rounded to bf16 once, so each is within bf16's rounding (2^-9 relative) of the float64 one."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 64, generator=g).to(torch.bfloat16).requires_grad_()
    weight = (torch.randn(1000, 64, generator=g) / 4).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 1000, (40,), generator=g)
    logp, _, head, ids = token_logprobs(hidden, weight, targets, 0.7, chunk_size=16, head_size=3)
    (logp.sum() + head.sum()).backward()
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref_logp, _, ref_head, _ = naive_logprobs(h64, w64, targets, 0.7, ids)
    (ref_logp.sum() + ref_head.sum()).backward()
    for got, ref in ((hidden.grad, h64.grad), (weight.grad, w64.grad)):
        assert got.dtype == torch.bfloat16
        assert ((got.double() - ref).abs() <= 2 ** -8 * ref.abs() + 1e-6).all()


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


@pytest.mark.parametrize("normalization", ["standard", "centered"])
@pytest.mark.parametrize("value", [0.1, 1 / 3, 2 / 3, 0.6, 0.9])
def test_alike_groups_get_exactly_zero(value, normalization):
    """Eight equal rewards that float32 cannot represent: the float32 mean is a rounding off and
    the std ~1e-8, which (r - mean) / (std + eps) used to blow up to advantages of +-0.06."""
    rewards = torch.tensor([value] * 8 + [value, 0.0] * 4)  # an alike group, then one with signal
    adv, std = group_advantages(rewards, 8, normalization)
    assert torch.equal(adv[:8], torch.zeros(8)) and torch.equal(std[:8], torch.zeros(8))
    signal = torch.tensor([value, 0.0] * 4)
    s = signal.std().item()
    expected = signal - signal.mean() if normalization == "centered" else (signal - signal.mean()) / (s + 1e-6)
    assert torch.allclose(adv[8:], expected) and torch.allclose(std[8:], torch.full((8,), s))


# rho and A chosen to hit every branch of max(-A rho, -A clip(rho, 0.8, 1.28))
RHO = torch.tensor([0.5, 0.9, 1.0, 1.5, 1.5, 0.5], dtype=torch.float64)
ADV = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0], dtype=torch.float64)


def test_dapo_by_hand():
    old = torch.zeros(6, dtype=torch.float64)
    logp = torch.log(RHO).requires_grad_()
    cfg = Config(clip_lower=0.2, clip_higher=0.28)
    per_token, trust, clipped = dapo_loss(logp, old, ADV, cfg)
    assert not trust.any()
    assert torch.allclose(per_token, torch.tensor([-0.5, 0.9, -1.0, 1.5, -1.28, 0.8], dtype=torch.float64))
    assert clipped.tolist() == [0, 0, 0, 0, 1, 1]
    (grad,) = torch.autograd.grad(per_token.sum(), logp)  # d(-A rho)/dlogp = -A rho where unclipped, else 0
    assert torch.allclose(grad, torch.tensor([-0.5, 0.9, -1.0, 1.5, 0.0, 0.0], dtype=torch.float64))


def test_cispo_by_hand():
    old = torch.zeros(6, dtype=torch.float64)
    logp = torch.log(RHO).requires_grad_()
    per_token, trust, capped = cispo_loss(logp, old, ADV, Config(clip_higher=0.28))
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


def test_tis_weight_multiplies_policy_term_and_kl():
    """The tokens were sampled by vLLM: rho = pi/pi_old x w = w here, and k3 is weighted by sg(rho)."""
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    ref = torch.tensor([-1.5, -1.0], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    w = torch.tensor([0.5, 2.0], dtype=torch.float64)
    loss, _ = grpo_loss(logp, logp, adv, torch.arange(2), 1.0, Config(beta=0.1), ref_logp=ref, tis_weight=w)
    k3 = torch.exp(-(logp - ref)) - 1 + (logp - ref)
    assert torch.isclose(loss, (-adv * w).sum() + 0.1 * (w * k3).sum())


def test_mismatch_masks_by_hand():
    """Ratios pi_old/pi_vllm of 5 tokens in 2 sequences (3 + 2 tokens), band [1/2, 2]."""
    vllm = torch.zeros(5, dtype=torch.float64)
    old = torch.log(torch.tensor([1.0, 2.5, 1.1, 0.6, 0.45], dtype=torch.float64))
    seq = torch.tensor([0, 0, 0, 1, 1])
    assert mismatch_mask(old, vllm, seq, "token", 2.0).tolist() == [1, 0, 1, 1, 0]
    # geometric means: (1 * 2.5 * 1.1)^(1/3) = 1.40 (kept), (0.6 * 0.45)^(1/2) = 0.52 (kept)
    assert mismatch_mask(old, vllm, seq, "sequence", 2.0).tolist() == [1, 1, 1, 1, 1]
    # with a tighter band [1/1.3, 1.3] the first sequence leaves, the second too (0.52 < 0.77)
    assert mismatch_mask(old, vllm, seq, "sequence", 1.3).tolist() == [0, 0, 0, 0, 0]
    assert mismatch_mask(old, vllm, seq, "sequence", 1.45).tolist() == [1, 1, 1, 0, 0]
    assert mismatch_mask(old[:0], vllm[:0], seq[:0], "sequence", 2.0).numel() == 0


def test_mask_drops_the_policy_term_only():
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -1.0], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    keep = torch.tensor([0.0, 1.0], dtype=torch.float64)
    loss, sums = grpo_loss(logp, logp.detach(), adv, torch.arange(2), 1.0, Config(beta=0.1), ref_logp=ref, mismatch_mask=keep)
    k3 = torch.exp(-(logp - ref)) - 1 + (logp - ref)
    assert torch.isclose(loss, -adv[1] + 0.1 * k3.sum()) and torch.isclose(sums["pg_loss"], -adv[1])
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0] == 0.1 * (1 - torch.exp(-(logp[0] - ref[0])))  # only the KL moves a masked token


def test_unknown_loss_fn():
    """Config refuses the name first; an object that is not a Config gets one line too."""
    with pytest.raises(ValueError, match="not implemented"):
        grpo_loss(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1, dtype=torch.long), 1.0,
                  SimpleNamespace(loss_fn="ppo", objective=None))
