"""Top-k KL by exact enumeration, ESS and the ESS objective by hand."""

import pytest
import torch

from loss import ess, ess_loss, grpo_loss, kl_topk

V = 12


def logits(seed):
    return torch.randn(V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def expected_topk(k, theta, ref_logits, old_logits, corrected=True, behaviour_logits=None):
    """E over the sampled token p ~ mu of the estimator's value and of its gradient,
    enumerating all V tokens (no sampling noise). mu is pi_old unless a behaviour policy is
    given (the vLLM weights that sampled); its tail is then weighted by pi_old/mu as well."""
    logpi, logref, logold = (torch.log_softmax(x, -1) for x in (theta, ref_logits, old_logits))
    logmu = logold if behaviour_logits is None else torch.log_softmax(behaviour_logits, -1)
    q = logold.topk(k).indices  # the top-k of pi_old, as the trainer computes it
    in_head = torch.isin(torch.arange(V), q)  # (V,): is token p in q
    # the default is what grpo_loss uses in training: only the published form is asked for by name
    kwargs = {} if corrected else {"corrected": False}
    if behaviour_logits is not None:
        kwargs["behaviour_weight"] = torch.exp(logold - logmu)
    est = kl_topk(logpi, logref, logold, logpi[q].expand(V, k), logref[q].expand(V, k), in_head, **kwargs)
    weights = logmu.exp().detach()
    value = (weights * est).sum()
    (grad,) = torch.autograd.grad(value, theta)
    return value, grad


def exact_kl(theta, ref_logits):
    logpi, logref = torch.log_softmax(theta, -1), torch.log_softmax(ref_logits, -1)
    kl = (logpi.exp() * (logpi - logref)).sum()
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
    value = 0.0
    for p in range(V):  # one sampled token per call, weighted by its probability under mu
        one = slice(p, p + 1)
        topk = (logpi[q][None], logref[q][None], torch.isin(torch.tensor([p]), q)) if kl_estimator == "topk" else None
        loss, _ = grpo_loss(logpi[one], logold[one], torch.zeros(1, dtype=torch.float64), 1.0, ref_logp=logref[one],
                            beta=1.0, kl_estimator=kl_estimator, tis_weight=tis[one], topk=topk)
        value = value + logmu[p].exp().detach() * loss
    (grad,) = torch.autograd.grad(value, theta)
    kl, kl_grad = exact_kl(theta, logits(1))
    assert torch.allclose(value, kl, atol=1e-12) and torch.allclose(grad, kl_grad, atol=1e-6)


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
    loss, sums = grpo_loss(logp, logp, torch.zeros(2, dtype=torch.float64), 1.0, ref_logp=ref_logp, beta=1.0,
                           kl_estimator="topk", topk=(head, ref_head, in_head))
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
    pg, trust, capped = ess_loss(logp, old, adv, e)
    per_token = pg + trust
    w = rho.clamp(max=e)
    d = torch.log(rho)
    assert torch.allclose(pg, -w * adv * d) and torch.allclose(trust, (1 - e) * (torch.exp(-d) - 1 + d))
    assert capped.tolist() == [0, 1, 1, 1]
    (grad,) = torch.autograd.grad(per_token.sum(), logp)
    assert torch.allclose(grad, -w * adv + (1 - e) * (1 - torch.exp(-d)))
    loss, _ = grpo_loss(logp, old, adv, 4.0, loss_fn="ess", ess_value=e)
    assert torch.isclose(loss, per_token.sum() / 4)


def test_ess_trust_term_is_not_weighted_by_tis_nor_logged_as_pg_loss():
    old = torch.zeros(3, dtype=torch.float64)
    logp = torch.log(torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64))
    adv = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    tis = torch.tensor([0.5, 2.0, 1.5], dtype=torch.float64)
    pg, trust, _ = ess_loss(logp, old, adv, 0.7)
    loss, sums = grpo_loss(logp, old, adv, 3.0, loss_fn="ess", ess_value=0.7, tis_weight=tis)
    assert trust.abs().sum() > 0.1
    assert torch.isclose(loss, (tis * pg + trust).sum() / 3)
    assert torch.isclose(sums["pg_loss"], (tis * pg).sum()) and torch.isclose(sums["ess_trust"], trust.sum())
    assert "ratio" not in sums


def test_ess_of_uniform_ratios_is_the_plain_policy_gradient():
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    pg, trust, _ = ess_loss(logp, logp.detach(), adv, ess(torch.ones(3)))
    (grad,) = torch.autograd.grad((pg + trust).sum(), logp)
    assert torch.allclose(grad, -adv)
