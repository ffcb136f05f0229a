"""FSDP2 on 2 gloo ranks (and HSDP on 4) against its single-process twin, activation
checkpointing and offloading against plain runs, and the shard-local EMA."""

import os

import pytest
import torch
from helpers import run_worker

pytestmark = pytest.mark.subprocess  # every test here starts processes (ranks, workers)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def train_run(tiny_model_dir, tmp_path_factory):
    """train_run(nproc, *args): 3 GRPO steps, memoised so that twins share one run.
    args are LOSS_FN KL_ESTIMATOR and key=value Config overrides (see dist_worker.py)."""
    tmp, cache = tmp_path_factory.mktemp("fsdp"), {}

    def get(nproc, *args):
        key = (nproc, *args)
        if key not in cache:
            cache[key] = run_worker("train", tiny_model_dir, tmp / f"{len(cache)}.pt", nproc, 29650 + len(cache), *args)
        return cache[key]
    return get


TWINS = [  # (ranks, loss and KL, Config overrides), each against one process with the same loss and KL
    (2, ("dapo", "k3"), ()),
    (2, ("ess", "topk"), ()),
    (4, ("dapo", "k3"), ("fsdp_shard_size=2",)),  # HSDP: shard over 2 ranks, 2 replicas
    (2, ("dapo", "k3"), ("reshard_after_forward=false", "activation_checkpointing=true")),
    (1, ("dapo", "k3"), ("offload_params=true", "offload_ref_policy=true")),  # CPU to CPU here: the code path only
]


@pytest.mark.parametrize("nproc,loss,extra", TWINS, ids=["2-ranks-dapo-k3", "2-ranks-ess-topk4", "hybrid-2x2",
                                                         "2-ranks-no-reshard-ac", "offload-1-process"])
def test_matches_one_process_after_three_steps(train_run, nproc, loss, extra):
    """Same seed and rollouts (16 uneven sequences, 2 mini-batches -> 6 optimizer steps,
    beta 0.1, EMA each step), for DAPO with k3 and for ESS with the top-4 KL. The ranks
    split every mini-batch differently from the single process, so sums run in another
    order: tolerance 1e-5 on losses (and ESS) and 2e-5 on parameters (AdamW with lr 1e-3
    turns float32 rounding in tiny gradients into at most that much). The loss is scaled
    by the world size to undo FSDP's mean; under HSDP the mean runs over the shard group
    (reduce-scatter) and then the replicas (all-reduce), so the same factor must hold.
    AdamW is blind to a constant gradient scale: a wrong factor shows in grad_norm (column
    3 of losses), which is compared too (halving it on the 2 x 2 mesh failed only there)."""
    one, other = train_run(1, *loss), train_run(nproc, *loss, *extra)
    if "fsdp_shard_size=2" in extra:  # really a 2-D mesh: replicated across its first dimension
        assert other["mesh"]["shape"] == (2, 2) and other["mesh"]["placements"] == ["R", "S(0)"]
    assert torch.allclose(torch.tensor(one["losses"]), torch.tensor(other["losses"]), rtol=1e-5, atol=1e-6)
    for name in ("policy", "ref"):
        assert one[name].keys() == other[name].keys()
        for k in one[name]:
            assert torch.allclose(one[name][k], other[name][k], atol=2e-5, rtol=0), (name, k)


@pytest.mark.parametrize("loss,extra", [(("dapo", "k3"), ()), (("ess", "topk"), ()), (("dapo", "k3"), ("lora_rank=4",))],
                         ids=["dapo-k3", "ess-topk4", "lora"])
def test_shared_prompts_on_two_ranks_match_the_unshared_single_process(train_run, loss, extra):
    """The 3 steps above (groups of 4 after one prompt, multi-turn masks, the EMA reference) with
    each group's prompt forwarded once (shared_prefix, the default) on 2 ranks, against one
    process forwarding every sample whole: losses, KL, ESS, gradient norms and trained tokens to
    1e-5, the policy and reference to 2e-5, with DAPO and k3, ESS and the top-4 KL, and LoRA.
    The shared rows are shorter, so sharing took effect."""
    one, two = train_run(1, *loss, "shared_prefix=false", *extra), train_run(2, *loss, *extra)
    assert sum(two["row_tokens"]) < sum(one["row_tokens"])
    assert torch.allclose(torch.tensor(one["losses"]), torch.tensor(two["losses"]), rtol=1e-5, atol=1e-6)
    for name in ("policy", "ref"):
        assert one[name].keys() == two[name].keys()
        for k in one[name]:
            assert torch.allclose(one[name][k], two[name][k], atol=2e-5, rtol=0), (name, k)


