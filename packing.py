"""Rollouts to micro-batches: whole groups per mini-batch, tokens balanced over ranks, sequences packed.

    micro_batches(samples, cfg, world_size, rank)   [(this rank's packed micro-batches, tokens, sequences)]
      mini_batches    whole groups per optimizer step
      balance         sequences onto ranks (or micro-batches), longest first onto the lightest
      collate         one packed row (1, L) per micro-batch, position_ids restarting at 0
    collate_padded    the right-padded (B, T) twin the tests and benchmarks compare against
    piece             this rank's contiguous part of a packed row under sequence parallelism

Padding-free packing: a micro-batch is one row of sequences laid end to end, with no attention
mask and position_ids that restart at 0 at every sequence. transformers (masking_utils,
find_packed_sequence_indices) cuts such a row into sequences wherever a position does not
follow its predecessor by exactly 1, and ANDs "same sequence" into the causal mask it builds
(checked here for sdpa and eager, on Qwen2 and Llama). It does so only when position_ids are
passed, no 2-D attention mask is and no KV cache is in use: a mask of ones next to packed
position_ids silently lets every token attend to the sequences before it
(tests/test_packing.py checks both).

transformers' sdpa then attends over the whole row under that L x L mask: a cost in L^2, which
at 4,096 tokens made a packed step slower than a padded one on the CPU (0.68x at the 24 M
shape). policy.packed_sdpa runs sdpa on each sequence's slice instead (the sum of squared lengths).

Why balance tokens, not sequences: the cost of a forward is its tokens, and FSDP makes every
rank wait for the slowest at each layer's all-gather. RL completions spread from a few tokens
to the response length, so equal sequence counts leave ranks and micro-batches uneven.
"""

import torch

from sample import Sample


def length(s):
    """Tokens of one sample in the forward pass: the prompt and every token after it."""
    return len(s.prompt_ids) + len(s.token_ids)


# A sample that carries no tokens to the loss: it fills a rank's micro-batch so that every rank
# runs the same number of forward passes (FSDP's all-gathers are collectives).
PADDING = Sample(prompt_ids=[0], token_ids=[0], logprobs=[0.0], valid=False)


def mini_batches(samples, num_mini_batches, group_size):
    """num_mini_batches lists of whole groups (samples come group after group, group_size each;
    filtering drops whole groups, so no group straddles two optimizer steps). When fewer groups
    survive than there are mini-batches, some mini-batches are empty."""
    groups = [samples[i:i + group_size] for i in range(0, len(samples), group_size)]
    bounds = [round(i * len(groups) / num_mini_batches) for i in range(num_mini_batches + 1)]
    return [[s for g in groups[lo:hi] for s in g] for lo, hi in zip(bounds, bounds[1:])]


def balance(samples, bins, budget=None):
    """Longest first, each sample onto the bin with the fewest tokens so far (the LPT rule): bin
    totals end within one sample's length of each other. Within a bin the samples keep their
    order. None when a sample would push the lightest bin past `budget` tokens."""
    loads, out = [0] * bins, [[] for _ in range(bins)]
    for i in sorted(range(len(samples)), key=lambda i: -length(samples[i])):  # stable: ties by position
        lightest = min(range(bins), key=loads.__getitem__)
        if budget is not None and loads[lightest] + length(samples[i]) > budget:
            return None
        loads[lightest] += length(samples[i])
        out[lightest].append(i)
    return [[samples[i] for i in sorted(b)] for b in out]


