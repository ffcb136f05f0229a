"""Pure functions, tensors in and tensors out: advantages, the GRPO objectives and KL estimators.

Tokens are handled flat: every function takes the N valid (completion) tokens of a
micro-batch as 1-D tensors, so padding never enters a sum. Each loss returns the *sum*
over its tokens divided by the denominator of the whole optimizer step, so gradients
accumulated over micro-batches and summed over ranks (update.py undoes FSDP's averaging)
equal the gradient of one loss over the whole step.
"""

import inspect
import math
from dataclasses import dataclass
from typing import Callable

import torch


# --- advantages


def group_advantages(rewards, group_size, normalization, eps=1e-6):
    """GRPO advantages of rewards (G * group_size,) laid out group after group.
    standard: (r - mean) / (std + eps); centered: r - mean (Dr GRPO drops the std).
    A group whose rewards are all equal gets advantage exactly 0 and std exactly 0.
    Also returns the per-sequence std of its group (0 marks a group with no signal)."""
    r = rewards.view(-1, group_size)  # (G, S)
    mean, std = r.mean(-1, keepdim=True), r.std(-1, keepdim=True)
    # "Alike" is max == min, not std == 0: equal rewards that float32 cannot represent (0.1, 2/3)
    # leave a float32 mean a rounding off and a std ~1e-8, and (r - mean) / (std + eps) then
    # turns that rounding into advantages of +-0.06 that push whatever the policy already does.
    alike = r.amax(-1, keepdim=True) == r.amin(-1, keepdim=True)  # (G, 1)
    std = std.masked_fill(alike, 0.0)
    adv = r - mean if normalization == "centered" else (r - mean) / (std + eps)
    return adv.masked_fill(alike, 0.0).reshape(-1), std.expand_as(r).reshape(-1)


# --- KL estimators of KL(pi || pi_ref), per token, d = logp - ref_logp
#
# Their values all estimate (k2: approximate) the reverse KL(pi || pi_ref), but topk_forward's (the forward
# KL(pi_ref || pi)); their gradients do not all follow their values. In expectation over pi: k1's is zero,
# k3's is the forward KL's, k2's, k4's, topk's and the advantage form's are the reverse KL's, topk_forward's
# the forward KL's; against any reference, a teacher's too (Config refuses k1 and k3 beside one). Over a
# sequence this holds position by position, the prefix's probability not differentiated. Derivations:
# docs/algorithm.md; exact enumeration: tests/test_kl_directions.py.
#
# The tokens were sampled by mu, not by pi: by pi_old (the weights before this step's first
# update: later mini-batches and epochs) or by vLLM's weights (the engine's mismatch, or older
# weights with async_steps > 0). rho = pi/mu (grpo_loss: exp(logp - old_logp) x the TIS weight
# min(pi_old/pi_vllm, cap)). k1-k3 are weighted by sg(rho), which leaves each one's value and
# gradient in expectation over mu what it is on-policy (E_mu[sg(rho) f] = E_pi[f]); unweighted,
# they would estimate their targets under mu. On-policy rho = 1 exactly and nothing changes.


def sampled_weight(rho):
    """sg(rho) = pi/mu without gradient, or 1 when rho is None (tokens sampled by pi itself)."""
    return 1.0 if rho is None else rho.detach()


def kl_k1(logp, ref_logp, rho=None):
    """sg(rho) d. Unbiased value; its expected gradient is zero (E_pi[grad log pi] = 0),
    so as a loss it does not pull toward the reference."""
    return sampled_weight(rho) * (logp - ref_logp)


def kl_k2(logp, ref_logp, rho=None):
    """sg(rho) d^2 / 2. Biased value (E_pi[d^2] / 2, close to the KL when pi is near pi_ref);
    its expected gradient E_pi[d grad log pi] is the reverse-KL gradient."""
    return sampled_weight(rho) * 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp, ref_logp, rho=None):
    """sg(rho) (exp(-d) - 1 + d) >= 0. Unbiased, low-variance value; its expected gradient
    E_pi[(1 - pi_ref/pi) grad log pi] is that of the forward KL(pi_ref || pi), not of the
    reverse KL it estimates."""
    d = logp - ref_logp
    return sampled_weight(rho) * (torch.exp(-d) - 1 + d)


