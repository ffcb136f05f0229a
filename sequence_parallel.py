"""Sequence parallelism (DeepSpeed-Ulysses): one packed row split over S ranks, whole sequences in attention.

    torchrun --nproc_per_node 4 train.py --sequence_parallel_size 2   # 2 groups of 2 ranks, each on its own rows

    init_groups(S)                          groups of S consecutive ranks (rank // S: data rank, rank % S: piece)
    piece(b, sp_rank, S)                    this rank's contiguous L/S of a packed micro-batch (packing.collate)
    register_attention()                    attn_implementation="ulysses": ulysses_attention, and no mask
    ulysses_attention                       attention.packed_sdpa on the whole row, between the two all-to-alls
    heads_to_sequence, sequence_to_heads    the all-to-alls around attention
    check_heads(model_config, S)            the refusal of a head count S does not divide

Its doors, each entered only when sequence_parallel_size > 1 (a plain run never imports this file):
    train.model_doors            init_groups, and register_attention: the attention infra.parallel.load_model
                                 builds every model with (the policy and every reference, adapters
                                 included, run "ulysses")
    train.check_model            check_heads, before any process group
    update.train_on_batch        piece of each micro-batch
policy.sequence_logprobs takes a piece's targets and hands row_position_ids to the attention;
config.py refuses what a split row cannot do (below).

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
data-parallel ranks that share rows. Anything per sequence is refused (config.py: an objective
whose row in loss.OBJECTIVES has sequences=True, and the sequence-level mismatch mask): a sequence may straddle two pieces.

KV heads: repeated (each one in place, as grouped-query attention shares them) up to
lcm(KV heads, S), the fewest that split evenly over S ranks; the heads/S consecutive query
heads a rank attends with then find, among its KV heads, the ones they had in the model.
"""

import math
import types

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.masking_utils import AttentionMaskInterface

from packing import TOKENS
from infra.attention import packed_sdpa

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
    out.update({k: b[k][first:first + n] for k in TOKENS if k in b})
    return out


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


def ulysses_attention(module, query, key, value, attention_mask, position_ids=None, row_position_ids=None, **kwargs):
    """packed_sdpa over the whole row with heads/S heads per rank. query (1, heads, L/S, d) and
    key, value (1, KV heads, L/S, d) are this rank's piece after RoPE; returns (1, L/S, heads, d)
    as transformers' attention functions do. attention_mask is ignored (ulysses_mask builds none:
    packed_sdpa cuts the row at row_position_ids == 0)."""
    size = dist.get_world_size(GROUP)
    kv_heads = key.shape[1]
    repeats = math.lcm(kv_heads, size) // kv_heads
    key, value = repeat_kv(key, repeats), repeat_kv(value, repeats)
    query, key, value = (heads_to_sequence(x, size) for x in (query, key, value))
    # the local heads: query head i uses KV head i // groups, as in the model's own grouping
    local = types.SimpleNamespace(num_key_value_groups=query.shape[1] // key.shape[1], training=module.training,
                                  is_causal=True, layer_idx=getattr(module, "layer_idx", None))
    out, _ = packed_sdpa(local, query, key, value, None, position_ids=row_position_ids, **kwargs)  # (1, L, h/S, d)
    return sequence_to_heads(out.transpose(1, 2), size).transpose(1, 2).contiguous(), None


def ulysses_mask(*args, **kwargs):
    """No mask: the attention cuts the whole row into sequences itself (a mask built for one
    piece would not fit the row)."""
    return None


def register_attention():
    """Registers ulysses_attention with transformers as attn_implementation "ulysses" (and no
    mask for it); returns that name, for from_pretrained."""
    AttentionInterface.register("ulysses", ulysses_attention)
    AttentionMaskInterface.register("ulysses", ulysses_mask)
    return "ulysses"


def check_heads(model_config, size):
    """A one-line refusal when the model's attention heads do not split over `size` ranks."""
    heads = model_config.num_attention_heads
    if size > 1 and heads % size:
        raise ValueError(f"sequence_parallel_size={size} must divide the model's {heads} attention heads "
                         "(each rank attends with heads / sequence_parallel_size of them); pick a divisor")
