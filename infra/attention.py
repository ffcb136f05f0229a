"""The attention kernels of packed rows, registered with transformers (AttentionInterface) when this
file is imported (infra/policy.py, the forward that runs them, imports it):

    attn_implementation="packed_sdpa"     # Config's default

packed_sdpa: sdpa on each sequence of a packed row (packing.py; sequence_parallel.py runs it on a
whole row split over ranks), each run that continues a shared prompt against that prompt's keys
and values (the two-pass kernel); and on a GPU, for a row with shared prompts, flex_row (one
flex_attention call with the row's block mask).
"""

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask


def runs(position_ids):
    """The runs of a packed row (1, L): [(start, end, first position)] of each stretch whose
    positions rise by 1. A run from position 0 is a sequence or a shared prompt; a run from
    position p > 0 continues the last run from 0 after its first p tokens (packing.collate)."""
    pos = position_ids[0]
    cut = torch.ones_like(pos, dtype=torch.bool)
    cut[1:] = pos[1:] != pos[:-1] + 1
    starts = cut.nonzero()[:, 0].tolist()
    return list(zip(starts, starts[1:] + [len(pos)], pos[starts].tolist()))


_LAYOUT = {}  # the position_ids a forward passes to every layer (the same tensor) -> its runs, their masks


def layout(position_ids):
    """The runs of a packed row, each with the root it continues: [(lo, hi, root, first)], read
    once per forward (every layer gets the same position_ids tensor)."""
    if _LAYOUT.get("ids") is not position_ids:
        _LAYOUT.clear()
        spans, root, root_end = [], 0, 0
        for lo, hi, first in runs(position_ids):
            if first == 0:
                root, root_end = lo, hi
            elif root_end - root < first:
                raise ValueError(f"a packed run continues from position {first} without a prompt that long before it")
            spans.append((lo, hi, root, first))
        _LAYOUT.update(ids=position_ids, spans=spans)
    return _LAYOUT["spans"]


def run_masks(spans, sliding_window, device):
    """Each run's mask for the per-run kernel (window_mask, continuation_mask), once per forward
    and window (a layer with another window gets its own)."""
    if ("masks", sliding_window) not in _LAYOUT:
        _LAYOUT["masks", sliding_window] = [
            window_mask(hi - lo, sliding_window, device) if first == 0 else
            continuation_mask(first, hi - lo, sliding_window, device) for lo, hi, _, first in spans]
    return _LAYOUT["masks", sliding_window]


def packed_sdpa(module, query, key, value, attention_mask, position_ids=None, sliding_window=None, **kwargs):
    """transformers' sdpa run on each sequence of a packed row (position_ids restart at 0),
    causal within it and, on a layer with a sliding window (Mistral, Qwen2's and Gemma-3's local
    layers: transformers passes the layer's sliding_window), within the window too: the mask
    transformers built for the row is not needed. A run whose positions continue a prompt
    (a shared prefix, packing.collate) attends to that prompt's first tokens and to itself,
    causally: the two-pass kernel, the prompt once and then each sample against its keys and
    values; on a GPU such a row is one flex_attention call instead (flex_row). Any other input
    (padded rows with their mask, one sequence under the mask transformers built, a decoding
    step against a KV cache) goes to transformers' sdpa as it is.
    query (1, heads, L, head_dim); returns (1, L, heads, head_dim) as the sdpa it stands for."""
    row = position_ids is not None and len(query) == 1 and key.shape[2] == query.shape[2]  # not a KV cache's step
    spans = layout(position_ids) if row else []
    # one sequence and no mask (sequence_parallel.ulysses_attention builds none) still needs its window here
    if len(spans) < 2 and (attention_mask is not None or not sliding_window or not spans):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if query.is_cuda and any(first for _, _, _, first in spans) and not kwargs.get("softcap") \
            and not kwargs.get("dropout"):  # shared prompts on a GPU: one kernel call for the row
        return flex_row(query, key, value, position_ids, sliding_window, spans, kwargs.get("scaling")), None
    outs = []
    for (lo, hi, root, first), mask in zip(spans, run_masks(spans, sliding_window, query.device)):
        keys, values = key[:, :, lo:hi], value[:, :, lo:hi]
        if first:  # the prompt's first `first` tokens, then this run's own
            keys = torch.cat([key[:, :, root:root + first], keys], 2)
            values = torch.cat([value[:, :, root:root + first], values], 2)
        outs.append(sdpa_attention_forward(module, query[:, :, lo:hi], keys, values, mask, **kwargs)[0])
    return torch.cat(outs, dim=1), None