def kl_k4(logp, ref_logp, rho):
    """rho * d with rho = pi/mu carrying the gradient, mu the policy that sampled the tokens
    (ratio-weighted k1). Unbiased value and unbiased reverse-KL gradient even when the
    tokens came from another policy (older weights, the vLLM engine)."""
    return rho * (logp - ref_logp)


# kl_estimator names; each takes (logp, ref_logp, rho) (N,) and returns (N,). "topk" and "topk_forward" are
# apart: they also need a top-k head (kl_topk below); so is "advantage" (kl_advantage).
KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3, "k4": kl_k4}


def kl_advantage(adv, old_logp, ref_logp, beta):
    """kl_estimator="advantage": the sampled k1 of pi_old (the weights before the step's updates), d = log
    pi_old - log ref, as a per-token advantage, A_t = A - beta sg(d_t), through the objective like the reward's
    advantage (its ratio, clipping and importance corrections; no KL term in the loss). On-policy its
    expected gradient is beta E_pi[d grad log pi], the reverse KL's (k2's, here clipped as the objective
    clips). d is not weighted toward another sampler (vLLM's older weights with async_steps), nor is the
    logged KL. With gspo a sequence's tokens may then clip apart (their advantages differ in sign). The form
    of on-policy distillation in tinker's cookbook (KL to a teacher as the per-token reward), and of
    verl's KL in the reward (use_kl_in_reward). Returns (A_t, d), both (N,)."""
    d = (old_logp - ref_logp).detach()
    return adv - beta * d, d


def kl_topk(logp, ref_logp, old_logp, head_logp, ref_head_logp, in_head, corrected=True, behaviour_weight=None):
    """Top-k KL (EMA-PG, Zhang & Ba) per position: the exact head over q, the k most likely
    tokens of the sampling policy, plus a sampled tail when the sampled token p is not in q:

        sum_{j in q} pi(j) (log pi(j) - log ref(j))  +  1[p not in q] (rho sg(d_p) + rho - sg(rho))

    with d_p = log pi(p) - log ref(p) and rho = pi(p)/mu(p) carrying the gradient, mu the
    policy that sampled p (rho = r = pi/sg(pi) on-policy). rho is taken as
    exp(logp - old_logp) * behaviour_weight, where behaviour_weight = sg(pi_old/mu) corrects
    for tokens sampled by other weights than pi_old (vLLM's, with async_steps > 0; capped as
    truncated importance sampling caps) and None means mu = pi_old. The value is unbiased for
    KL(pi || ref) for every k. As published (without `rho - sg(rho)`, zero in value) the
    expected gradient carries an extra grad pi(q); the added term's expected gradient is
    -grad pi(q), so the corrected gradient is unbiased for the reverse KL.
    k = 0 is the sampled k4; k = |V| is the exact KL. head_logp, ref_head_logp (N, k)
    are log-probabilities normalised over the full vocabulary; in_head (N,) bool."""
    head = (head_logp.exp() * (head_logp - ref_head_logp)).sum(-1)
    rho = torch.exp(logp - old_logp) * (1.0 if behaviour_weight is None else behaviour_weight)
    tail = rho * (logp - ref_logp).detach() + ((rho - rho.detach()) if corrected else 0.0)
    return head + torch.where(in_head, torch.zeros_like(tail), tail)


def kl_topk_forward(logp, ref_logp, old_logp, head_logp, ref_head_logp, in_head, behaviour_weight=None):
    """The forward KL(ref || pi) per position over the same head q (a teacher's: its k most likely tokens),
    the exact head plus a sampled tail when the sampled token p is not in q:

        sum_{j in q} ref(j) (log ref(j) - log pi(j))  +  1[p not in q] sg(ref(p)/mu(p)) (log ref(p) - log pi(p))

    mu the policy that sampled p: ref/mu = exp(ref_logp - old_logp) * behaviour_weight (None: mu = pi_old).
    Value and gradient, -sum_j ref(j) grad log pi(j), are the forward KL's for every k; k = 0 is the sampled
    form, k = |V| the exact KL. It pulls pi toward every token the reference likes, those pi almost never
    samples too, where the reverse KL weighs a token by pi's own probability of it: GKD's forward KL on the
    student's samples (Agarwal et al.), the supervised cross-entropy to the reference's distribution at
    the student's own prefixes. Arguments as kl_topk's."""
    head = (ref_head_logp.exp() * (ref_head_logp - head_logp)).sum(-1)
    weight = torch.exp(ref_logp - old_logp) * (1.0 if behaviour_weight is None else behaviour_weight)
    tail = weight.detach() * (ref_logp - logp)
    return head + torch.where(in_head, torch.zeros_like(tail), tail)


