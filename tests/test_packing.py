"""Padding-free packing against its padded twin on the tiny model, the boundary mask, and the
token balancer's promises (whole groups, every sequence once, balanced ranks, equal forward passes)."""

import copy
import random
from dataclasses import replace

import pytest
import torch

import packing
from infra import attention, policy
from config import Config, flash_attention_available
from loss import grpo_loss
from episodes import Sample


def rollouts(n, seed, prompt=(2, 12), completion=(1, 30)):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p, c = rng.randint(*prompt), rng.randint(*completion)
        out.append(Sample(prompt_ids=[rng.randint(3, 63) for _ in range(p)],
                          token_ids=[rng.randint(3, 63) for _ in range(c)],
                          logprobs=[-4 * rng.random() for _ in range(c)], adv=rng.gauss(0, 1)))
        out[-1].index = i  # which sample, wherever packing puts it
    return out


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128))
    return dict(qwen2=AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), llama=llama)


FLASH = pytest.mark.skipif(not flash_attention_available(), reason="flash_attention_2 needs a GPU and the flash-attn package")


@pytest.mark.parametrize("arch,impl", [(a, i) for a in ("qwen2", "llama") for i in ("sdpa", "eager", "packed_sdpa")] + [
    pytest.param("llama", "flex_attention", marks=pytest.mark.slow),  # compiles its kernel: a minute on this CPU
    pytest.param("llama", "flash_attention_2", marks=FLASH)])
def test_packed_position_ids_give_per_sequence_attention(models, arch, impl):
    """A packed row with position_ids restarting at 0 and no attention mask gives each sequence
    the logprobs it has alone (transformers' mask for sdpa and eager, a slice per sequence for
    packed_sdpa); a 2-D mask of ones beside the same position_ids lets tokens see the sequences
    before them under transformers' attention (its packed-sequence detection is skipped), not
    under packed_sdpa, which cuts the row by position_ids alone. flex_attention compiles on the
    CPU; flash_attention_2 runs only where a GPU and flash-attn are."""
    model, device, tol = models[arch], "cpu", 1e-5
    if impl == "flash_attention_2":  # bf16 on the GPU: compared with sdpa there, at bf16's precision
        model, device, tol = copy.deepcopy(model).to("cuda", torch.bfloat16), "cuda", 3e-2
    seqs = [s.prompt_ids + s.token_ids for s in rollouts(4, seed=1)]
    ids = torch.tensor([sum(seqs, [])], device=device)
    positions = torch.tensor([[j for s in seqs for j in range(len(s))]], device=device)
    with torch.no_grad():
        model.config._attn_implementation = "sdpa"
        alone = torch.cat([model(input_ids=torch.tensor([s], device=device), use_cache=False).logits[0] for s in seqs])
        model.config._attn_implementation = impl
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
        masked = model(input_ids=ids, position_ids=positions, attention_mask=torch.ones_like(ids),
                       use_cache=False).logits[0]
    model.config._attn_implementation = "sdpa"
    assert torch.allclose(packed.float().log_softmax(-1), alone.float().log_softmax(-1), atol=tol, rtol=0)
    leak = (masked.float().log_softmax(-1) - alone.float().log_softmax(-1)).abs().max()
    assert leak < 1e-5 if impl == "packed_sdpa" else leak > 1e-2


