"""The policy's forward: per-token logprobs of a Hugging Face causal LM, and the chunked LM-head
kernel under them.

    logp, entropy, head_logp, head_ids = model.sequence_logprobs(input_ids, mask, temperature, position_ids=...)

sequence_logprobs is bound to the model as a forward method (parallel.load_model registers it
with FSDP2, which gathers the LM head for it as for forward()). It runs the decoder, keeps the
hidden states of the completion tokens the mask selects, and hands them to token_logprobs: the
logits of a chunk of tokens at a time in float32, with an autograd kernel that rebuilds them in
backward, so (N, V) logits never exist. The LM heads whose logits vLLM scales (Cohere, Granite)
are scaled the same way; the heads it cannot follow are refused at start-up (check_architecture).

The attention kernels the decoder runs on packed rows are infra/attention.py's, registered with
transformers as it is imported here: every model whose forward this is can run them.
"""

import torch

from infra import attention  # noqa: F401 - packed_sdpa registered with transformers (attention.py's last lines)

CHUNK = 256  # tokens whose (CHUNK, V) float32 logits exist at once (token_logprobs; the memory plan's LM head)


def sequence_logprobs(self, input_ids, mask, temperature, position_ids=None, attention_mask=None, head_ids=None,
                      head_size=0, targets=None, row_position_ids=None):
    """logp and entropy (N,) of the completion tokens selected by mask (B, T-1), and logp at
    head_ids (or this policy's top-k) (N, k). Packed rows (packing.py) pass position_ids that
    restart at 0 per sequence and no attention_mask; padded rows pass attention_mask. A piece of
    a row under sequence parallelism (sequence_parallel.piece) passes its targets (B, T), the
    mask (B, T) over them and the whole row's position ids. A forward method of the model, so
    FSDP2 gathers the LM head for it as for forward()."""
    if position_ids is not None and attention_mask is not None:
        raise ValueError("pass position_ids (packed rows) or attention_mask (padded rows), not both: transformers "
                         "skips the per-sequence mask of packed position_ids when a 2-D attention mask is given")
    # use_cache=False: no KV cache is reused here, and a checkpointed layer would append
    # to it a second time when it recomputes in backward (a cache would also turn packing off).
    # row_position_ids: the whole row's, for the attention of sequence_parallel.py
    row = {} if row_position_ids is None else dict(row_position_ids=row_position_ids)
    hidden = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                        use_cache=False, **row)
    hidden = hidden.last_hidden_state  # (B, T, H)
    if targets is None:  # position j predicts token j+1
        hidden, targets = hidden[:, :-1], input_ids[:, 1:]
    return token_logprobs(hidden[mask], self.lm_head.weight, targets[mask], temperature,
                          head_ids=head_ids, head_size=head_size, logit_scale=logit_scale(self.config))


def logit_scale(model_config):
    """The multiplier on the LM head's logits: Cohere's logit_scale, 1 / Granite's logits_scaling
    (vLLM's LogitsProcessor scale for each); 1 for the others."""
    scale = getattr(model_config, "logit_scale", None)
    scaling = getattr(model_config, "logits_scaling", None)
    return (1.0 if scale is None else scale) / (1.0 if scaling is None else scaling)


def check_architecture(model):
    """A one-line refusal of a model whose LM head or layout sequence_logprobs does not implement
    (vLLM does, so trainer and server would disagree on every logprob). `model` may live on the
    meta device (check_model_config)."""
    config = model.config
    if getattr(config, "final_logit_softcapping", None) is not None:
        raise ValueError(f"final_logit_softcapping={config.final_logit_softcapping} in {config.model_type}'s config "
                         "is unsupported (the logprobs would ignore it); pick a model without logit soft-capping")
    if getattr(config, "lm_head_multiplier", None) not in (None, 1, 1.0):
        raise ValueError(f"lm_head_multiplier={config.lm_head_multiplier} in {config.model_type}'s config is "
                         "unsupported (the logprobs would ignore it); pick another model")
    head = getattr(model, "lm_head", None)
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"{type(model).__name__} has no lm_head Linear layer; only decoder-only models with "
                         "model.lm_head are supported")
    if head.bias is not None:
        raise ValueError(f"{type(model).__name__}'s lm_head has a bias, which is unsupported (the logprobs "
                         "would ignore it); pick a model whose LM head has none")
    if not isinstance(getattr(getattr(model, "model", None), "layers", None), torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no model.model.layers (the decoder layers FSDP shards one "
                         "by one); only models laid out as Llama, Qwen2 and Mistral are supported")


def check_model_config(model_config):
    """check_architecture on the model's config alone, built on the meta device (no weights
    read, no memory): the refusal comes before any process group or server starts. Returns the
    meta model, for further checks (lora.adapters.check)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    check_architecture(model)
    return model


def check_vocabulary(model_config, kl_topk):
    """The top-k head (kl_topk tokens a position, token_logprobs' head_size) fits the model's vocabulary."""
    if kl_topk > model_config.vocab_size:
        raise ValueError(f"kl_topk={kl_topk} exceeds the model's vocabulary of {model_config.vocab_size} "
                         f"tokens; use at most {model_config.vocab_size}")


# --- the chunked logprob kernel


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


def token_logprobs(hidden, weight, targets, temperature=1.0, chunk_size=CHUNK, head_ids=None, head_size=0,
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