TOPK_KL = {"topk": kl_topk, "topk_forward": kl_topk_forward}  # the kl_estimator names that read a head


def ess_sums(rho):
    """The three sums the normalised effective sample size of the ratios rho (N,) needs, in float64:
    (sum rho, sum rho^2, n). Sums of several micro-batches or ranks add up (update.ess reduces them)."""
    rho = rho.detach().double()
    return torch.stack([rho.sum(), (rho ** 2).sum(), torch.tensor(float(rho.numel()), dtype=torch.float64,
                                                                     device=rho.device)])


def ess_from_sums(sums):
    """(sum rho)^2 / (n sum rho^2), in [1/n, 1]: 1 for equal ratios, 1/n when one ratio holds all the weight."""
    return (sums[0] ** 2 / (sums[2] * sums[1]).clamp(min=1e-300)).item()


def sequence_mean(x, seq_ids):
    """The mean of x (N,) over the tokens of each token's sequence, at every token (N,).
    seq_ids (N,) numbers the sequence of each token (0..S-1; numbers may be skipped)."""
    n_seqs = int(seq_ids.max()) + 1 if seq_ids.numel() else 0
    total = x.new_zeros(n_seqs).index_add(0, seq_ids, x)  # (S,)
    count = x.new_zeros(n_seqs).index_add(0, seq_ids, torch.ones_like(x))  # (S,)
    return (total / count.clamp(min=1))[seq_ids]


def mismatch_mask(old_logp, vllm_logp, seq_ids, level, cap):
    """Which tokens the trainer/vLLM mismatch leaves in the policy term (1.0 kept, 0.0 masked),
    for ratios pi_old/pi_vllm: level "token" keeps tokens whose ratio lies in [1/cap, cap]
    (IcePop's token mask); "sequence" keeps whole sequences whose geometric-mean ratio
    exp(mean over their tokens of log ratio) lies in that band."""
    log_ratio = (old_logp - vllm_logp).detach()  # (N,)
    if level == "sequence":
        log_ratio = sequence_mean(log_ratio, seq_ids)
    return (log_ratio.abs() <= math.log(cap)).to(log_ratio.dtype)


# --- objectives: one function and one table row each
#
# objective(logp, old_logp, adv, cfg, **needs) -> (policy term, trust term, clipped flag)
# logp (with gradient), old_logp and adv are the micro-batch's (N,) tokens; cfg is the run's
# Config (or any object with the fields the objective reads), so an objective's
# hyper-parameter is a Config field. What else it needs, its row in OBJECTIVES says, and
# grpo_loss passes only that: seq_ids (N,), the sequence of each token, for an objective over
# whole sequences; ess_value, sg(ESS) of the ratios, for one that reads the batch's ESS. All
# three results are (N,). grpo_loss multiplies the policy term by the importance corrections
# (TIS, masks), never the trust term (a KL to pi_old).


def clipped_surrogate(ratio, adv, cfg):
    """PPO's max(-A ratio, -A clip(ratio, 1 - clip_lower, 1 + clip_higher)) per token, and the
    flag of tokens where the clipped branch wins (their gradient is zero)."""
    unclipped, clipped = -adv * ratio, -adv * ratio.clamp(1 - cfg.clip_lower, 1 + cfg.clip_higher)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def dapo_loss(logp, old_logp, adv, cfg):
    """PPO's clipped surrogate on the token ratio rho = pi/pi_old with DAPO's asymmetric range
    [1 - clip_lower, 1 + clip_higher]: max(-A rho, -A clip(rho))."""
    pg, clipped = clipped_surrogate(torch.exp(logp - old_logp), adv, cfg)
    return pg, torch.zeros_like(pg), clipped


