"""Sequence parallelism (sequence_parallel.py): the pieces of a packed row, the Ulysses attention
on 2 gloo ranks against sdpa on the whole row, training on 2 and 4 ranks against one process,
and the sizes that must divide (the Config's other refusals: tests/test_config.py)."""

import pytest
import torch

from episodes import Sample
from helpers import run_worker


def rollouts(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, c = torch.randint(2, 7, (1,), generator=g).item(), torch.randint(1, 13, (1,), generator=g).item()
        mask = [1] * c if c < 4 else [1] * (c // 2) + [0, 0] + [1] * (c - c // 2 - 2)  # a tool's answer inside
        out.append(Sample(prompt_ids=torch.randint(3, 64, (p,), generator=g).tolist(),
                          token_ids=torch.randint(3, 64, (c,), generator=g).tolist(),
                          logprobs=[-4 * torch.rand(1, generator=g).item() * m for m in mask], mask=mask,
                          adv=float(i), valid=i != 2))
    return out


@pytest.mark.parametrize("size", [2, 3, 4])
def test_pieces_cover_the_row_once(size):
    """Laid end to end, the pieces are the row padded to a multiple of size by a tail that is its
    own sequence; each completion token's target, mask and per-token values sit in exactly one
    piece, in the row's order (position j predicts token j+1, across a piece's end too)."""
    from packing import collate
    from sequence_parallel import piece

    b = collate(rollouts())
    L = b["input_ids"].shape[1]
    pieces = [piece(b, r, size) for r in range(size)]
    length = sum(p["input_ids"].shape[1] for p in pieces)
    assert length % size == 0 and L <= length < L + size
    assert all(p["input_ids"].shape[1] == length // size for p in pieces)
    assert torch.equal(torch.cat([p["input_ids"] for p in pieces], 1)[:, :L], b["input_ids"])
    positions = torch.cat([p["position_ids"] for p in pieces], 1)
    assert torch.equal(positions[0, L:], torch.arange(length - L))  # the tail restarts at 0: its own sequence
    assert all(torch.equal(p["row_position_ids"], positions) for p in pieces)
    targets = torch.cat([p["targets"][p["mask"]] for p in pieces])
    assert torch.equal(targets, b["input_ids"][:, 1:][b["mask"]])
    for k in ("vllm_logp", "adv", "fresh", "seq_ids"):
        assert torch.equal(torch.cat([p[k] for p in pieces]), b[k]), k
        assert all(len(p[k]) == int(p["mask"].sum()) for p in pieces)


@pytest.mark.subprocess
def test_attention_on_two_ranks_matches_sdpa_on_the_whole_row(tiny_model_dir, tmp_path):
    """ulysses_attention on 2 ranks, each with half of a row of 3 packed sequences (one straddles
    the halves), against packed_sdpa on the whole row in one process: the output and the
    gradients of q, k and v of a loss over the output, with 4 query heads and 1 KV head
    (repeated to 2), 2 (split) and 4."""
    results = run_worker("attention", tiny_model_dir, tmp_path / "att.pt", 2, 29721, "sequence_parallel_size=2")
    assert sorted(results) == [1, 2, 4]
    for kv_heads, r in results.items():
        for name, expected, got in zip(("out", "dq", "dk", "dv"), r["expected"], r["got"]):
            assert expected.shape == got.shape and expected.abs().max() > 0.1, (kv_heads, name)
            assert torch.allclose(expected, got, atol=1e-6, rtol=0), (kv_heads, name)


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tmp_path_factory):
    """one_process(LOSS_FN, KL_ESTIMATOR): the single-process twin's 3 steps, memoised."""
    tmp, cache = tmp_path_factory.mktemp("sp"), {}

    def get(*loss):
        if loss not in cache:
            cache[loss] = run_worker("train", tiny_model_dir, tmp / f"{len(cache)}.pt", 1, 0, *loss)
        return cache[loss]
    return get


TWINS = [  # (ranks, loss and KL, Config overrides besides sequence_parallel_size=2)
    (2, ("dapo", "k3"), ()),
    (4, ("dapo", "k3"), ()),  # 2 data-parallel groups of 2
    (4, ("dapo", "k3"), ("fsdp_shard_size=2",)),  # HSDP: each group of 2 is also a shard group, 2 replicas
    (2, ("ess", "topk"), ("activation_checkpointing=true",)),  # ESS over pieces, top-k heads, recompute in backward
]


@pytest.mark.subprocess
@pytest.mark.parametrize("nproc,loss,extra", TWINS, ids=["sp-2", "dp-2-x-sp-2", "hybrid-2x2-sp-2",
                                                         "sp-2-ess-topk4-ac"])
def test_matches_one_process_after_three_steps(one_process, tiny_model_dir, tmp_path, nproc, loss, extra):
    """3 GRPO steps (6 optimizer steps, beta 0.1, EMA each step; dist_worker.py) with
    sequence_parallel_size=2 against one process: on 2 ranks (one group); on 4 (2 data-parallel
    groups of 2, FSDP over all 4, or hybrid: sharded in each group, replicated across); and
    with ESS, the top-4 KL and activation checkpointing (the all-to-alls run again in the
    recompute). Losses, KL, clip fraction, ESS, gradient norms (mean and max: a token counted
    twice or a missing gradient path shows there) and the trained tokens to 1e-5. Weights:
    the gradients agree to float32 rounding (gradient norm to 1e-7 relative after the first
    step), but another summation order (half rows, another attention kernel for the repeated
    KV head) moves a few weights whose gradient is near AdamW's eps by up to 2.2e-5 (DAPO) and
    2.8e-5 (ESS) after 6 steps (2 of 32,768 in one matrix for DAPO); the plain 2-rank twin
    stays under 2.2e-6. So 5e-5, as the filtered-batch twin in test_distributed.py uses for
    the same reason."""
    one = one_process(*loss)
    sp = run_worker("train", tiny_model_dir, tmp_path / "sp.pt", nproc, 29722 + TWINS.index((nproc, loss, extra)), *loss,
             "sequence_parallel_size=2", *extra)
    assert sp["mesh"]["shape"] == ((2, 2) if extra == ("fsdp_shard_size=2",) else (nproc,))
    assert torch.allclose(torch.tensor(one["losses"]), torch.tensor(sp["losses"]), rtol=1e-5, atol=1e-6)
    for name in ("policy", "ref"):
        assert one[name].keys() == sp[name].keys()
        for k in one[name]:
            assert torch.allclose(one[name][k], sp[name][k], atol=5e-5, rtol=0), (name, k)


def test_world_and_heads_must_divide():
    from types import SimpleNamespace

    from config import Config
    from packing import batch_plan
    from infra.parallel import mesh_shape
    from sequence_parallel import check_heads

    cfg = Config(sequence_parallel_size=2, fsdp_shard_size=2)
    assert mesh_shape(cfg, 4) == (2, 2) and batch_plan(cfg, 4)["per_rank"] == 64  # 2 data ranks share 128 sequences
    with pytest.raises(ValueError, match="does not divide the world of 3"):
        mesh_shape(Config(sequence_parallel_size=2), 3)
    check_heads(SimpleNamespace(num_attention_heads=14), 2)
    with pytest.raises(ValueError, match="must divide the model's 14 attention heads"):
        check_heads(SimpleNamespace(num_attention_heads=14), 4)