def block_mask(position_ids, sliding_window, spans, device, compiled):
    """flex_attention's BlockMask of a packed row: a token attends causally to its own run and,
    in a run that continues a prompt, to that prompt's first tokens; within the sliding window
    when there is one. The mask packed_sdpa's per-run masks make, over the whole row at once;
    built block by block (`compiled`, on a GPU), with no (L, L) mask of its own (transformers
    still builds its boolean row mask once a forward, which packed_sdpa does not read)."""
    from torch.nn.attention.flex_attention import create_block_mask  # noqa: PLC0415 - the GPU path's

    run, root, first, index = [], [], [], {}
    for i, (lo, hi, r, f) in enumerate(spans):
        index.setdefault(r, i)  # a run from position 0 is its own root; the continuations come after it
        run += [i] * (hi - lo)
        root += [index[r]] * (hi - lo)
        first += [f] * (hi - lo)
    run, root, first = (torch.tensor(x, device=device) for x in (run, root, first))
    pos = position_ids[0].to(device)

    def attends(b, h, q, k):
        back = pos[q] - pos[k]
        yes = ((run[k] == run[q]) & (back >= 0)) | ((run[k] == root[q]) & (pos[k] < first[q]))
        return yes & (back < sliding_window) if sliding_window else yes
    make = _FLEX["create_block_mask"] if compiled else create_block_mask
    return make(attends, None, None, len(pos), len(pos), device=device)


_FLEX = {}  # on a GPU, flex_attention and create_block_mask compiled once, for every row length (dynamic shapes)


def flex_row(query, key, value, position_ids, sliding_window, spans, scaling):
    """A packed row with shared prompts in one flex_attention call (the GPU's path: packed_sdpa's
    per-run calls are launch-bound there): query (1, heads, L, d) -> (1, L, heads, d). Eager
    off a GPU (forward only: flex_attention has no backward on a CPU)."""
    from torch.nn.attention.flex_attention import flex_attention  # noqa: PLC0415

    if query.is_cuda and not _FLEX:
        from torch.nn.attention.flex_attention import create_block_mask  # noqa: PLC0415

        _FLEX.update(flex_attention=torch.compile(flex_attention, dynamic=True),
                     create_block_mask=torch.compile(create_block_mask, dynamic=True))
    key_ = ("flex", sliding_window)
    if key_ not in _LAYOUT:  # once per forward and window, as the layout
        _LAYOUT[key_] = block_mask(position_ids, sliding_window, spans, query.device, query.is_cuda)
    kernel = _FLEX["flex_attention"] if query.is_cuda else flex_attention
    out = kernel(query, key, value, block_mask=_LAYOUT[key_], scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous()


def continuation_mask(first, n, sliding_window, device):
    """(1, 1, n, first + n) bool, True where attended: queries at positions first..first+n-1
    over keys at 0..first-1 (the prompt) then first..first+n-1 (their own run), causal, within
    the sliding window when there is one."""
    queries = torch.arange(first, first + n, device=device)
    keys = torch.cat([torch.arange(first, device=device), queries])
    back = queries[:, None] - keys  # query - key
    attend = back >= 0
    if sliding_window:
        attend &= back < sliding_window
    return attend[None, None]


def window_mask(n, sliding_window, device):
    """Causal attention over the last sliding_window tokens (the query's own included), as
    transformers' sliding_window_overlay: (1, 1, n, n) bool, True where attended. None (sdpa's
    plain causal) without a window or when the sequence fits in it."""
    if not sliding_window or n <= sliding_window:
        return None
    back = torch.arange(n, device=device)[:, None] - torch.arange(n, device=device)  # (n, n): query - key
    return ((back >= 0) & (back < sliding_window))[None, None]


AttentionInterface.register("packed_sdpa", packed_sdpa)
AttentionMaskInterface.register("packed_sdpa", sdpa_mask)  # padded rows keep their mask