def cispo_loss(logp, old_logp, adv, cfg):
    """CISPO (MiniMax-M1): -sg(min(rho, 1 + clip_higher)) A logp. Every token keeps a
    gradient; only the weight is capped (flagged)."""
    rho = torch.exp(logp - old_logp).detach()
    pg = -rho.clamp(max=1 + cfg.clip_higher) * adv * logp
    return pg, torch.zeros_like(pg), (rho > 1 + cfg.clip_higher).float()


def ess_loss(logp, old_logp, adv, cfg, ess_value):
    """The batch-adaptive objective ("Trust the Batch", Fakoor et al., after P3O): with e = sg(ESS),
    -sg(min(rho, e)) A logp + (1 - e) k3(pi || pi_old). Nearly uniform ratios (e ~ 1) give the
    plain on-policy score-function update; concentrated ratios (stale or mismatched data)
    cap the weight lower and pull harder toward the behaviour policy. No clip constants.
    The trust term (1 - e) k3 is a KL, so importance corrections never multiply it."""
    e = ess_value
    rho = torch.exp(logp - old_logp)
    capped = (rho.detach() > e).float()
    return -rho.detach().clamp(max=e) * adv * logp, (1 - e) * kl_k3(logp, old_logp), capped


def gspo_loss(logp, old_logp, adv, cfg, seq_ids):
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", Qwen), in its GSPO-token
    form: the clipped surrogate on the sequence ratio s_i = exp(mean over the tokens of sequence
    i of (logp - old_logp)), carried per token as s_it = sg(s_i) pi(y_t) / sg(pi(y_t)) (value s_i,
    gradient s_i grad logp_t): max(-A s_it, -A clip(s_it, 1 - clip_lower, 1 + clip_higher)).
    A sequence is clipped whole or not at all. With one advantage per sequence (GRPO's) this
    is GSPO's sequence-level objective in value and gradient.
    Where we differ from the paper: it divides each sequence's token sum by |y_i| and averages
    over sequences; here, as for every objective, the token sum is divided by loss_denominator
    (the step's tokens, or Dr GRPO's constant), so a sequence weighs in proportion to its
    length. The paper clips in a tiny range (3e-4 below, 4e-4 above); the defaults 0.2 / 0.28
    are DAPO's token-level ones: set clip_lower and clip_higher."""
    s = torch.exp(sequence_mean(logp - old_logp, seq_ids)).detach()  # (N,) s_i at each token of sequence i
    ratio = s * torch.exp(logp - logp.detach())  # (N,) value s_i, gradient s_i grad logp
    pg, clipped = clipped_surrogate(ratio, adv, cfg)
    return pg, torch.zeros_like(pg), clipped


@dataclass(frozen=True)
class Objective:
    """An objective and what it needs; update.py and config.py read these, never the name."""
    fn: Callable
    clip: tuple = ()  # the clip fields it reads (Config refuses a change to one it does not)
    sequences: bool = False  # reads whole sequences (seq_ids): a sequence split over ranks by sequence parallelism is refused
    ess: bool = False  # reads sg(ESS) of the ratios (ess_value; ess_scope: the optimizer step's, one extra forward, or the micro-batch's)


OBJECTIVES = {  # loss_fn
    "dapo": Objective(dapo_loss, clip=("clip_lower", "clip_higher")),
    "cispo": Objective(cispo_loss, clip=("clip_higher",)),
    "ess": Objective(ess_loss, ess=True),
    "gspo": Objective(gspo_loss, clip=("clip_lower", "clip_higher"), sequences=True),
}


def check_objective(row, loss_fn):
    """An objective of your own (Config.objective loads it): an Objective, clip fields that exist, and a
    function that takes what grpo_loss will pass it. Returns it; ValueError naming the fix."""
    if not isinstance(row, Objective):
        raise ValueError(f"loss_fn={loss_fn!r} is not a loss.Objective but {type(row).__name__!r}; name a row such "
                         "as Objective(my_loss, clip=(...)) in that file")
    if unknown := set(row.clip) - {"clip_lower", "clip_higher"}:
        raise ValueError(f"loss_fn={loss_fn!r}: clip names {', '.join(sorted(unknown))}; the clip fields are "
                         "clip_lower and clip_higher")
    needs = {k: None for k, wanted in (("seq_ids", row.sequences), ("ess_value", row.ess)) if wanted}
    try:
        inspect.signature(row.fn).bind(None, None, None, None, **needs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"loss_fn={loss_fn!r}: its function cannot take (logp, old_logp, adv, cfg"
                         + "".join(f", {k}=" for k in needs) + f") ({e}); fix its signature or its row") from None
    return row


def grpo_loss(logp, old_logp, adv, seq_ids, denominator, cfg, *, ref_logp=None, tis_weight=None, mismatch_mask=None,
              ess_value=1.0, kl_heads=None):
    """The loss of one micro-batch: (sum over its tokens of policy term + trust term + beta * KL)
    / denominator, with the objective of cfg.loss_fn (cfg.objective: its row) and, when ref_logp is given, the
    KL estimator cfg.kl_estimator weighted by cfg.beta ("advantage": beta * k1 taken from each token's
    advantage instead, kl_advantage; the logged KL is then that k1).

    tis_weight (N,), truncated importance sampling min(pi_old/pi_vllm, cap), multiplies the
    policy term; it also corrects every KL estimator (k1-k3 by sg(rho), k4 and the top-k tail
    by rho), whose weight must be pi/mu with mu the policy that sampled: pi/pi_old x pi_old/pi_vllm.
    mismatch_mask (N,) masks tokens out of the policy term (1.0 kept, 0.0 out; mismatch_mask()).
    ess_value is sg(ESS), passed to an objective whose row has ess=True; kl_heads is the tuple (head_logp, ref_head_logp, in_head) for
    kl_estimator="topk" and "topk_forward". Returns (loss, sums) where sums holds per-micro-batch totals for
    logging (they are summed over micro-batches and ranks, then divided by the tokens).
    """
    row = cfg.objective
    if row is None:
        raise ValueError(f"loss_fn={cfg.loss_fn!r} is not implemented: add it to loss.OBJECTIVES")
    kl, in_loss = torch.zeros_like(logp), ref_logp is not None and cfg.kl_estimator != "advantage"
    if ref_logp is not None and not in_loss:  # the KL in the advantage, not in the loss
        adv, kl = kl_advantage(adv, old_logp, ref_logp, cfg.beta)
    needs = dict(seq_ids=seq_ids) if row.sequences else {}
    if row.ess:
        needs["ess_value"] = ess_value
    pg, trust, clipped = row.fn(logp, old_logp, adv, cfg, **needs)
    if tis_weight is not None:
        pg = pg * tis_weight
    if mismatch_mask is not None:
        pg = pg * mismatch_mask
    if in_loss:
        if cfg.kl_estimator in TOPK_KL:  # needs the top-k heads, not just the sampled token
            kl = TOPK_KL[cfg.kl_estimator](logp, ref_logp, old_logp, *kl_heads, behaviour_weight=tis_weight)
        else:
            # pi/mu, mu the policy that sampled: k1-k3 take sg(rho) (their on-policy targets, off-policy too), k4 rho
            rho = torch.exp(logp - old_logp) * (1.0 if tis_weight is None else tis_weight)
            kl = KL_ESTIMATORS[cfg.kl_estimator](logp, ref_logp, rho)
    loss = (pg + trust + (cfg.beta * kl if in_loss else 0.0)).sum() / denominator
    sums = dict(pg_loss=pg.detach().sum(), kl=kl.detach().sum(), clipped=clipped.sum(), ess_trust=trust.detach().sum())
    return loss, sums


def step_denominator(loss_denominator, n_tokens, n_sequences):
    """What the summed per-token loss of an optimizer step is divided by.
    "token": the valid tokens of the whole step, all ranks and micro-batches together.
    A number c: c x n_sequences (Dr GRPO's constant normaliser, c = the generation budget),
    so a token's weight does not depend on the lengths of others. The trainer passes the
    configured sequences per mini-batch, not those left after filtering, so the weight of a
    token stays the same from step to step."""
    if loss_denominator == "token":
        return max(float(n_tokens), 1.0)
    return float(loss_denominator) * n_sequences
