"""The objectives and KL estimators: their tables agree with Config, GSPO and the ESS objective
by hand, the README's example objective runs, top-k KL by exact enumeration."""

import math
import os
import re

import pytest
import torch

import loss
from config import Config
from loss import (KL_ESTIMATORS, OBJECTIVES, TOPK_KL, dapo_loss, ess_from_sums, ess_loss, ess_sums, grpo_loss, gspo_loss,
                  kl_topk, kl_topk_forward)
from helpers import run_worker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config_choices(field):
    """The names Config accepts for a field, in its order, read from its refusal of another."""
    with pytest.raises(ValueError) as refused:
        Config(**{field: "no-such-name"})
    return re.search(r"is not one of ([^(]*)", str(refused.value)).group(1).strip().split(", ")


def ess(rho):
    """The ESS of one process's ratios (update.ess reduces the sums over ranks)."""
    return ess_from_sums(ess_sums(rho))


def test_objective_and_kl_tables_agree_with_config():
    assert set(config_choices("loss_fn")) == set(OBJECTIVES)
    assert set(config_choices("kl_estimator")) == set(KL_ESTIMATORS) | set(TOPK_KL) | {"advantage"}  # apart


def test_gspo_by_hand():
    """Two sequences of 2 and 3 tokens, range [0.9, 1.1]. Sequence 0: log ratios 0.1, 0.3, so
    s_0 = exp(0.2) = 1.22 > 1.1 with A = 1: clipped, -1.1 per token, no gradient. Sequence 1:
    -0.2, 0, -0.4, s_1 = exp(-0.2) = 0.82 < 0.9 with A = 0.5: kept, -A s_1 per token, and each
    token's gradient is -A s_1 / denominator, s_1 not its own ratio (0.82, 1, 0.67)."""
    old = torch.tensor([-1.0, -2.0, -0.5, -1.5, -3.0], dtype=torch.float64)
    logp = (old + torch.tensor([0.1, 0.3, -0.2, 0.0, -0.4], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([1.0, 1.0, 0.5, 0.5, 0.5], dtype=torch.float64)
    seq_ids = torch.tensor([0, 0, 1, 1, 1])
    cfg = Config(loss_fn="gspo", clip_lower=0.1, clip_higher=0.1)
    s1 = math.exp(-0.2)
    pg, trust, clipped = gspo_loss(logp, old, adv, cfg, seq_ids)
    assert torch.allclose(pg, torch.tensor([-1.1, -1.1, -0.5 * s1, -0.5 * s1, -0.5 * s1], dtype=torch.float64))
    assert clipped.tolist() == [1, 1, 0, 0, 0] and not trust.any()
    value, sums = grpo_loss(logp, old, adv, seq_ids, 5.0, cfg)
    assert value.item() == pytest.approx((2 * -1.1 + 3 * -0.5 * s1) / 5) and sums["clipped"] == 2
    (grad,) = torch.autograd.grad(value, logp)
    assert torch.allclose(grad, torch.tensor([0, 0, -0.5 * s1 / 5, -0.5 * s1 / 5, -0.5 * s1 / 5], dtype=torch.float64))


def test_gspo_of_one_token_sequences_is_dapo():
    """s_i = rho when every sequence has one token: same values, clipped flags and gradients."""
    g = torch.Generator().manual_seed(0)
    old = -3 * torch.rand(9, generator=g, dtype=torch.float64)
    logp = (old + 0.5 * torch.randn(9, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(9, generator=g, dtype=torch.float64)
    cfg = Config(clip_lower=0.2, clip_higher=0.28)
    gspo, dapo = gspo_loss(logp, old, adv, cfg, torch.arange(9)), dapo_loss(logp, old, adv, cfg)
    assert 0 < dapo[2].sum() < 9  # some tokens clipped, some not
    for a, b in zip(gspo, dapo):
        assert torch.allclose(a, b, atol=1e-12)
    grads = [torch.autograd.grad(pg.sum(), logp)[0] for pg, _, _ in (gspo, dapo)]
    assert torch.allclose(*grads, atol=1e-12)


@pytest.mark.subprocess
def test_gspo_trains_in_one_process(tiny_model_dir, tmp_path):
    """loss_fn=gspo through the trainer's step (3 rollout batches, 2 mini-batches each, so the
    second is off-policy) with the paper's clip range: finite, the sequence clip acts, the
    policy moves."""
    from transformers import AutoModelForCausalLM

    got = run_worker("train", tiny_model_dir, tmp_path / "gspo.pt", 1, 0, "gspo", "k3", "clip_lower=0.0003",
              "clip_higher=0.0004")
    losses = torch.tensor(got["losses"])  # loss, kl, clip_frac, grad_norm, ess, grad_norm_max per step
    assert torch.isfinite(losses).all() and (losses[:, 2] <= 1).all() and (losses[:, 2] > 0).any()
    init = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    k = "model.layers.0.mlp.up_proj.weight"
    assert (got["policy"][k] - init[k]).abs().max() > 1e-3


def readme_section(title):
    """The text of a README section, up to the next heading."""
    text = open(os.path.join(ROOT, "README.md")).read()
    return re.split(r"\n#{2,3} ", text.split(f"\n### {title}\n", 1)[1])[0]


def test_readme_example_objective_runs(tmp_path):
    """The README's "Adding an objective", as written: its python block is a file of one's own that
    defines a function and its row; Config accepts --loss_fn file.py:name, and grpo_loss trains with it.
    A name that is not an Objective is refused in one line."""
    section = readme_section("Adding an objective")
    (block,) = re.findall(r"```python\n(.*?)```", section, re.S)
    path, name = re.findall(r"train.py --loss_fn (\w+\.py):(\w+)", section)[0]
    (tmp_path / path).write_text(block)
    spec = f"{tmp_path / path}:{name}"
    with pytest.raises(ValueError, match="does not read clip_higher"):  # its row names no clip field
        Config(loss_fn=spec, clip_higher=0.5)
    with pytest.raises(ValueError, match="is not a loss.Objective but 'function'"):
        Config(loss_fn=f"{tmp_path / path}:reinforce_loss")
    (tmp_path / "wrong.py").write_text(block + "\nreads_ess = Objective(reinforce_loss, ess=True)\n")
    with pytest.raises(ValueError, match=r"its function cannot take \(logp, old_logp, adv, cfg, ess_value=\)"):
        Config(loss_fn=f"{tmp_path / 'wrong.py'}:reads_ess")  # refused before anything starts, not in the step
    assert Config(loss_fn=spec).objective is Config(loss_fn=spec).objective  # the file runs once
    cfg = Config(loss_fn=spec)
    g = torch.Generator().manual_seed(0)
    old = -3 * torch.rand(6, generator=g, dtype=torch.float64)
    logp = (old + 0.1 * torch.randn(6, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0], dtype=torch.float64)
    value, _ = grpo_loss(logp, old, adv, torch.tensor([0, 0, 1, 1, 1, 2]), 6.0, cfg)
    (grad,) = torch.autograd.grad(value, logp)
    assert torch.isfinite(value) and torch.isfinite(grad).all() and torch.allclose(grad, -adv / 6.0)


V = 12


def logits(seed):
    return torch.randn(V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def expected_topk(k, theta, ref_logits, old_logits, corrected=True, behaviour_logits=None, estimator=kl_topk,
                  head_of="old"):
    """E over the sampled token p ~ mu of the estimator's value and of its gradient,
    enumerating all V tokens (no sampling noise). mu is pi_old unless a behaviour policy is
    given (the vLLM weights that sampled); its tail is then weighted by pi_old/mu as well.
    head_of: whose top k is the head, pi_old's (the trainer's own references) or ref's (a teacher's)."""
    logpi, logref, logold = (torch.log_softmax(x, -1) for x in (theta, ref_logits, old_logits))
    logmu = logold if behaviour_logits is None else torch.log_softmax(behaviour_logits, -1)
    q = (logold if head_of == "old" else logref).topk(k).indices
    in_head = torch.isin(torch.arange(V), q)  # (V,): is token p in q
    # the default is what grpo_loss uses in training: only the published form is asked for by name
    kwargs = {} if corrected else {"corrected": False}
    if behaviour_logits is not None:
        kwargs["behaviour_weight"] = torch.exp(logold - logmu)
    est = estimator(logpi, logref, logold, logpi[q].expand(V, k), logref[q].expand(V, k), in_head, **kwargs)
    weights = logmu.exp().detach()
    value = (weights * est).sum()
    (grad,) = torch.autograd.grad(value, theta)
    return value, grad


def exact_kl(theta, ref_logits, forward=False):
    """KL(pi || ref), or KL(ref || pi) with forward, and its gradient in theta."""
    logpi, logref = torch.log_softmax(theta, -1), torch.log_softmax(ref_logits, -1)
    kl = (logref.exp() * (logref - logpi)).sum() if forward else (logpi.exp() * (logpi - logref)).sum()
    return kl, torch.autograd.grad(kl, theta)[0]


@pytest.mark.parametrize("k", [0, 3, V])
def test_topk_kl_is_unbiased_in_value_and_gradient_on_policy(k):
    theta = logits(0).requires_grad_()
    value, grad = expected_topk(k, theta, logits(1), theta.detach())
    kl, kl_grad = exact_kl(theta, logits(1))
    assert torch.allclose(value, kl, atol=1e-12)
    assert torch.allclose(grad, kl_grad, atol=1e-6)


@pytest.mark.parametrize("k", [0, 3, 7, V])
def test_topk_kl_is_unbiased_off_policy(k):
    """Tokens sampled by an older policy: q is its top-k and the tail is weighted by pi/pi_old."""
    theta = logits(0).requires_grad_()
    value, grad = expected_topk(k, theta, logits(1), logits(2))
    kl, kl_grad = exact_kl(theta, logits(1))
    assert torch.allclose(value, kl, atol=1e-12) and torch.allclose(grad, kl_grad, atol=1e-6)


@pytest.mark.parametrize("k", [0, 3, V])
def test_topk_kl_is_unbiased_when_another_policy_sampled(k):
    """Tokens sampled by vLLM's weights mu (older than pi_old with async_steps > 0): the tail
    weight pi/pi_old x pi_old/mu keeps value and gradient unbiased."""
    theta = logits(0).requires_grad_()
    value, grad = expected_topk(k, theta, logits(1), logits(2), behaviour_logits=logits(3))
    kl, kl_grad = exact_kl(theta, logits(1))
    assert torch.allclose(value, kl, atol=1e-12) and torch.allclose(grad, kl_grad, atol=1e-6)


@pytest.mark.parametrize("k", [0, 3, 7, V])
@pytest.mark.parametrize("head_of", ["old", "ref"])
@pytest.mark.parametrize("sampler", ["on-policy", "pi_old", "another"])
def test_topk_forward_kl_is_unbiased_for_the_forward_kl(k, head_of, sampler):
    """topk_forward over pi_old's head or the reference's (a teacher's), tokens sampled by pi itself, by
    pi_old, or by vLLM's older weights: value and gradient are the forward KL(ref || pi)'s exactly, and not
    the reverse KL's."""
    theta = logits(0).requires_grad_()
    old, behaviour = (theta.detach(), None) if sampler == "on-policy" else (logits(2), None)
    if sampler == "another":
        behaviour = logits(3)
    value, grad = expected_topk(k, theta, logits(1), old, behaviour_logits=behaviour, estimator=kl_topk_forward,
                                head_of=head_of)
    kl, kl_grad = exact_kl(theta, logits(1), forward=True)
    assert torch.allclose(value, kl, atol=1e-12) and torch.allclose(grad, kl_grad, atol=1e-9)
    assert not torch.allclose(grad, exact_kl(theta, logits(1))[1], atol=1e-3)


@pytest.mark.parametrize("kl_estimator", ["k4", "topk"])
def test_grpo_loss_weights_the_kl_by_the_policy_that_sampled(kl_estimator):
    """Through grpo_loss as the trainer calls it: tokens p ~ mu (vLLM), old_logp from pi_old,
    tis_weight = min(pi_old/mu, cap) with a cap that does not bind. E_mu of the KL term is the
    exact KL and its expected gradient the reverse-KL gradient; weighting by pi/pi_old alone
    (mu taken for pi_old) misses both."""
    theta = logits(0).requires_grad_()
    logpi, logref, logold, logmu = (torch.log_softmax(x, -1) for x in (theta, logits(1), logits(2), logits(3)))
    tis = torch.exp(logold - logmu).clamp(max=100.0)
    assert tis.max() < 100.0
    q = logold.topk(3).indices
    cfg = Config(beta=1.0, kl_estimator=kl_estimator)
    value = 0.0
    for p in range(V):  # one sampled token per call, weighted by its probability under mu
        one = slice(p, p + 1)
        heads = (logpi[q][None], logref[q][None], torch.isin(torch.tensor([p]), q)) if kl_estimator == "topk" else None
        no_adv, one_seq = torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.long)
        loss, _ = grpo_loss(logpi[one], logold[one], no_adv, one_seq, 1.0, cfg, ref_logp=logref[one],
                            tis_weight=tis[one], kl_heads=heads)
        value = value + logmu[p].exp().detach() * loss
    (grad,) = torch.autograd.grad(value, theta)
    kl, kl_grad = exact_kl(theta, logits(1))
    assert torch.allclose(value, kl, atol=1e-12) and torch.allclose(grad, kl_grad, atol=1e-6)


def sampled_targets(theta, ref_logits):
    """What k1, k2, k3 estimate in expectation under pi, exactly over the vocabulary: the value
    and the gradient of (value target, gradient target). k1: the KL, zero gradient; k2: E_pi[d^2]/2,
    the reverse-KL gradient; k3: the KL, the forward KL(pi_ref || pi)'s gradient."""
    logpi, logref = torch.log_softmax(theta, -1), torch.log_softmax(ref_logits, -1)
    kl, kl_grad = exact_kl(theta, ref_logits)
    (forward_grad,) = torch.autograd.grad((logref.exp() * (logref - logpi)).sum(), theta)
    half_d2 = (logpi.exp() * (logpi - logref) ** 2 / 2).sum().detach()
    return {"k1": (kl, torch.zeros(V, dtype=torch.float64)), "k2": (half_d2, kl_grad), "k3": (kl, forward_grad)}


@pytest.mark.parametrize("kl_estimator", ["k1", "k2", "k3"])
def test_k1_k2_k3_estimate_under_pi_when_another_policy_sampled(kl_estimator):
    """Through grpo_loss: tokens p ~ mu (vLLM's weights), old_logp from pi_old, tis_weight =
    min(pi_old/mu, cap) with a cap that does not bind. Weighted by sg(pi/mu), E_mu of each
    estimator's value and gradient is what it is on-policy under pi; on-policy (old_logp =
    sg(logp), no TIS) the weighted forms are the plain ones bit for bit."""
    theta = logits(0).requires_grad_()
    logpi, logref, logold, logmu = (torch.log_softmax(x, -1) for x in (theta, logits(1), logits(2), logits(3)))
    tis = torch.exp(logold - logmu).clamp(max=100.0)
    assert tis.max() < 100.0
    cfg = Config(beta=1.0, kl_estimator=kl_estimator)
    no_adv, one_seq = torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.long)
    value = 0.0
    for p in range(V):  # one sampled token per call, weighted by its probability under mu
        one = slice(p, p + 1)
        loss, _ = grpo_loss(logpi[one], logold[one], no_adv, one_seq, 1.0, cfg, ref_logp=logref[one],
                            tis_weight=tis[one])
        value = value + logmu[p].exp().detach() * loss
    (grad,) = torch.autograd.grad(value, theta)
    target, target_grad = sampled_targets(theta, logits(1))[kl_estimator]
    assert torch.allclose(value, target, atol=1e-12) and torch.allclose(grad, target_grad, atol=1e-12)
    # on-policy: rho = exp(logp - sg(logp)) = 1 exactly, so neither value nor gradient moves
    logp = logpi.detach().requires_grad_()
    d = logp - logref.detach()
    plain = {"k1": d, "k2": 0.5 * d ** 2, "k3": torch.exp(-d) - 1 + d}[kl_estimator]
    loss, _ = grpo_loss(logp, logp.detach(), torch.zeros(V, dtype=torch.float64), torch.arange(V), 3.0, cfg,
                        ref_logp=logref.detach())
    assert torch.equal(loss, plain.sum() / 3.0)
    assert torch.equal(torch.autograd.grad(loss, logp)[0], torch.autograd.grad(plain.sum() / 3.0, logp)[0])


def test_published_topk_gradient_is_biased_by_grad_pi_of_q():
    """Without the zero-valued (r - 1) term the value is still right but the expected
    gradient carries grad pi(q); at k = 0 and k = |V| that term vanishes."""
    theta = logits(0).requires_grad_()
    kl, kl_grad = exact_kl(theta, logits(1))
    value, grad = expected_topk(3, theta, logits(1), theta.detach(), corrected=False)
    assert torch.allclose(value, kl, atol=1e-12)
    assert not torch.allclose(grad, kl_grad, atol=1e-3)
    q = torch.log_softmax(theta.detach(), -1).topk(3).indices
    (grad_pi_q,) = torch.autograd.grad(torch.softmax(theta, -1)[q].sum(), theta)
    assert torch.allclose(grad - kl_grad, grad_pi_q, atol=1e-12)  # exactly the extra term
    for k in (0, V):
        assert torch.allclose(expected_topk(k, theta, logits(1), theta.detach(), corrected=False)[1], kl_grad, atol=1e-6)


def test_topk_enters_grpo_loss_with_beta():
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64)
    head = torch.log(torch.tensor([[0.5, 0.2], [0.4, 0.3]], dtype=torch.float64))
    ref_head = torch.log(torch.tensor([[0.4, 0.3], [0.4, 0.1]], dtype=torch.float64))
    in_head = torch.tensor([True, False])
    ref_logp = torch.tensor([-1.5, -1.0], dtype=torch.float64)
    loss, sums = grpo_loss(logp, logp, torch.zeros(2, dtype=torch.float64), torch.arange(2), 1.0,
                           Config(beta=1.0, kl_estimator="topk"), ref_logp=ref_logp, kl_heads=(head, ref_head, in_head))
    h = (head.exp() * (head - ref_head)).sum(-1)
    assert torch.allclose(sums["kl"], h.sum() + (logp[1] - ref_logp[1])) and torch.isclose(loss, sums["kl"])


def test_ess_bounds():
    assert ess(torch.full((50,), 0.7)) == pytest.approx(1.0)
    one = torch.zeros(50)
    one[17] = 3.0
    assert ess(one) == pytest.approx(1 / 50)
    rho = torch.tensor([1.0, 2.0, 3.0])
    assert ess(rho) == pytest.approx(36 / (3 * 14))


def test_ess_objective_by_hand():
    old = torch.zeros(4, dtype=torch.float64)
    rho = torch.tensor([0.5, 0.9, 1.2, 2.0], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 1.0, -2.0], dtype=torch.float64)
    logp = torch.log(rho).requires_grad_()
    e = ess(rho)  # (4.6)^2 / (4 * 6.5) = 0.8138...
    assert e == pytest.approx(4.6 ** 2 / (4 * 6.5))
    pg, trust, capped = ess_loss(logp, old, adv, Config(loss_fn="ess"), e)
    per_token = pg + trust
    w = rho.clamp(max=e)
    d = torch.log(rho)
    assert torch.allclose(pg, -w * adv * d) and torch.allclose(trust, (1 - e) * (torch.exp(-d) - 1 + d))
    assert capped.tolist() == [0, 1, 1, 1]
    (grad,) = torch.autograd.grad(per_token.sum(), logp)
    assert torch.allclose(grad, -w * adv + (1 - e) * (1 - torch.exp(-d)))
    loss, _ = grpo_loss(logp, old, adv, torch.arange(4), 4.0, Config(loss_fn="ess"), ess_value=e)
    assert torch.isclose(loss, per_token.sum() / 4)


def test_ess_trust_term_is_not_weighted_by_tis_nor_logged_as_pg_loss():
    old = torch.zeros(3, dtype=torch.float64)
    logp = torch.log(torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64))
    adv = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    tis = torch.tensor([0.5, 2.0, 1.5], dtype=torch.float64)
    cfg = Config(loss_fn="ess")
    pg, trust, _ = ess_loss(logp, old, adv, cfg, 0.7)
    loss, sums = grpo_loss(logp, old, adv, torch.arange(3), 3.0, cfg, ess_value=0.7, tis_weight=tis)
    assert trust.abs().sum() > 0.1
    assert torch.isclose(loss, (tis * pg + trust).sum() / 3)
    assert torch.isclose(sums["pg_loss"], (tis * pg).sum()) and torch.isclose(sums["ess_trust"], trust.sum())
    assert "ratio" not in sums


def test_ess_of_uniform_ratios_is_the_plain_policy_gradient():
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    pg, trust, _ = ess_loss(logp, logp.detach(), adv, Config(loss_fn="ess"), ess(torch.ones(3)))
    (grad,) = torch.autograd.grad((pg + trust).sum(), logp)
    assert torch.allclose(grad, -adv)