def test_boundary_mask_and_per_token_order():
    """Hand-built: (prompt 2, completion 2), padding, (prompt 1, completion 3). Position j predicts
    token j+1; the last token of each sequence predicts the next one's first token: masked out."""
    a = Sample(prompt_ids=[10, 11], token_ids=[12, 13], logprobs=[-1.0, -2.0], adv=0.5, staleness=1)
    b = Sample(prompt_ids=[20], token_ids=[21, 22, 23], logprobs=[-3.0, -4.0, -5.0], adv=-1.0)
    got = packing.collate([a, packing.PADDING, b])
    assert got["input_ids"].tolist() == [[10, 11, 12, 13, 0, 0, 20, 21, 22, 23]]
    assert got["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2, 3]]
    #              10->11 11->12 12->13 13->0  0->0   0->20  20->21 21->22 22->23
    assert got["mask"].tolist() == [[False, True, True, False, False, False, True, True, True]]
    assert got["seq_ids"].tolist() == [0, 0, 2, 2, 2]  # the sample within the micro-batch
    assert got["vllm_logp"].tolist() == [-1.0, -2.0, -3.0, -4.0, -5.0]
    assert got["adv"].tolist() == [0.5, 0.5, -1.0, -1.0, -1.0]
    assert got["fresh"].tolist() == [False, False, True, True, True]


def mini_batch_loss(model, batches, cfg, denom, key):
    """Per-sample logp and the summed loss of a mini-batch's micro-batches (backward on each);
    key: position_ids (packed rows) or attention_mask (padded rows)."""
    logps, total = {}, 0.0
    for samples, b in batches:
        logp, _, _, _ = policy.sequence_logprobs(model, b["input_ids"], b["mask"], 1.0, **{key: b[key]})
        loss, _ = grpo_loss(logp, b["vllm_logp"], b["adv"], b["seq_ids"], denom, cfg)
        loss.backward()
        total += loss.item()
        parts = logp.detach().split([len(s.token_ids) for s in samples if s.valid])
        logps.update({s.index: part for s, part in zip([s for s in samples if s.valid], parts)})
    return logps, total


@pytest.mark.parametrize("loss_fn,impl", [("dapo", "packed_sdpa"), ("gspo", "packed_sdpa"), ("dapo", "sdpa")])
def test_packed_matches_padded_logprobs_loss_and_gradients(models, loss_fn, impl):
    """One mini-batch of 12 sequences (lengths 3 to 42) packed under a 64-token budget (several
    micro-batches, sequences reordered; attention by impl) and padded in rows of 5 (transformers'
    sdpa with the padding mask): same per-token logp, same loss (denominator: the mini-batch's
    tokens) and same gradients to 1e-5. gspo reads seq_ids."""
    model = models["qwen2"]
    samples = rollouts(12, seed=2)
    cfg = Config(loss_fn=loss_fn, max_prompt_length=12, response_length=30, max_tokens_per_micro_batch=64,
                 num_unique_prompts_rollout=3, num_samples_per_prompt_rollout=4)
    denom = float(sum(len(s.token_ids) for s in samples))
    shares = packing.pack_ranks(samples, 1, 64)[0]
    assert len(shares) >= 3 and all(sum(map(packing.length, mb)) <= 64 for mb in shares)
    packed = [(mb, packing.collate(mb)) for mb in shares]
    padded = [(samples[i:i + 5], packing.collate_padded(samples[i:i + 5], pad_id=0)) for i in range(0, 12, 5)]
    results = []
    for batches, key, attn in ((packed, "position_ids", impl), (padded, "attention_mask", "sdpa")):
        model.zero_grad()
        model.config._attn_implementation = attn
        logps, loss = mini_batch_loss(model, batches, cfg, denom, key)
        results.append((logps, loss, {n: p.grad.clone() for n, p in model.named_parameters()}))
    model.config._attn_implementation = "sdpa"
    (lp_packed, loss_packed, g_packed), (lp_padded, loss_padded, g_padded) = results
    assert sorted(lp_packed) == list(range(12))
    for i in range(12):
        assert torch.allclose(lp_packed[i], lp_padded[i], atol=1e-5, rtol=0), i
    assert loss_packed == pytest.approx(loss_padded, abs=1e-5) and loss_packed != 0
    for n, g in g_packed.items():
        assert g.abs().max() > 0 or "bias" in n, n
        assert torch.allclose(g, g_padded[n], atol=1e-5, rtol=0), n


def test_a_2d_mask_beside_packed_position_ids_is_refused(models):
    b = packing.collate(rollouts(2, seed=3))
    with pytest.raises(ValueError, match="not both"):
        policy.sequence_logprobs(models["qwen2"], b["input_ids"], b["mask"], 1.0, position_ids=b["position_ids"],
                          attention_mask=torch.ones_like(b["input_ids"]))


@pytest.mark.parametrize("world_size,budget", [(1, 300), (2, 300), (3, 512), (4, 2048)])
def test_balancer_whole_groups_every_sequence_once_balanced_ranks(world_size, budget):
    """12 groups of 8, completions of 8 to 256 tokens, 3 mini-batches: each mini-batch holds 4
    whole groups; across ranks and micro-batches every sequence appears once; rank totals lie
    within one sequence's length of each other; every rank runs the same number of micro-batches,
    each under the budget; padding micro-batches carry no tokens."""
    samples = rollouts(96, seed=world_size, prompt=(4, 40), completion=(8, 256))
    for s in samples:
        s.group = s.index // 8
    cfg = Config(num_unique_prompts_rollout=12, num_samples_per_prompt_rollout=8, num_mini_batches=3,
                 max_prompt_length=40, response_length=256, max_tokens_per_micro_batch=budget)
    minis = packing.mini_batches(samples, 3, 8)
    for j, mini in enumerate(minis):
        assert {s.group for s in mini} == set(range(4 * j, 4 * j + 4)) and len(mini) == 32
        ranks = packing.pack_ranks(mini, world_size, budget)
        assert len({len(r) for r in ranks}) == 1  # the same number of forward passes on every rank
        got = [s.index for r in ranks for mb in r for s in mb if s.valid]
        assert sorted(got) == sorted(s.index for s in mini)
        loads = [sum(packing.length(s) for mb in r for s in mb if s.valid) for r in ranks]
        assert max(loads) - min(loads) <= max(map(packing.length, mini))
        assert all(sum(map(packing.length, mb)) <= budget for r in ranks for mb in r)
    per_rank = [packing.micro_batches(samples, cfg, world_size, rank) for rank in range(world_size)]
    for j in range(3):
        assert len({len(p[j][0]) for p in per_rank}) == 1
        assert {(p[j][1], p[j][2]) for p in per_rank} == {(sum(len(s.token_ids) for s in minis[j]), 32)}
        tokens = sum(b["mask"].sum().item() for p in per_rank for b in p[j][0])
        assert tokens == per_rank[0][j][1]  # the denominator counts exactly the masked tokens


def test_mini_batches_may_be_empty_and_short_ranks_get_padding():
    """1 group of 2 over 3 mini-batches leaves two empty on every rank (no micro-batch at all);
    a group of 2 over 3 ranks gives the third rank a padding micro-batch with no tokens."""
    samples = rollouts(2, seed=4)
    cfg = Config(num_unique_prompts_rollout=3, num_samples_per_prompt_rollout=2, num_mini_batches=3,
                 max_prompt_length=12, response_length=30)
    minis = [packing.micro_batches(samples, cfg, 2, rank) for rank in (0, 1)]
    assert [[(len(mbs), seqs) for mbs, _, seqs in m] for m in minis] == [[(0, 0), (1, 2), (0, 0)]] * 2
    third = packing.micro_batches(samples, replace(cfg, num_mini_batches=1), 3, 2)[0][0]
    assert len(third) == 1 and third[0]["mask"].sum() == 0 and third[0]["seq_ids"].numel() == 0


def test_a_sequence_longer_than_the_budget_is_refused():
    with pytest.raises(ValueError, match="raise it to at least"):
        packing.pack_ranks(rollouts(4, seed=5, prompt=(10, 10), completion=(30, 30)), 2, budget=39)


def windowed_model(arch):
    """A tiny model whose attention looks back 5 tokens: every layer (Mistral), the second layer
    only (Qwen2's max_window_layers=1), the first only (Gemma-3's layer_types)."""
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)

    shape = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=128, sliding_window=5)
    torch.manual_seed(0)
    if arch == "mistral":
        return MistralForCausalLM(MistralConfig(**shape))
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**shape, use_sliding_window=True, max_window_layers=1))
    return Gemma3ForCausalLM(Gemma3TextConfig(**shape, head_dim=32, layer_types=["sliding_attention", "full_attention"]))


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "gemma3"])
def test_packed_rows_keep_the_sliding_window(arch):
    """Sequences of 9 to 20 tokens (longer than the window of 5) packed in one row under
    packed_sdpa, and each one alone in the pattern of sequence_parallel.ulysses_attention
    (packed_sdpa, no mask, one sequence): the logprobs of each sequence alone through the
    model's own eager attention with its own sliding-window mask, to 1e-5. A full-attention twin differs, so the window matters."""
    model = windowed_model(arch).eval()
    samples = rollouts(3, seed=4, prompt=(4, 6), completion=(5, 14))
    b = packing.collate(samples)
    model.config._attn_implementation = "packed_sdpa"
    with torch.no_grad():
        packed, _, _, _ = policy.sequence_logprobs(model, b["input_ids"], b["mask"], 1.0, position_ids=b["position_ids"])
        alone = [policy.sequence_logprobs(model, c["input_ids"], c["mask"], 1.0, position_ids=c["position_ids"])[0]
                 for c in map(packing.collate, ([s] for s in samples))]
        model.config._attn_implementation = "eager"
        own = [policy.sequence_logprobs(model, c["input_ids"], c["mask"], 1.0)[0]
               for c in map(packing.collate, ([s] for s in samples))]
        model.config.sliding_window = 1000  # read by the mask at each forward
        for layer in model.model.layers:
            layer.self_attn.sliding_window = None if arch != "mistral" else 1000
        full = [policy.sequence_logprobs(model, c["input_ids"], c["mask"], 1.0)[0]
                for c in map(packing.collate, ([s] for s in samples))]
    assert all(packing.length(s) > 8 for s in samples)
    assert (torch.cat(own) - torch.cat(full)).abs().max() > 1e-3
    assert torch.allclose(packed, torch.cat(own), atol=1e-5, rtol=0)
    assert torch.allclose(torch.cat(alone), torch.cat(own), atol=1e-5, rtol=0)


