"""Rollouts to micro-batches: whole groups per mini-batch, tokens balanced over ranks, sequences packed.

    micro_batches(samples, cfg, world_size, rank)   [(this rank's packed micro-batches, tokens, sequences)]
      mini_batches    whole groups per optimizer step
      balance         sequences onto ranks (or micro-batches), longest first onto the lightest
      collate         one packed row (1, L) per micro-batch, position_ids restarting at 0
    collate_padded    the right-padded (B, T) twin the tests and benchmarks compare against

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
shape). attention.packed_sdpa runs sdpa on each sequence's slice instead (the sum of squared lengths).

Why balance tokens, not sequences: the cost of a forward is its tokens, and FSDP makes every
rank wait for the slowest at each layer's all-gather. RL completions spread from a few tokens
to the response length, so equal sequence counts leave ranks and micro-batches uneven.
"""

import math

import torch

from episodes import Sample


def batch_plan(cfg, world_size: int) -> dict:
    """Derive the per-rank batch arithmetic. Rollout:
    prompts x samples sequences, split into num_mini_batches optimizer steps of whole groups, each spread over
    world_size // sequence_parallel_size data-parallel ranks by tokens (balance) and packed into micro-batches of at most max_tokens_per_micro_batch
    tokens (gradient accumulation). How many depends on the completions' lengths: the plan gives the count
    when every sequence has its full length, an upper estimate."""
    seqs = cfg.num_unique_prompts_rollout * cfg.num_samples_per_prompt_rollout
    per_mini = seqs // cfg.num_mini_batches
    per_rank = -(-per_mini // (world_size // cfg.sequence_parallel_size))  # a sequence-parallel group shares its rows
    full = per_rank * (cfg.max_prompt_length + cfg.response_length)
    return dict(sequences=seqs, mini_batches=cfg.num_mini_batches, per_mini_batch=per_mini, per_rank=per_rank,
                micro_batches_at_full_length=-(-full // cfg.max_tokens_per_micro_batch),
                optimizer_steps=cfg.num_mini_batches * cfg.num_epochs)


def describe(cfg, plan):
    """The start-up line of the batch arithmetic (batch_plan)."""
    sp = cfg.sequence_parallel_size
    share = "rank" if sp == 1 else f"group of {sp} ranks (each holds 1/{sp} of every row)"
    return (f"batch: {cfg.num_unique_prompts_rollout} prompts x {cfg.num_samples_per_prompt_rollout} samples = "
            f"{plan['sequences']} sequences -> {plan['mini_batches']} mini-batch(es) of {plan['per_mini_batch']} -> "
            f"about {plan['per_rank']} per {share}, balanced by tokens -> micro-batches of at most "
            f"{cfg.max_tokens_per_micro_batch} tokens ({plan['micro_batches_at_full_length']} if every sequence had "
            f"its full length); {plan['optimizer_steps']} optimizer step(s) per rollout")


def length(s):
    """Tokens of one sample in the forward pass: the prompt and every token after it."""
    return len(s.prompt_ids) + len(s.token_ids)


def cost(unit, share):
    """Tokens of a unit (samples of one group with one prompt) in the forward pass: shared, the
    prompt but its last token once, then each sample's tokens after one copy of that last token;
    else every sample whole."""
    if share and len(unit) > 1 and len(unit[0].prompt_ids) > 1:
        return len(unit[0].prompt_ids) - 1 + sum(len(s.token_ids) + 1 for s in unit)
    return sum(map(length, unit))


def joins(a, b):
    """Whether sample b may share sample a's prompt: the same prompt, each one sequence."""
    return a.prompt_ids == b.prompt_ids and not a.restarts and not b.restarts


def places(s, start):
    """Position ids of sample s from prompt token `start` on: counting on through its tokens, and
    from 0 again where a new sequence starts (Sample.restarts)."""
    out, at, restarts = list(range(start, len(s.prompt_ids))), len(s.prompt_ids), set(s.restarts)
    for j in range(len(s.token_ids)):
        at = 0 if j in restarts else at
        out.append(at)
        at += 1
    return out


def units(samples, group_size, share):
    """The samples cut into packing's units: with share, the runs of a group's samples that have
    the same prompt (an environment may give a group's episodes different first messages); else
    one sample each."""
    if not share:
        return [[s] for s in samples]
    out = []
    for i, s in enumerate(samples):
        if i % group_size and joins(samples[i - 1], s):
            out[-1].append(s)
        else:
            out.append([s])
    return out


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


def fit(unit, room, share):
    """How many of a unit's samples, in order, fit in `room` tokens: at least one."""
    k = len(unit)
    while k > 1 and cost(unit[:k], share) > room:
        k -= 1
    return k


def cut(unit, budget, share):
    """A unit in pieces of at most `budget` tokens each (but a sample longer than it), in order."""
    pieces = []
    while unit:
        k = fit(unit, budget, share)
        pieces.append(unit[:k])
        unit = unit[k:]
    return pieces


def balance(items, bins, budget=None, share=False, even=True):
    """Units (lists of samples, see `units`) onto bins, largest first, each onto the bin with the
    fewest tokens so far (the LPT rule): bin totals end within about one unit of each other. A
    unit that would take its bin past the mean load (or past `budget`) is split where a sample of
    it still fits: the samples that fit stay, the rest goes back into line with its own copy of
    the prompt. Within a bin the units keep their order. Returns each bin's units, or None when
    a single sample would push the lightest bin past `budget` tokens."""
    mean = sum(cost(u, share) for u in items) / bins
    todo = sorted(((u, i) for i, u in enumerate(items)), key=lambda x: -cost(x[0], share))  # stable: ties by position
    loads, out = [0] * bins, [[] for _ in range(bins)]
    while todo:
        unit, i = todo.pop(0)
        b = min(range(bins), key=loads.__getitem__)
        room = mean - loads[b] if even else math.inf
        k = fit(unit, room, share)  # at least one sample: a remainder never lands whole on one bin
        if budget is not None and loads[b] + cost(unit[:k], share) > budget:
            k = fit(unit, budget - loads[b], share)
            if loads[b] + cost(unit[:k], share) > budget:
                return None
        if k < len(unit):  # the rest goes back in line, after the part that stays
            rest = unit[k:]
            at = next((j for j, (u, _) in enumerate(todo) if cost(u, share) < cost(rest, share)), len(todo))
            todo.insert(at, (rest, i + 0.5))
        loads[b] += cost(unit[:k], share)
        out[b].append((i, unit[:k]))
    return [[u for _, u in sorted(bin_, key=lambda x: x[0])] for bin_ in out]


def pack_ranks(mini, world_size, budget, group_size=1, share=False):
    """Every rank's share of one mini-batch cut into the same number of micro-batches of at most
    `budget` tokens each, tokens balanced between ranks and between micro-batches. A
    micro-batch left empty gets a PADDING sample. [rank][micro-batch] -> list of samples.

    With share, two assignments are made and the better kept: the groups' units (a group's
    samples together where the balance allows, its prompt counted once, `cost`) and the
    samples one by one, whose siblings still share their prompt where they land in one
    micro-batch. Fewer micro-batches win, then the lighter slowest rank, so sharing never packs
    worse than the unshared assignment (units are coarse when completions are long against the
    budget)."""
    if not share:
        return assign(units(mini, group_size, False), world_size, budget, False)
    grouped = assign(units(mini, group_size, True), world_size, budget, True)
    single = assign(units(mini, group_size, False), world_size, budget, True)
    return min(grouped, single, key=lambda p: (len(p[0]), max(sum(row_length(mb) for mb in r) for r in p)))


def row_length(samples):
    """Tokens of collate(samples, share=True)'s row: each sample its tokens and one more (a copy
    of its prompt's last token, or the prompt's last token itself), and the prompt but its last
    token once per run of samples that share it (`joins`, as collate reads it: a sample of several
    sequences has its prompt to itself)."""
    return sum(len(s.token_ids) + 1 + (0 if i and joins(samples[i - 1], s) else len(s.prompt_ids) - 1)
               for i, s in enumerate(samples))


def assign(items, world_size, budget, share):
    """pack_ranks for one list of units: onto ranks (split at the mean load), then each rank's
    share into the fewest micro-batches every rank can fill under the budget."""
    pieces = [p for u in items for p in cut(u, budget, share)]
    shares = balance(pieces, world_size, share=share)
    fewest = max(-(-sum(cost(u, share) for u in s) // budget) for s in shares)
    most = max(sum(map(len, s)) for s in shares)
    for n_micro in range(max(fewest, 1), most + 1):
        packed = [balance(s, n_micro, budget, share, even=False) for s in shares]
        if all(p is not None for p in packed):
            return [[sum(mb, []) or [PADDING] for mb in p] for p in packed]
    raise ValueError(f"a sequence of {max(length(s) for u in items for s in u)} tokens does not fit "
                     f"max_tokens_per_micro_batch={budget}; raise it to at least max_prompt_length + response_length")


# What a micro-batch carries per loss token (N,), in the mask's order, and its dtype. A new
# per-token field is a row here and a line in loss_tokens; collate, sequence_parallel.piece
# and update.py then carry it as b[name].
PER_TOKEN = {"vllm_logp": torch.float32,  # the sampler's logprob
             "adv": torch.float32,  # the sample's advantage
             "fresh": torch.bool,  # sampled by the weights the trainer holds (the sync check reads these)
             "seq_ids": torch.long}  # the sample's number within the micro-batch
# ... and what a reference put on the samples (Sample.ref), carried when they have it: a teacher's
# logprob of each token and, for the top-k KL, its k most likely ids there and their logprobs (N, k)
REFERENCE_TOKENS = {"ref_logp": torch.float32, "ref_head_ids": torch.long, "ref_head_logp": torch.float32}
TOKENS = {**PER_TOKEN, **REFERENCE_TOKENS}


def loss_tokens(s, i):
    """The per-token lists of sample s (number i in its micro-batch) over its policy tokens."""
    logp = [lp for lp, m in zip(s.logprobs, s.mask) if m]
    return dict(vllm_logp=logp, adv=[s.adv] * len(logp), fresh=[s.staleness == 0] * len(logp),
                seq_ids=[i] * len(logp), **(s.ref or {}))


def collate(samples, share=False):
    """One packed row: input_ids and position_ids (1, L), the loss mask over next-token targets
    (1, L-1): the policy's tokens, not the prompt's or an environment's; and per-token vllm_logp,
    adv, fresh and seq_ids (the sample of each token within this micro-batch) (N,) in the mask's
    order. The last token of a sequence predicts nothing: the token after it begins the next one.

    With share, consecutive samples with the same prompt (of 2 tokens or more) share it: the
    prompt but its last token once, then each sample as that last token and its own tokens,
    positions continuing from the prompt's (attention.packed_sdpa reads the layout from the
    position_ids). Every sample keeps its own copy of the prompt's last token, which predicts its
    first token, so the mask and per-token tensors are those of the unshared row, token for token."""
    ids, positions, mask, per = [], [], [], {k: [] for k in PER_TOKEN}
    for i, s in enumerate(samples):
        p = len(s.prompt_ids)
        follows = i and joins(samples[i - 1], s)
        shared = share and p > 1 and (follows or i + 1 < len(samples) and joins(s, samples[i + 1]))
        if shared and not follows:  # the first of a run lays out the prefix
            ids += s.prompt_ids[:-1]
            positions += range(p - 1)
            mask += [False] * (p - 1)
        start = p - 1 if shared else 0  # where this sample's own tokens begin in the prompt
        ids += s.prompt_ids[start:] + s.token_ids
        positions += places(s, start)
        # position j predicts token j+1: the prompt's last token predicts the first token after it
        mask += [False] * (p - 1 - start) + [s.valid and bool(m) for m in s.mask] + [False]
        if s.valid:
            for k, values in loss_tokens(s, i).items():
                per.setdefault(k, []).extend(values)
    return dict(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]),
                mask=torch.tensor([mask[:-1]], dtype=torch.bool), **per_token(per))


def per_token(lists):
    return {k: torch.tensor(values, dtype=TOKENS[k]) for k, values in lists.items()}


def shares_prompts(cfg):
    """Whether a group's samples share their prompt in the forward: shared_prefix, under the
    attention that reads the layout from position_ids (packed_sdpa; sequence parallelism runs it
    on whole rows)."""
    return cfg.shared_prefix and cfg.attn_implementation == "packed_sdpa"


def unshared_reason(cfg):
    """The line train.announce prints when shared_prefix is asked for and cannot apply:
    transformers' sdpa, eager, flex_attention and flash_attention_2 build their own mask."""
    if cfg.shared_prefix and not shares_prompts(cfg):
        return (f"shared_prefix: off: attn_implementation={cfg.attn_implementation!r} builds its own mask over a row, "
                "which would cut each sample from its prompt (packed_sdpa shares it)")
    return None


def micro_batches(samples, cfg, world_size, rank):
    """This rank's packed micro-batches of each mini-batch, with the whole mini-batch's policy
    tokens (those in the loss) and sequences: [(micro-batches, tokens, sequences)]. Every rank
    computes the same assignment from the same samples and keeps its own part."""
    out = []
    group_size, share = cfg.num_samples_per_prompt_rollout, shares_prompts(cfg)
    for mini in mini_batches(samples, cfg.num_mini_batches, group_size):
        mine = pack_ranks(mini, world_size, cfg.max_tokens_per_micro_batch, group_size, share)[rank] if mini else []
        out.append(([collate(mb, share) for mb in mine], sum(s.policy_tokens for s in mini), len(mini)))
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
        if s.restarts:
            raise ValueError("a sample of several sequences (Sample.restarts) packs only: use collate")
        input_ids[i, :p + c] = torch.tensor(s.prompt_ids + s.token_ids)
        attention_mask[i, :p + c] = 1
        if s.valid:
            mask[i, p - 1:p + c - 1] = torch.tensor(s.mask, dtype=torch.bool)
            for k, values in loss_tokens(s, i).items():
                per.setdefault(k, []).extend(values)
    return dict(input_ids=input_ids, attention_mask=attention_mask, mask=mask, **per_token(per))
