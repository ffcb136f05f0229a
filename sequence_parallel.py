"""Sequence parallelism (DeepSpeed-Ulysses): one packed row split over S ranks, whole sequences in attention.

    torchrun --nproc_per_node 4 train.py --sequence_parallel_size 2   # 2 groups of 2 ranks, each on its own rows

    init_groups(S)                          groups of S consecutive ranks (rank // S: data rank, rank % S: piece)
    heads_to_sequence, sequence_to_heads    the all-to-alls around attention
The rest lives where its part of the work does: packing.piece cuts a packed micro-batch into this
rank's contiguous L/S, and policy.ulysses_attention (attn_implementation="ulysses") runs
policy.packed_sdpa on the whole row between the two all-to-alls.

Every rank of a group gets the same micro-batches (packing with world_size // S data ranks) and
keeps its piece of each row: the embeddings, the MLPs, the norms and the LM head (logprobs,
entropy, top-k heads) run on L/S tokens. Around attention an all-to-all trades "my L/S tokens,
all heads" for "all L tokens, heads/S of them" (the head count must divide by S); attention runs
on the whole row, sequence by sequence (packed_sdpa), and a second all-to-all trades back.
RoPE is applied before attention with each piece's own position_ids, as on one rank. The
all-to-alls are torch's functional collective all_to_all_single_autograd (torch >= 2.4): backward
sends the gradients of the queries, keys and values back to the ranks that computed them, by the
reverse all-to-all. Not the plain all_to_all_single: it gained autograd only with PyTorch PR
#168140 (torch 2.10); before, its backward silently returned no gradient (PyTorch issue #152127).
Those of torch.distributed.nn.functional are deprecated in torch 2.13.

What is reduced, and how: the ranks of a group hold disjoint tokens, so every per-token sum
(loss, KL, entropy, ESS, trained tokens) all-reduced over the world counts each token once, and
the token denominator is the mini-batch's count as before. Each rank's loss over its own tokens,
divided by that count and multiplied by the world size against FSDP's mean (update.py), sums to
the gradient of one loss. FSDP still shards over every rank: an SP group is a set of
data-parallel ranks that share rows. Anything per sequence is refused (plan.py: an objective
whose row in loss.OBJECTIVES has sequences=True, and the sequence-level mismatch mask): a sequence may straddle two pieces.

KV heads: repeated (each one in place, as grouped-query attention shares them) up to
lcm(KV heads, S), the fewest that split evenly over S ranks; the heads/S consecutive query
heads a rank attends with then find, among its KV heads, the ones they had in the model.
"""

import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

GROUP = None  # this rank's sequence-parallel process group (init_groups); None: no sequence parallelism


def init_groups(size):
    """Groups of `size` consecutive ranks (under torchrun the GPUs of one node: the all-to-alls
    stay on the fast links). Every rank creates every group, as new_group requires."""
    global GROUP
    if size == 1:
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            GROUP = group


def heads_to_sequence(x, size):
    """(1, heads, L/S, d), this rank's tokens -> (1, heads/S, L, d), this rank's heads (all-to-all)."""
    _, heads, n, d = x.shape
    sent = x.reshape(size, heads // size, n, d).contiguous()  # chunk i: the heads rank i attends over
    got = all_to_all_single_autograd(sent, None, None, GROUP)  # chunk j: rank j's tokens of my heads
    return got.transpose(0, 1).reshape(1, heads // size, size * n, d)


def sequence_to_heads(x, size):
    """(1, heads/S, L, d), this rank's heads -> (1, heads, L/S, d), this rank's tokens (all-to-all)."""
    _, heads, length, d = x.shape
    sent = x.reshape(heads, size, length // size, d).transpose(0, 1).contiguous()  # chunk j: rank j's tokens
    got = all_to_all_single_autograd(sent, None, None, GROUP)  # chunk i: rank i's heads of my tokens
    return got.reshape(1, heads * size, length // size, d)


def check_heads(model_config, size):
    """A one-line refusal when the model's attention heads do not split over `size` ranks."""
    heads = model_config.num_attention_heads
    if size > 1 and heads % size:
        raise ValueError(f"sequence_parallel_size={size} must divide the model's {heads} attention heads "
                         "(each rank attends with heads / sequence_parallel_size of them); pick a divisor")
