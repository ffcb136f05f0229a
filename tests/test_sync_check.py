"""The sync check's tolerance follows the dtypes trainer and server compute in (update.sync_tolerance):
1e-2 when both compute in float32 (a CPU run), 0.07 with bfloat16 on either side, an explicit
vllm_logp_tolerance over both. Against the published bf16 figures (TRL issue 5312: a healthy mean
gap of ~0.015, 0.201 with stale weights), a healthy bf16 step passes and a stale one stops the run."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from config import Config
from infra.faults import SyncError
from update import StepMetrics, sync_tolerance


def test_the_tolerance_follows_the_dtypes_and_an_explicit_one_wins(monkeypatch):
    cfg = Config()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU: trainer in float32, server "auto"
    assert sync_tolerance(cfg) == 1e-2  # the demo's, as before
    assert sync_tolerance(dataclasses.replace(cfg, vllm_dtype="float32")) == 1e-2
    assert sync_tolerance(dataclasses.replace(cfg, vllm_dtype="bfloat16")) == 0.07
    assert sync_tolerance(dataclasses.replace(cfg, vllm_dtype="bfloat16", vllm_logp_tolerance=0.5)) == 0.5
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # GPUs: the trainer computes in bfloat16
    assert sync_tolerance(cfg) == 0.07
    assert sync_tolerance(dataclasses.replace(cfg, vllm_dtype="float32")) == 0.07  # the trainer's side is bf16
    assert sync_tolerance(dataclasses.replace(cfg, vllm_logp_tolerance=1e-3)) == 1e-3


@pytest.fixture
def one_rank(tmp_path):
    """A process group of one (gloo, in this process): check_sync reduces over the ranks."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("vllm_dtype,gap,stops", [
    ("auto", 1e-6, False),  # a float32 CPU run, synced
    ("auto", 0.015, True),  # a bf16-sized gap in a float32 run: another dtype, or a sync that did not take
    ("bfloat16", 0.015, False),  # TRL issue 5312's healthy bf16 mean
    ("bfloat16", 0.041, False),  # Fast-LLM PR 525's RMS without a float32 head (a mean |gap| is at most it)
    ("bfloat16", 0.201, True),  # TRL issue 5312's stale weights
])
def test_a_healthy_bf16_step_passes_and_stale_weights_stop_the_run(one_rank, monkeypatch, vllm_dtype, gap, stops):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = Config(vllm_dtype=vllm_dtype)
    metrics = StepMetrics(torch.device("cpu"))
    metrics.add_vllm_diff(torch.full((100,), gap))
    if stops:
        with pytest.raises(SyncError, match=rf"differ by {gap:.3g} on average \(> vllm_logp_tolerance="
                                            rf"{sync_tolerance(cfg):g}\)"):
            metrics.check_sync(cfg)
    else:
        metrics.check_sync(cfg)
    assert metrics.vllm_logp_diff_mean == pytest.approx(gap)
