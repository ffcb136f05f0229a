"""Pure functions: per-token logprobs, advantages, the GRPO objectives and KL estimators.

Tokens are handled flat: every function takes the N valid (completion) tokens of a
micro-batch as 1-D tensors, so padding never enters a sum. Each loss returns the *sum*
over its tokens divided by the denominator of the whole optimizer step, so gradients
accumulated over micro-batches and summed over ranks (train.py undoes FSDP's averaging)
equal the gradient of one loss over the whole step.
"""

import math

import torch


# --- logprobs


def _chunk_logits(hidden, weight, temperature):
    # (n, V) logits in float32 at least (weight arrives upcast), for this chunk only: the product
    # itself, not just its result, since bf16 logits are already rounded (mean |logp error| ~1e-2
    # at Qwen2.5-0.5B's shape). 1/T scales the (n, H) input rather than the (n, V) product.
    return (hidden.to(weight.dtype) / temperature) @ weight.t()


@torch.no_grad()
def _chunk_logprobs(hidden, weight, targets, temperature, head_ids, head_size):
    """One chunk, without gradient, in one (n, V) buffer: log Z = max z + log sum exp(z - max z),
    then p = softmax(z) in place and entropy = sum -p log p (torch.special.entr, in place too)."""
    logits = _chunk_logits(hidden, weight, temperature)  # (n, V)
    if head_ids is None:  # the top-k set is a choice, not a function
        head_ids = logits.topk(head_size, -1).indices  # (n, k)
    target_logits, head_logits = logits.gather(-1, targets[:, None])[:, 0], logits.gather(-1, head_ids)
    top = logits.amax(-1)
    p = logits.sub_(top[:, None]).exp_()  # the logits are not needed any more
    sum_exp = p.sum(-1)
    logz = top + sum_exp.log()  # (n,)
    entropy = torch.special.entr(p.div_(sum_exp[:, None]), out=p).sum(-1)
    return target_logits - logz, entropy, head_logits - logz[:, None], head_ids, logz


def _all_chunks(hidden, weight, targets, temperature, head_ids, head_size, chunk_size):
    outs = []
    for i in range(0, max(hidden.shape[0], 1), chunk_size):  # an empty selection still gives (0, k) head ids
        ids = None if head_ids is None else head_ids[i:i + chunk_size]
        outs.append(_chunk_logprobs(hidden[i:i + chunk_size], weight, targets[i:i + chunk_size], temperature,
                                    ids, head_size))
    return tuple(torch.cat(parts) for parts in zip(*outs))


def _float32_at_least(weight):
    return weight.to(torch.promote_types(weight.dtype, torch.float32))