def test_lora_on_two_ranks_matches_one_process_and_leaves_the_base_bit_identical(train_run, tiny_model_dir):
    """LoRA adapters (rank 4 on every linear layer) and the EMA reference adapter: the 2-rank twin
    of 3 steps x 2 optimizer steps, as above, also with activation checkpointing; the frozen base weights equal the model's files bit
    for bit after training on both; the adapters moved and the reference adapter followed."""
    from transformers import AutoModelForCausalLM

    one, two = train_run(1, "dapo", "k3", "lora_rank=4"), train_run(2, "dapo", "k3", "lora_rank=4")
    ac = train_run(2, "dapo", "k3", "lora_rank=4", "activation_checkpointing=true", "reshard_after_forward=false")
    for other in (two, ac):  # the adapters inside checkpointed layers recompute the same way
        assert torch.allclose(torch.tensor(one["losses"]), torch.tensor(other["losses"]), rtol=1e-5, atol=1e-6)
        for name in ("policy", "ref"):
            assert one[name].keys() == other[name].keys()
            for k in one[name]:
                assert torch.allclose(one[name][k], other[name][k], atol=2e-5, rtol=0), (name, k)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    frozen = {k: v for k, v in one["policy"].items() if ".lora_" not in k}
    assert len(frozen) == len(base)
    for run_ in (one, two):
        for k in frozen:
            assert torch.equal(run_["policy"][k], base[k.replace(".base_layer", "")]), k
    b = "model.layers.0.mlp.up_proj.lora_B.default.weight"
    assert one["policy"][b].abs().max() > 1e-3  # lora_B starts at 0: the adapter trained
    assert 0 < one["ref"][b].abs().max() < one["policy"][b].abs().max()  # the EMA adapter lags behind it


def test_constant_denominator_counts_the_configured_batch(tiny_model_dir, tmp_path):
    """Dr GRPO's constant denominator c x sequences must count the configured sequences, not
    those the filter left: the same 2 surviving groups weigh half as much in a batch
    configured for 4 groups as in one configured for 2 (on-policy, so the gradient is linear
    in 1/denominator and grad_norm shows it)."""
    common = ("loss_denominator=4", "num_mini_batches=1", "max_grad_norm=0", "groups=0,2")
    four = run_worker("filtered", tiny_model_dir, tmp_path / "four.pt", 1, 0, "num_unique_prompts_rollout=4", *common)
    two = run_worker("filtered", tiny_model_dir, tmp_path / "two.pt", 1, 0, "num_unique_prompts_rollout=2", *common)
    assert four["m"]["trained_tokens"] == two["m"]["trained_tokens"] > 0
    assert four["m"]["grad_norm"] == pytest.approx(two["m"]["grad_norm"] / 2, rel=1e-5)


@pytest.mark.parametrize("nproc", [1, 2])
def test_fewer_groups_than_mini_batches_on_two_ranks(tiny_model_dir, tmp_path, nproc):
    """One group of 2 survives a batch of 4 mini-batches (ESS over the step): three
    mini-batches are empty on every rank (no crash, no update, the schedule still advances)
    and the one that is not trains the same on 2 ranks (one sample each) as in one process."""
    args = ("ess", "k3", "num_samples_per_prompt_rollout=2", "num_unique_prompts_rollout=8", "num_mini_batches=4",
            "groups=3")
    got = run_worker("filtered", tiny_model_dir, tmp_path / f"{nproc}.pt", nproc, 29700 + nproc, *args)
    assert got["scheduler_steps"] == 4 and got["m"]["skipped_updates"] == 0
    one = run_worker("filtered", tiny_model_dir, tmp_path / "one.pt", 1, 0, *args) if nproc == 2 else got
    assert got["m"]["trained_tokens"] == one["m"]["trained_tokens"] > 0
    assert got["m"]["loss"] == pytest.approx(one["m"]["loss"], rel=1e-5, abs=1e-6)
    # One AdamW step from the same gradients up to float32 rounding (one packed row of both
    # samples against one row each): AdamW divides each gradient by its own size, so where one
    # is near eps a rounding difference moves that weight by up to a few 1e-5 (seen: 2.1e-5
    # at 1 element of 32,768, whose step was 2.4e-4 against the usual 1e-3)
    for k in one["policy"]:
        assert torch.allclose(one["policy"][k], got["policy"][k], atol=5e-5, rtol=0), k