def test_window_mask_by_hand():
    """Row i attends to columns i-2..i with a window of 3; none when the sequence fits."""
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(attention.window_mask(4, 3, "cpu")[0, 0], expected)
    assert attention.window_mask(3, 3, "cpu") is None and attention.window_mask(9, None, "cpu") is None


def groups(n_groups, size, seed, prompt=(2, 12), completion=(1, 30), env_turns=True):
    """n_groups groups of `size` samples after one prompt each (as GRPO samples them); with
    env_turns, samples long enough carry a 3-token environment answer in the middle (mask 0)."""
    rng = random.Random(seed)
    out = []
    for g in range(n_groups):
        prompt_ids = [rng.randint(3, 63) for _ in range(rng.randint(*prompt))]
        for _ in range(size):
            c = rng.randint(*completion)
            mask = [1] * c if c < 6 or not env_turns else [1] * (c // 2) + [0] * 3 + [1] * (c - c // 2 - 3)
            out.append(Sample(prompt_ids=prompt_ids, token_ids=[rng.randint(3, 63) for _ in range(c)],
                              logprobs=[-4 * rng.random() if m else 0.0 for m in mask], mask=mask,
                              adv=rng.gauss(0, 1)))
            out[-1].index, out[-1].group = len(out) - 1, g
    return out


def test_shared_layout_by_hand():
    """Two samples after the prompt [10, 11, 12], then one alone: the prompt's first two tokens
    once, then each sample as the prompt's last token (position 2) and its own tokens; the
    mask and per-token tensors are the unshared row's, token for token."""
    a = Sample(prompt_ids=[10, 11, 12], token_ids=[13, 14], logprobs=[-1.0, -2.0], adv=0.5)
    b = Sample(prompt_ids=[10, 11, 12], token_ids=[15, 16, 17], logprobs=[-3.0, 0.0, -5.0], mask=[1, 0, 1], adv=-1.0)
    c = Sample(prompt_ids=[20, 21], token_ids=[22], logprobs=[-6.0], adv=2.0)
    got, whole = packing.collate([a, b, c], share=True), packing.collate([a, b, c])
    assert got["input_ids"].tolist() == [[10, 11, 12, 13, 14, 12, 15, 16, 17, 20, 21, 22]]
    assert got["position_ids"].tolist() == [[0, 1, 2, 3, 4, 2, 3, 4, 5, 0, 1, 2]]
    #              10->11 11->12 12->13 13->14 14->12 12->15 15->16 16->17 17->20 20->21 21->22
    assert got["mask"].tolist() == [[False, False, True, True, False, True, False, True, False, False, True]]
    assert got["mask"].sum() == whole["mask"].sum() == 5
    for k in packing.PER_TOKEN:
        assert torch.equal(got[k], whole[k]), k
    assert packing.cost([a, b], share=True) == 2 + 3 + 4 == got["input_ids"].shape[1] - 3
    assert packing.cost([a, b], share=False) == 11
    assert attention.runs(got["position_ids"]) == [(0, 5, 0), (5, 9, 2), (9, 12, 0)]


def sharing_results(model, samples, head_size=3):
    """Per-token logp, entropy, top-k logp and ids, and every gradient, shared and unshared, of one
    micro-batch (one GRPO-like backward each)."""
    out = []
    for share in (True, False):
        b = packing.collate(samples, share)
        model.zero_grad()
        logp, entropy, head_logp, head_ids = policy.sequence_logprobs(model, b["input_ids"], b["mask"], 1.0,
                                                                      position_ids=b["position_ids"],
                                                                      head_size=head_size)
        ((logp * b["adv"]).sum() + head_logp.exp().sum()).backward()
        out.append(dict(logp=logp.detach(), entropy=entropy, head_logp=head_logp.detach(), head_ids=head_ids,
                        tokens=b["input_ids"].shape[1],
                        **{n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    return out


@pytest.mark.parametrize("arch", ["qwen2", "llama", "mistral", "gemma3"])
def test_shared_prompts_match_the_unshared_row(models, arch):
    """3 groups of 4 samples after one prompt each (2 to 12 tokens; one group's prompt of 1 token
    stays unshared), multi-turn masks, then a padding sample: per-token logp, entropy, top-3 logp
    and ids, and every parameter's gradient equal the unshared row's to 1e-5, on Qwen2 and Llama
    (grouped KV heads) and with a sliding window of 5 on Mistral (every layer) and Gemma-3 (the
    first), shorter than most prompts and samples."""
    model = models[arch] if arch in models else windowed_model(arch)
    model.config._attn_implementation = "packed_sdpa"
    samples = groups(3, 4, seed=7) + [replace(s, prompt_ids=[5]) for s in groups(1, 2, seed=8)] + [packing.PADDING]
    shared, whole = sharing_results(model, samples)
    model.config._attn_implementation = "sdpa"
    assert shared["tokens"] < whole["tokens"] - 20
    assert torch.equal(shared["head_ids"], whole["head_ids"])
    for k, v in whole.items():
        if k not in ("tokens", "head_ids"):
            assert v.abs().max() > 0 or "bias" in k, k
            assert torch.allclose(shared[k], v, atol=1e-5, rtol=0), k


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("arch", ["qwen2", "llama", "mistral", "gemma3"])
def test_the_one_call_kernel_of_a_gpu_gives_the_two_pass_forward(models, arch):
    """attention.flex_row (shared prompts on a GPU: one flex_attention call per layer with the row's
    block mask) against packed_sdpa's per-run calls, the rows of the test above: logp, entropy and
    the top-3 to 1e-5, grouped KV heads, sliding windows and Gemma-3's scale included. Forward only:
    flex_attention has no backward on a CPU; its GPU run is untested here."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def one_call(module, query, key, value, attention_mask, position_ids=None, sliding_window=None, **kwargs):
        spans = attention.layout(position_ids)
        return attention.flex_row(query, key, value, position_ids, sliding_window, spans, kwargs.get("scaling")), None
    AttentionInterface.register("flex_row", one_call)
    AttentionMaskInterface.register("flex_row", sdpa_mask)
    model = models[arch] if arch in models else windowed_model(arch)
    samples = groups(3, 4, seed=7) + [replace(s, prompt_ids=[5]) for s in groups(1, 2, seed=8)] + [packing.PADDING]
    b = packing.collate(samples, share=True)
    got = {}
    with torch.no_grad():
        for kernel in ("packed_sdpa", "flex_row"):
            model.config._attn_implementation = kernel
            got[kernel] = policy.sequence_logprobs(model, b["input_ids"], b["mask"], 1.0,
                                                   position_ids=b["position_ids"], head_size=3)
    model.config._attn_implementation = "sdpa"
    assert any(first for _, _, first in attention.runs(b["position_ids"]))
    for two_pass, one in zip(got["packed_sdpa"], got["flex_row"]):
        assert torch.allclose(one.float(), two_pass.float(), atol=1e-5, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the one-call kernel is the GPU's; no GPU here")
@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_on_a_gpu_shared_prompts_in_one_call_match_the_unshared_row(models, arch):
    """On a GPU packed_sdpa runs a row with shared prompts as one compiled flex_attention call
    per layer: logp, entropy, top-3 and every gradient against the unshared row's, float32."""
    import copy

    model = copy.deepcopy(models[arch] if arch in models else windowed_model(arch)).cuda()
    model.config._attn_implementation = "packed_sdpa"
    samples = groups(3, 4, seed=7) + [replace(s, prompt_ids=[5]) for s in groups(1, 2, seed=8)] + [packing.PADDING]
    out = []
    for share in (True, False):
        b = {k: v.cuda() for k, v in packing.collate(samples, share).items() if torch.is_tensor(v)}
        model.zero_grad()
        logp, entropy, head_logp, _ = policy.sequence_logprobs(model, b["input_ids"], b["mask"], 1.0,
                                                               position_ids=b["position_ids"], head_size=3)
        ((logp * b["adv"]).sum() + head_logp.exp().sum()).backward()
        out.append([logp.detach(), entropy.detach(), head_logp.detach()] + [p.grad.clone() for p in model.parameters()])
    for shared, whole in zip(*out):
        assert torch.allclose(shared, whole, atol=1e-4, rtol=0)


def test_a_sample_cut_from_its_prompt_would_differ(models):
    """The test above can fail: the same rows with the continued runs attending to their own
    tokens only (no prompt) change the logprobs."""
    model = models["qwen2"]
    model.config._attn_implementation = "packed_sdpa"
    b = packing.collate(groups(2, 3, seed=9), share=True)
    with torch.no_grad():
        logp = policy.sequence_logprobs(model, b["input_ids"], b["mask"], 1.0, position_ids=b["position_ids"])[0]
        cut = b["position_ids"].clone()
        for lo, hi, first in attention.runs(cut):
            cut[0, lo:hi] -= first  # every run its own sequence, positions from 0
        alone = policy.sequence_logprobs(model, b["input_ids"], b["mask"], 1.0, position_ids=cut)[0]
    model.config._attn_implementation = "sdpa"
    assert (logp - alone).abs().max() > 1e-2


def test_a_run_that_continues_no_prompt_is_refused(models):
    model = models["llama"]
    model.config._attn_implementation = "packed_sdpa"
    with pytest.raises(ValueError, match="continues from position 4 without a prompt that long"):
        model(input_ids=torch.tensor([[3, 4, 5, 6, 7]]), position_ids=torch.tensor([[0, 1, 4, 5, 6]]), use_cache=False)
    model.config._attn_implementation = "sdpa"


@pytest.mark.parametrize("world_size,budget", [(1, 300), (2, 300), (3, 512), (4, 2048), (2, 4096)])
def test_shared_balancer_keeps_groups_together_and_ranks_balanced(world_size, budget):
    """12 groups of 8 (prompts 4 to 100 tokens, completions 8 to 200), 3 mini-batches, shared:
    every sequence once; every rank the same number of micro-batches, each row within the
    budget; rank totals (tokens in rows) within one sample and one more copy of a prompt of
    each other, the largest below the unshared largest; under a budget that holds whole groups,
    no group in more than two pieces."""
    samples = groups(12, 8, seed=world_size, prompt=(4, 100), completion=(8, 200), env_turns=False)
    cfg = Config(num_unique_prompts_rollout=12, num_samples_per_prompt_rollout=8, num_mini_batches=3,
                 max_prompt_length=100, response_length=200, max_tokens_per_micro_batch=budget)
    for mini in packing.mini_batches(samples, 3, 8):
        ranks = packing.pack_ranks(mini, world_size, budget, 8, share=True)
        assert len({len(r) for r in ranks}) == 1
        assert sorted(s.index for r in ranks for mb in r for s in mb if s.valid) == sorted(s.index for s in mini)
        rows = [[packing.collate(mb, share=True)["input_ids"].shape[1] for mb in r] for r in ranks]
        assert all(n <= budget for r in rows for n in r)
        loads = [sum(r) for r in rows]
        assert max(loads) - min(loads) <= max(map(packing.length, mini)) + max(len(s.prompt_ids) for s in mini), loads
        unshared = [sum(packing.collate(mb)["input_ids"].shape[1] for mb in r)
                    for r in packing.pack_ranks(mini, world_size, budget)]
        assert max(loads) < max(unshared)  # the slowest rank, which every rank waits for
        if budget == 4096:  # room for whole groups: none is cut more than once
            assert all(len({i for i, mb in enumerate(mbs) for s in mb if s.group == g}) <= 2
                       for g in {s.group for s in mini} for mbs in [[mb for r in ranks for mb in r]])
    per_rank = [packing.micro_batches(samples, cfg, world_size, rank) for rank in range(world_size)]
    for j, mini in enumerate(packing.mini_batches(samples, 3, 8)):
        assert {(p[j][1], p[j][2]) for p in per_rank} == {(sum(s.policy_tokens for s in mini), 32)}
        assert sum(b["mask"].sum().item() for p in per_rank for b in p[j][0]) == per_rank[0][j][1]


def test_shared_prefix_is_off_where_the_attention_builds_its_own_mask():
    assert packing.shares_prompts(Config()) and not packing.shares_prompts(Config(shared_prefix=False))
    assert not packing.shares_prompts(Config(attn_implementation="sdpa"))
    assert packing.unshared_reason(Config()) is None
    assert packing.unshared_reason(Config(attn_implementation="eager")) == (
        "shared_prefix: off: attn_implementation='eager' builds its own mask over a row, which would cut each "
        "sample from its prompt (packed_sdpa shares it)")


def test_one_group_on_eight_ranks_keeps_every_rank_busy():
    """One group of 8 long samples over 8 ranks: each rank gets a sample (the group cut where
    it would take a rank past the mean), not the rest of the group on one rank and padding on
    five; shared rows never pack worse than the unshared assignment (micro-batches, then the
    slowest rank)."""
    s = groups(1, 8, seed=11, prompt=(19, 19), completion=(364, 1740), env_turns=False)
    ranks = packing.pack_ranks(s, 8, 8795, 8, share=True)
    assert all(any(x.valid for mb in r for x in mb) for r in ranks)
    unshared = packing.pack_ranks(s, 8, 8795, 8)
    slowest = [max(sum(packing.collate(mb, share)["input_ids"].shape[1] for mb in r) for r in p)
               for p, share in ((ranks, True), (unshared, False))]
    assert (len(ranks[0]), slowest[0]) <= (len(unshared[0]), slowest[1])


def test_decoding_against_a_kv_cache_goes_to_sdpa(models):
    """generate() under packed_sdpa: a decoding step's one query against the cache's keys is not a
    packed row; the tokens are those of transformers' sdpa."""
    model = models["llama"]
    ids = torch.tensor([[3, 4, 5]])
    out = {}
    for impl in ("packed_sdpa", "sdpa"):
        model.config._attn_implementation = impl
        out[impl] = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(out["packed_sdpa"], out["sdpa"])


def restarted(seed=3):
    """One sample of two sequences (an agent's call that did not continue its episode: a new prompt,
    mask 0, where positions restart), and the two sequences as samples of their own."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randint(3, 63) for _ in range(n)]  # noqa: E731
    p1, t1, p2, t2 = ids(6), ids(7), ids(5), ids(8)
    lp1, lp2 = [-rng.random() for _ in t1], [-rng.random() for _ in t2]
    both = Sample(prompt_ids=p1, token_ids=t1 + p2 + t2, logprobs=lp1 + [0.0] * 5 + lp2,
                  mask=[1] * 7 + [0] * 5 + [1] * 8, adv=0.7, restarts=(7,))
    return both, [Sample(prompt_ids=p1, token_ids=t1, logprobs=lp1, adv=0.7),
                  Sample(prompt_ids=p2, token_ids=t2, logprobs=lp2, adv=0.7)]


@pytest.mark.parametrize("attn", ["packed_sdpa", "sdpa"])
def test_a_sample_of_two_sequences_is_its_sequences_apart(models, attn):
    """Positions restart at 0 where the second sequence starts, and it attends to nothing before
    it: per-token logp, entropy and gradients equal those of the two sequences packed as samples
    of their own, next to a group that shares its prompt (the sample itself never shares)."""
    both, apart = restarted()
    group = groups(1, 3, seed=4)
    mates = [replace(s, prompt_ids=both.prompt_ids) for s in group]  # its prompt: it still must not share
    model = models["qwen2"]
    model.config._attn_implementation = attn
    shared = attn == "packed_sdpa"  # transformers' sdpa cuts the row by positions: sequences, never shared prompts
    got, want = [sharing_results(model, rows)[0 if shared else 1] for rows in (mates + [both], mates + apart)]
    model.config._attn_implementation = "sdpa"
    b = packing.collate(mates + [both], share=True)
    assert b["position_ids"][0, -26:].tolist() == list(range(13)) * 2  # 6 + 7 tokens, then 5 + 8 from 0 again
    assert packing.units(mates + [both], 4, share=True) == [mates, [both]]
    for k, v in want.items():
        if k not in ("tokens", "head_ids"):
            assert torch.allclose(got[k], v, atol=1e-5, rtol=0), k
    with pytest.raises(ValueError, match="packs only"):
        packing.collate_padded([both], 0)


def test_the_row_length_estimate_is_the_collated_row_with_a_restarted_sample():
    """packing.row_length (what pack_ranks compares its two assignments by) counts a sample of
    several sequences (an agent's restarted call) with its own prompt, as collate lays it out
    under --shared_prefix: it never shares its prompt, nor does the sample before it."""
    both, _ = restarted()
    mates = [replace(s, prompt_ids=both.prompt_ids) for s in groups(1, 3, seed=4)]
    for row in (mates + [both], [mates[0], both, mates[1], mates[2]], [both] + mates):
        assert packing.row_length(row) == packing.collate(row, share=True)["input_ids"].shape[1]
    batch = mates + [both] + [replace(s, restarts=()) for s in [both] * 4]  # two groups of 4, one sample restarted
    for rank in packing.pack_ranks(batch, 2, 4096, group_size=4, share=True):
        for mb in rank:
            assert packing.row_length(mb) == packing.collate(mb, share=True)["input_ids"].shape[1]