class _ChunkedLogprobs(torch.autograd.Function):
    """token_logprobs with gradients. z = hidden @ weight.T / T, p = softmax(z); for logp = z_t - log Z,
    d logp / dz = onehot(t) - p, and likewise for each head column, so with upstream gradients g (N,)
    and G (N, k):  dL/dz = onehot(t) g + sum_k onehot(head_k) G_k - p (g + sum_k G_k).
    Backward recomputes z chunk by chunk from the saved log Z, turns it into dL/dz in place, and
    accumulates the weight gradient dL/dz.T @ hidden / T into one (V, H) buffer (addmm_)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, head_ids, head_size, chunk_size):
        logp, entropy, head_logp, head_ids, logz = _all_chunks(hidden, _float32_at_least(weight), targets,
                                                               temperature, head_ids, head_size, chunk_size)
        ctx.save_for_backward(hidden, weight, targets, head_ids, logz)  # weight as given: upcast again in backward
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.mark_non_differentiable(entropy, head_ids)  # entropy is logged, never differentiated
        return logp, entropy, head_logp, head_ids

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy, grad_head, _grad_ids):
        hidden, weight, targets, head_ids, logz = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        temperature, c = ctx.temperature, ctx.chunk_size
        weight32 = _float32_at_least(weight)
        grad_hidden = hidden.new_empty(hidden.shape, dtype=weight32.dtype) if need_hidden else None
        grad_weight = torch.zeros_like(weight32) if need_weight else None  # the one (V, H) buffer
        g, heads_g = grad_logp.to(weight32.dtype), grad_head.to(weight32.dtype)  # (N,), (N, k)
        for i in range(0, hidden.shape[0], c):
            h = hidden[i:i + c].to(weight32.dtype)
            grad_z = _chunk_logits(h, weight32, temperature).sub_(logz[i:i + c, None]).exp_()  # p, in place
            grad_z.mul_(-(g[i:i + c] + heads_g[i:i + c].sum(-1))[:, None])
            grad_z.scatter_add_(1, targets[i:i + c, None], g[i:i + c, None])
            grad_z.scatter_add_(1, head_ids[i:i + c], heads_g[i:i + c])
            grad_z.div_(temperature)  # now dL/d(hidden @ weight.T)
            if need_hidden:
                torch.mm(grad_z, weight32, out=grad_hidden[i:i + c])
            if need_weight:
                grad_weight.addmm_(grad_z.t(), h)
            del grad_z  # else it lives on while the next chunk's logits are built: two (n, V) buffers
        return (grad_hidden.to(hidden.dtype) if need_hidden else None,
                grad_weight.to(weight.dtype) if need_weight else None, None, None, None, None, None)


def token_logprobs(hidden, weight, targets, temperature=1.0, chunk_size=256, head_ids=None, head_size=0,
                   logit_scale=1.0):
    """log pi(target) and the entropy of pi at each of N positions, and log pi at k more
    tokens per position: the given head_ids (N, k), or else this policy's head_size most likely.

    hidden (N, H) final hidden states, weight (V, H) the LM head, targets (N,); the logits are
    logit_scale * hidden @ weight.T / temperature (logit_scale: a multiplier on the head's
    logits, Cohere's logit_scale or 1 / Granite's logits_scaling, as vLLM applies it).
    Logits are built chunk by chunk and rebuilt in backward, where the gradient of each
    chunk's logits is formed analytically and the LM head's gradient accumulates in place
    (_ChunkedLogprobs): one (chunk_size, V) float32 buffer and one (V, H) gradient exist at
    once instead of (N, V) logits. At vocabulary 151,936, hidden 896 and 2,048 tokens, forward
    + backward peaked at 0.15 of the naive path on the CPU with chunks of 256 (0.25 with 1,024,
    0.13 with 128; the (V, H) gradient is the floor), in about 1.2x its time (BENCHMARKS.md).
    Under bf16 mixed precision (GPU) hidden and weight arrive in bf16; the logits are
    computed in float32 from upcast copies and the gradients returned in bf16.
    Returns logp (N,), entropy (N,), head_logp (N, k), head_ids (N, k).
    """
    temperature = temperature / logit_scale  # the same logits: the kernel divides hidden by it, forward and backward
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _ChunkedLogprobs.apply(hidden, weight, targets, temperature, head_ids, head_size, chunk_size)
    return _all_chunks(hidden, _float32_at_least(weight), targets, temperature, head_ids, head_size, chunk_size)[:4]


# --- advantages


def group_advantages(rewards, group_size, normalization="standard", eps=1e-6):
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


# kl_estimator names; each takes (logp, ref_logp, rho) (N,) and returns (N,). "topk" is apart: it
# also needs the sampling policy's top-k head (kl_topk below).
KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3, "k4": kl_k4}


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


def ess(rho, group=None):
    """Normalised effective sample size of the ratios, (sum rho)^2 / (n sum rho^2) in [1/n, 1],
    with the three sums in float64 and, when a process group is given, over all its ranks."""
    import torch.distributed as dist

    sums = torch.stack([rho.double().sum(), (rho.double() ** 2).sum(),
                        torch.tensor(float(rho.numel()), dtype=torch.float64, device=rho.device)])
    if group is not None or (dist.is_available() and dist.is_initialized()):
        dist.all_reduce(sums, group=group)
    return (sums[0] ** 2 / (sums[2] * sums[1]).clamp(min=1e-300)).item()


def sequence_mean(x, seq_ids):
    """The mean of x (N,) over the tokens of each token's sequence, at every token (N,).
    seq_ids (N,) numbers the sequence of each token (0..S-1; numbers may be skipped)."""
    n_seqs = int(seq_ids.max()) + 1 if seq_ids.numel() else 0
    total = x.new_zeros(n_seqs).index_add(0, seq_ids, x)  # (S,)
    count = x.new_zeros(n_seqs).index_add(0, seq_ids, torch.ones_like(x))  # (S,)
    return (total / count.clamp(min=1))[seq_ids]


def mismatch_keep(old_logp, vllm_logp, seq_ids, level, cap):
    """Which tokens the trainer/vLLM mismatch leaves in the policy term (1.0 kept, 0.0 masked),
    for ratios pi_old/pi_vllm: level "token" keeps tokens whose ratio lies in [1/cap, cap]
    (IcePop's token mask); "sequence" keeps whole sequences whose geometric-mean ratio
    exp(mean over their tokens of log ratio) lies in that band."""
    log_ratio = (old_logp - vllm_logp).detach()  # (N,)
    if level == "sequence":
        log_ratio = sequence_mean(log_ratio, seq_ids)
    return (log_ratio.abs() <= math.log(cap)).to(log_ratio.dtype)


# --- objectives: one signature, one table
#
# objective(logp, old_logp, adv, seq_ids, cfg, ess_value) -> (policy term, trust term, clipped flag)
# logp (with gradient), old_logp, adv and seq_ids (the sequence of each token) are the
# micro-batch's (N,) tokens; cfg is the run's Config (or any object with the fields the
# objective reads), so an objective's hyper-parameter is a Config field; ess_value is
# sg(ESS), read by "ess" only. All three results are (N,). grpo_loss multiplies the policy
# term by the importance corrections (TIS, masks), never the trust term (a KL to pi_old).


def clipped_surrogate(ratio, adv, cfg):
    """PPO's max(-A ratio, -A clip(ratio, 1 - clip_lower, 1 + clip_higher)) per token, and the
    flag of tokens where the clipped branch wins (their gradient is zero)."""
    unclipped, clipped = -adv * ratio, -adv * ratio.clamp(1 - cfg.clip_lower, 1 + cfg.clip_higher)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def dapo_loss(logp, old_logp, adv, seq_ids, cfg, ess_value):
    """PPO's clipped surrogate on the token ratio rho = pi/pi_old with DAPO's asymmetric range
    [1 - clip_lower, 1 + clip_higher]: max(-A rho, -A clip(rho))."""
    pg, clipped = clipped_surrogate(torch.exp(logp - old_logp), adv, cfg)
    return pg, torch.zeros_like(pg), clipped


def cispo_loss(logp, old_logp, adv, seq_ids, cfg, ess_value):
    """CISPO (MiniMax-M1): -sg(min(rho, 1 + clip_higher)) A logp. Every token keeps a
    gradient; only the weight is capped (flagged)."""
    rho = torch.exp(logp - old_logp).detach()
    pg = -rho.clamp(max=1 + cfg.clip_higher) * adv * logp
    return pg, torch.zeros_like(pg), (rho > 1 + cfg.clip_higher).float()


def ess_loss(logp, old_logp, adv, seq_ids, cfg, ess_value):
    """The batch-adaptive objective ("Trust the Batch", Fakoor et al., after P3O): with e = sg(ESS),
    -sg(min(rho, e)) A logp + (1 - e) k3(pi || pi_old). Nearly uniform ratios (e ~ 1) give the
    plain on-policy score-function update; concentrated ratios (stale or mismatched data)
    cap the weight lower and pull harder toward the behaviour policy. No clip constants.
    The trust term (1 - e) k3 is a KL, so importance corrections never multiply it."""
    e = ess_value
    rho = torch.exp(logp - old_logp)
    capped = (rho.detach() > e).float()
    return -rho.detach().clamp(max=e) * adv * logp, (1 - e) * kl_k3(logp, old_logp), capped


def gspo_loss(logp, old_logp, adv, seq_ids, cfg, ess_value):
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


OBJECTIVES = {"dapo": dapo_loss, "cispo": cispo_loss, "ess": ess_loss, "gspo": gspo_loss}


def grpo_loss(logp, old_logp, adv, seq_ids, denominator, cfg, *, ref_logp=None, tis_weight=None, keep=None,
              ess_value=1.0, kl_heads=None):
    """The loss of one micro-batch: (sum over its tokens of policy term + trust term + beta * KL)
    / denominator, with the objective OBJECTIVES[cfg.loss_fn] and, when ref_logp is given, the
    KL estimator cfg.kl_estimator weighted by cfg.beta.

    tis_weight (N,), truncated importance sampling min(pi_old/pi_vllm, cap), multiplies the
    policy term; it also corrects every KL estimator (k1-k3 by sg(rho), k4 and the top-k tail
    by rho), whose weight must be pi/mu with mu the policy that sampled: pi/pi_old x pi_old/pi_vllm.
    keep (N,) masks tokens out of the policy term (mismatch_keep). ess_value is sg(ESS) for
    loss_fn="ess"; kl_heads is the tuple (head_logp, ref_head_logp, in_head) for
    kl_estimator="topk". Returns (loss, sums) where sums holds per-micro-batch totals for
    logging (they are summed over micro-batches and ranks, then divided by the tokens).
    """
    if cfg.loss_fn not in OBJECTIVES:
        raise ValueError(f"loss_fn={cfg.loss_fn!r} is not implemented: add it to loss.OBJECTIVES")
    pg, trust, clipped = OBJECTIVES[cfg.loss_fn](logp, old_logp, adv, seq_ids, cfg, ess_value)
    if tis_weight is not None:
        pg = pg * tis_weight
    if keep is not None:
        pg = pg * keep
    kl = torch.zeros_like(logp)
    if ref_logp is not None:
        if cfg.kl_estimator == "topk":  # needs the top-k heads, not just the sampled token
            kl = kl_topk(logp, ref_logp, old_logp, *kl_heads, behaviour_weight=tis_weight)
        else:
            # pi/mu, mu the policy that sampled: k1-k3 take sg(rho) (their on-policy targets, off-policy too), k4 rho
            rho = torch.exp(logp - old_logp) * (1.0 if tis_weight is None else tis_weight)
            kl = KL_ESTIMATORS[cfg.kl_estimator](logp, ref_logp, rho)
    loss = (pg + trust + cfg.beta * kl).sum() / denominator
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