def pack_ranks(mini, world_size, budget):
    """Every rank's share of one mini-batch cut into the same number of micro-batches of at most
    `budget` tokens each, tokens balanced between ranks and between micro-batches. A micro-batch
    left empty gets a PADDING sample. [rank][micro-batch] -> list of samples."""
    shares = balance(mini, world_size)
    fewest = max(-(-sum(map(length, share)) // budget) for share in shares)
    for n_micro in range(fewest, max(map(len, shares)) + 1):  # the fewest every rank can fill under the budget
        packed = [balance(share, n_micro, budget) for share in shares]
        if all(p is not None for p in packed):
            return [[mb or [PADDING] for mb in p] for p in packed]
    raise ValueError(f"a sequence of {max(map(length, mini))} tokens does not fit max_tokens_per_micro_batch={budget}; "
                     "raise it to at least max_prompt_length + response_length")


# What a micro-batch carries per loss token (N,), in the mask's order, and its dtype. A new
# per-token field is a row here and a line in loss_tokens; collate, the sequence-parallel
# pieces and update.py then carry it as b[name].
PER_TOKEN = {"vllm_logp": torch.float32,  # the sampler's logprob
             "adv": torch.float32,  # the sample's advantage
             "fresh": torch.bool,  # sampled by the weights the trainer holds (the sync check reads these)
             "seq_ids": torch.long}  # the sample's number within the micro-batch


def loss_tokens(s, i):
    """The PER_TOKEN lists of sample s (number i in its micro-batch) over its policy tokens."""
    logp = [lp for lp, m in zip(s.logprobs, s.mask) if m]
    return dict(vllm_logp=logp, adv=[s.adv] * len(logp), fresh=[s.staleness == 0] * len(logp),
                seq_ids=[i] * len(logp))


def collate(samples):
    """One packed row: input_ids and position_ids (1, L), the loss mask over next-token targets
    (1, L-1): the policy's tokens, not the prompt's or an environment's; and per-token vllm_logp,
    adv, fresh and seq_ids (the sample of each token within this micro-batch) (N,) in the mask's
    order. The last token of a sequence predicts nothing: the token after it begins the next one."""
    ids, positions, mask, per = [], [], [], {k: [] for k in PER_TOKEN}
    for i, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.token_ids)
        ids += s.prompt_ids + s.token_ids
        positions += range(p + c)
        # position j predicts token j+1: the prompt's last token predicts the first token after it
        mask += [False] * (p - 1) + [s.valid and bool(m) for m in s.mask] + [False]
        if s.valid:
            for k, values in loss_tokens(s, i).items():
                per[k] += values
    return dict(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]),
                mask=torch.tensor([mask[:-1]], dtype=torch.bool), **per_token(per))


def per_token(lists):
    return {k: torch.tensor(lists[k], dtype=dtype) for k, dtype in PER_TOKEN.items()}


def micro_batches(samples, cfg, world_size, rank):
    """This rank's packed micro-batches of each mini-batch, with the whole mini-batch's policy
    tokens (those in the loss) and sequences: [(micro-batches, tokens, sequences)]. Every rank
    computes the same assignment from the same samples and keeps its own part."""
    out = []
    for mini in mini_batches(samples, cfg.num_mini_batches, cfg.num_samples_per_prompt_rollout):
        mine = pack_ranks(mini, world_size, cfg.max_tokens_per_micro_batch)[rank] if mini else []
        out.append(([collate(mb) for mb in mine], sum(s.policy_tokens for s in mini), len(mini)))
    return out


def collate_padded(samples, pad_id):
    """The padded twin of collate: right-padded input_ids and attention_mask (B, T), the mask
    (B, T-1), and the same per-token tensors in the mask's row-major order."""
    width = max(map(length, samples))
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), width), dtype=torch.long)
    mask = torch.zeros((len(samples), width - 1), dtype=torch.bool)
    per = {k: [] for k in PER_TOKEN}
    for i, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.token_ids)
        input_ids[i, :p + c] = torch.tensor(s.prompt_ids + s.token_ids)
        attention_mask[i, :p + c] = 1
        if s.valid:
            mask[i, p - 1:p + c - 1] = torch.tensor(s.mask, dtype=torch.bool)
            for k, values in loss_tokens(s, i).items():
                per[k] += values
    return dict(input_ids=input_ids, attention_mask=attention_mask, mask=mask, **per_token(per))


def piece(b, sp_rank, size):
    """This rank's piece of one packed micro-batch of packing.collate. The row (1, L) is padded to
    a multiple of `size` by a tail that is its own sequence (position_ids from 0, out of the
    loss) and cut into `size` contiguous pieces. Position j predicts token j+1, so the last
    position of a piece predicts the first token of the next: the piece carries its targets
    (1, L/size) and its mask over them, and the per-token tensors of the completion tokens
    it predicts (those of the whole row, in order, fall into consecutive runs by piece).
    row_position_ids (1, L) go to the attention, which sees the whole row."""
    ids, positions, mask = b["input_ids"], b["position_ids"], b["mask"]
    length = -(-ids.shape[1] // size) * size
    tail = length - ids.shape[1]
    ids = torch.cat([ids, ids.new_zeros(1, tail)], 1)
    positions = torch.cat([positions, torch.arange(tail, dtype=positions.dtype)[None]], 1)
    targets = torch.cat([ids[:, 1:], ids.new_zeros(1, 1)], 1)  # (1, L): the last position predicts nothing
    mask = torch.cat([mask, mask.new_zeros(1, length - mask.shape[1])], 1)  # (1, L)
    lo, hi = sp_rank * length // size, (sp_rank + 1) * length // size
    first, n = int(mask[:, :lo].sum()), int(mask[:, lo:hi].sum())
    out = dict(input_ids=ids[:, lo:hi], position_ids=positions[:, lo:hi], targets=targets[:, lo:hi],
               mask=mask[:, lo:hi], row_position_ids=positions)
    out.update({k: b[k][first:first + n] for k in PER_TOKEN})
    return out