def test_training_moved_the_weights(train_run, tiny_model_dir):
    """Guards the test above against proving nothing: the policy moved, the EMA followed."""
    from transformers import AutoModelForCausalLM

    init = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    one = train_run(1, "dapo", "k3")
    k = "model.layers.0.mlp.up_proj.weight"
    moved = (one["policy"][k] - init[k]).abs().max()
    assert moved > 1e-3 and (one["ref"][k] - init[k]).abs().max() > 0.1 * moved
    # grad_norm is the mean over a step's 2 optimizer steps, grad_norm_max their max
    assert all(row[5] >= row[3] for row in one["losses"]) and any(row[5] > row[3] * 1.001 for row in one["losses"])
    assert all(abs(loss[2]) <= 1 for loss in one["losses"])  # clip_frac is a fraction
    assert all(0 < loss[4] <= 1 for loss in train_run(1, "ess", "topk")["losses"])  # ESS in (0, 1]


def test_activation_checkpointing_same_loss_and_gradients(tiny_model_dir, tmp_path):
    """One micro-batch through sequence_logprobs (chunked, checkpointed LM head) and the
    loss, with and without per-layer checkpointing: the recompute gives the same loss and
    gradients, and autograd kept far fewer bytes outside the checkpointed layers."""
    plain = run_worker("grads", tiny_model_dir, tmp_path / "plain.pt", 1, 0)
    ac = run_worker("grads", tiny_model_dir, tmp_path / "ac.pt", 1, 0, "activation_checkpointing=true")
    assert ac["loss"] == pytest.approx(plain["loss"], abs=1e-7)
    assert plain["grads"].keys() == ac["grads"].keys()
    for k, g in plain["grads"].items():
        assert g.abs().max() > 0 or "bias" in k, k
        assert torch.allclose(g, ac["grads"][k], atol=1e-7, rtol=0), k
    assert ac["saved_bytes"] < plain["saved_bytes"] / 4, (ac["saved_bytes"], plain["saved_bytes"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CPU offload moves shards off a GPU; there is none here")
def test_offload_on_gpu_matches_and_keeps_shards_on_cpu(tiny_model_dir, tmp_path):
    plain = run_worker("train", tiny_model_dir, tmp_path / "plain.pt", 1, 0)
    off = run_worker("train", tiny_model_dir, tmp_path / "off.pt", 1, 0, "offload_params=true", "offload_ref_policy=true")
    assert plain["mesh"]["shard_device"].startswith("cuda") and off["mesh"]["shard_device"] == "cpu"
    assert torch.allclose(torch.tensor(plain["losses"]), torch.tensor(off["losses"]), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("nproc", [1, 2])
def test_ess_is_the_same_on_two_ranks_and_one_process(tiny_model_dir, tmp_path, nproc):
    from loss import ess_from_sums, ess_sums

    rho = torch.exp(torch.randn(1001, generator=torch.Generator().manual_seed(0)))
    expected = (rho.double().sum() ** 2 / (1001 * (rho.double() ** 2).sum())).item()
    assert ess_from_sums(ess_sums(rho)) == pytest.approx(expected, rel=1e-12)
    assert run_worker("ess", tiny_model_dir, tmp_path / "ess.pt", nproc, 29666)["ess"] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("nproc,extra", [(1, ()), (2, ()), (4, ("fsdp_shard_size=2",)), (2, ("lora_rank=4",))],
                         ids=["1-process", "2-ranks", "hybrid-2x2", "2-ranks-lora-adapters"])
def test_ema_equals_closed_form_without_collectives(tiny_model_dir, tmp_path, nproc, extra):
    r = run_worker("ema", tiny_model_dir, tmp_path / "ema.pt", nproc, 29667, *extra)
    if extra == ("lora_rank=4",):  # the reference adapter followed the trained one, nothing else moved
        assert r["ref0"] and all(".lora_" in k for k in r["ref0"]) and r["ref0"].keys() == r["pol0"].keys()
    assert r["calls"] == [] and r["comm"] == 0, f"the EMA update issued collectives: {r['calls']} {r['comm']}"
    assert r["mesh"]["shape"] == ((2, 2) if "fsdp_shard_size=2" in extra else (nproc,))
    a, K = 0.3, 3
    for k, ref0 in r["ref0"].items():
        pol = r["pol0"][k] + 0.1
        expected = (1 - a) ** K * ref0
        for j in range(1, K + 1):
            pol = 1.1 * pol + 0.01
            expected = expected + a * (1 - a) ** (K - j) * pol
        assert torch.allclose(r["ref_k"][k], expected, atol=1e-6), k


def test_bf16_reference_uses_an_fp32_master_and_does_not_stall():
    """Increments alpha * (policy - ref) far below bf16's resolution at 1.0 (2^-7):
    a bf16 EMA never moves; the fp32 master accumulates them."""
    from reference import EMAReference

    policy = torch.nn.Linear(4, 4, bias=False).to(torch.bfloat16)
    ref = torch.nn.Linear(4, 4, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        policy.weight.fill_(1.0078125)  # 1 + 2^-7, the next bf16 number after 1
        ref.weight.fill_(1.0)
    ema = EMAReference(ref, policy, alpha=0.01)
    assert ema.master is not None
    for _ in range(300):
        ema.update()
    expected = 1 + 2 ** -7 * (1 - 0.99 ** 300)
    assert torch.allclose(ema.master[0], torch.full((4, 4), expected), atol=1e-6)
    assert ref.weight.float().sub(1.0).abs().min() > 0  # the bf16 shards moved off 1.0
    naive = torch.ones(4, 4, dtype=torch.bfloat16)
    for _ in range(300):
        naive.lerp_(policy.weight.detach(), 0.01)
    assert torch.equal(naive, torch.ones(4, 4, dtype=torch.bfloat16))  # without the master: stuck


@pytest.mark.parametrize("nproc", [1, 2])
def test_the_weight_sync_sends_every_weight_a_part_at_a_time(tied_model_dir, tmp_path, nproc):
    """weight_sync.serving_parts on FSDP2 shards with checkpointed layers (2 ranks) and on a plain
    model (1 process, where the tied head is the embedding's storage): its parts are the whole
    untied serving copy, each at most the budget or one tensor; the files written hold exactly that.
    A write failing at its second file stops both ranks with the same error and hangs neither; a
    gather that fails raises its own error."""
    got = run_worker("parts", tied_model_dir, tmp_path / "p.pt", nproc, 29760 + nproc,
                     "activation_checkpointing=true", "backend_timeout=2", "weight_sync_timeout=60")
    whole, parts = got["whole"], got["parts"]
    assert len(parts) >= 3 and "lm_head.weight" in whole
    largest = max(v.numel() * v.element_size() for v in whole.values())
    assert all(sum(v.numel() * v.element_size() for v in p.values()) <= max(got["budget"], largest) for p in parts)
    joined = {k: v for p in parts for k, v in p.items()}
    assert sum(map(len, parts)) == len(joined) and joined.keys() == whole.keys() == got["read"].keys()
    assert all(torch.equal(joined[k], v) and torch.equal(got["read"][k], v) for k, v in whole.items())
    assert got["written"] == sum(v.numel() * v.element_size() for v in whole.values())
    assert got["files"] == [f"model-{i + 1:05d}.safetensors" for i in range(len(parts))] + ["model.safetensors.index.json"]
    errors = [got["error"]] + ([torch.load(tmp_path / "p.pt.1")["error"]] if nproc == 2 else [])
    assert errors == [errors[0]] * nproc and "OSError" in errors[0] and "No space left" in errors[0]
    if nproc == 2:
        assert torch.load(tmp_path / "p.pt.1")["parts"] == []  # rank 1 gathers, rank 0 alone holds the parts
    else:  # a gather that fails raises itself, not as the servers' VLLMError
        assert got["gather_error"] == "RuntimeError: the gather broke"
