"""Which KL each kl_estimator's gradient follows, against any reference (a teacher's included), by exact
enumeration over a small vocabulary: the expectation over the student's sampled tokens of the gradient of
grpo_loss's KL term equals autograd's gradient of the KL docs/algorithm.md names for it: the reverse
KL(pi, ref), the forward KL(ref, pi), or nothing (k1: zero). KL(a, b) = sum a log(a / b)."""

import re
from pathlib import Path

import pytest
import torch

from config import Config
from loss import grpo_loss

V, K = 6, 2  # the vocabulary; the top-k KL's head: the reference's K most likely tokens (a teacher's are its own)
DIRECTION = {"k1": "none", "k2": "reverse", "k3": "forward", "k4": "reverse", "topk": "reverse", "advantage": "reverse",
             "topk_forward": "forward"}


def logits(seed, *shape):
    return torch.randn(*shape, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def kl(direction, logpi, logref):
    """The KL a direction names, at each position (..., V) -> (...); "none": zero (with the graph, so its
    gradient is zero)."""
    if direction == "forward":
        return (logref.exp() * (logref - logpi)).sum(-1)
    return (logpi.exp() * (logpi - logref)).sum(-1) * (direction == "reverse")


def kl_term(logpi, logref, tokens, kl_estimator):
    """grpo_loss of one sampled sequence, tokens (T,), its student's and reference's logprobs (T, V) at each
    position: beta 1, reward advantage 0, on-policy (old_logp = sg(logp)), so the KL term alone."""
    at = torch.arange(len(tokens))
    q = logref.detach().topk(K, -1).indices  # (T, K)
    heads = (logpi.gather(-1, q), logref.gather(-1, q), (q == tokens[:, None]).any(-1))
    logp = logpi[at, tokens]
    topk = kl_estimator.startswith("topk")
    cfg = Config(beta=1.0, kl_estimator=kl_estimator, kl_topk=K if topk else 0)
    loss, _ = grpo_loss(logp, logp.detach(), torch.zeros_like(logp), torch.zeros_like(tokens), 1.0, cfg,
                        ref_logp=logref[at, tokens], kl_heads=heads if topk else None)
    return loss


@pytest.mark.parametrize("kl_estimator", list(DIRECTION))
def test_each_estimators_expected_gradient_is_that_of_the_kl_it_names(kl_estimator):
    """One position: sum over p of sg(pi(p)) grad loss(p) = grad of the named KL (zero for k1)."""
    theta, logref = logits(0).requires_grad_(), torch.log_softmax(logits(1), -1)
    logpi = torch.log_softmax(theta, -1)
    expected = sum(logpi[p].exp().detach() * kl_term(logpi[None], logref[None], torch.tensor([p]), kl_estimator)
                   for p in range(V))
    (grad,) = torch.autograd.grad(expected, theta, retain_graph=True)
    (want,) = torch.autograd.grad(kl(DIRECTION[kl_estimator], logpi, logref), theta, retain_graph=True)
    assert torch.allclose(grad, want, atol=1e-12)
    other = {"reverse": "forward", "forward": "reverse", "none": "reverse"}[DIRECTION[kl_estimator]]
    assert not torch.allclose(grad, torch.autograd.grad(kl(other, logpi, logref), theta)[0], atol=1e-3)


@pytest.mark.parametrize("kl_estimator", list(DIRECTION))
def test_over_two_steps_each_estimator_follows_its_kl_position_by_position(kl_estimator):
    """Two tokens, the second's distribution depending on the first: the expected gradient is that of the
    named KL summed over positions with the prefix's distribution held fixed, sum_t E_{x<t ~ sg(pi)} KL_t,
    not that of the KL between the two sequence distributions (which also differentiates the prefix's
    probability: the later positions' KL as a return; the discount of zero of Thinking Machines'
    "On-Policy Distillation")."""
    theta1, theta2 = logits(2).requires_grad_(), logits(3, V).requires_grad_()  # theta2[x1]: step 2 after x1
    ref1, ref2 = torch.log_softmax(logits(4), -1), torch.log_softmax(logits(5, V), -1)
    pi1, pi2 = torch.log_softmax(theta1, -1), torch.log_softmax(theta2, -1)  # (V,), (V, V)
    expected = 0.0
    for x1 in range(V):
        for x2 in range(V):
            rows, refs = torch.stack([pi1, pi2[x1]]), torch.stack([ref1, ref2[x1]])
            weight = (pi1[x1] + pi2[x1, x2]).exp().detach()
            expected = expected + weight * kl_term(rows, refs, torch.tensor([x1, x2]), kl_estimator)
    grad = torch.autograd.grad(expected, (theta1, theta2), retain_graph=True)
    d = DIRECTION[kl_estimator]
    per_position = kl(d, pi1, ref1) + (pi1.exp().detach() * kl(d, pi2, ref2)).sum()
    for g, w in zip(grad, torch.autograd.grad(per_position, (theta1, theta2), retain_graph=True)):
        assert torch.allclose(g, w, atol=1e-12)
    if d != "none":  # the sequences' KL weighs step 2 by pi(x1) (reverse, with its gradient) or ref(x1) (forward)
        prefix = (pi1 if d == "reverse" else ref1).exp()
        sequence = torch.autograd.grad(kl(d, pi1, ref1) + (prefix * kl(d, pi2, ref2)).sum(), (theta1, theta2))
        assert not all(torch.allclose(g, s, atol=1e-3) for g, s in zip(grad, sequence))


def test_the_docs_name_the_direction_each_estimator_follows():
    """docs/algorithm.md's KL table: each estimator's row names the direction the tests above check."""
    text = (Path(__file__).parents[1] / "docs" / "algorithm.md").read_text()
    rows = {m[1]: m[2] for m in re.finditer(r"^\| `(\w+)` \|.*\| (\w+)[^|]*\|$", text, re.M) if m[1] in DIRECTION}
    assert rows == DIRECTION
