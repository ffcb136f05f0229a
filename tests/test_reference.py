"""When the EMA reference's fp32 master copy runs: never with the parameters train.py loads (stored
in float32; bf16 is FSDP2's compute dtype only), and on the real sharded tiny model once its
parameters are stored in bf16. The world of one is a process of its own (this file, run as a
script), so that no process group is left in the test process."""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.subprocess  # every test here starts processes (ranks, workers)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALPHA, K, DELTA = 0.01, 200, 1e-3  # EMA weight, updates, policy - reference offset


def test_fp32_master_is_dormant_for_fp32_parameters_and_runs_for_bf16_ones(tiny_model_dir, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    out = tmp_path / "ema.pt"
    p = subprocess.run([sys.executable, os.path.abspath(__file__), tiny_model_dir, str(out)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    r = torch.load(out)
    assert r["shipped_dtypes"] == {torch.float32} and not r["shipped_master"]  # what train.py builds: no master
    assert r["bf16_dtypes"] == {torch.bfloat16} and r["bf16_master"]
    # a fixed policy at ref0 + DELTA: after K lerps the reference is at ref0 + DELTA (1 - (1 - alpha)^K)
    moved = DELTA * (1 - (1 - ALPHA) ** K)
    for name, ref0 in r["ref0"].items():
        assert torch.allclose(r["master"][name], ref0 + moved, atol=1e-6, rtol=0), name
        assert torch.equal(r["ref"][name], r["master"][name].to(torch.bfloat16)), name  # the shards follow it
    # without the master, the same lerps on the bf16 shards round most increments away
    naive = torch.cat([(r["naive"][n].float() - r["ref0"][n]).flatten() for n in r["ref0"]]).abs().mean()
    kept = torch.cat([(r["ref"][n].float() - r["ref0"][n]).flatten() for n in r["ref0"]]).abs().mean()
    print(f"mean |ref_K - ref_0|: exact {moved:.3e}, fp32 master then bf16 {kept:.3e}, bf16 lerp {naive:.3e}")
    assert naive < 0.5 * moved and abs(kept - moved) < 0.5 * moved


def worker(model_dir, out):
    import train
    from config import Config
    from reference import EMAReference, local
    from infra.weight_sync import full_state_dict

    cfg = Config(model_name_or_path=model_dir, beta=0.1, alpha=ALPHA, ref_policy_update_freq=1)
    _, _, device, mesh = train.setup_distributed(cfg)
    policy = train.load_model(cfg, device, mesh)
    shipped = EMAReference(train.load_model(cfg, device, mesh, reference=True), policy, ALPHA)
    # Parameters stored in bf16 (a fork loading the model in bf16 to halve its memory), sharded the same way
    ref = EMAReference(train.load_model(cfg, device, mesh, reference=True).to(torch.bfloat16), policy, ALPHA)
    naive = train.load_model(cfg, device, mesh, reference=True).to(torch.bfloat16)
    ref0 = {k: v.float().clone() for k, v in full_state_dict(ref.model).items()}
    with torch.no_grad():
        for p, r in zip(policy.parameters(), ref.model.parameters()):
            local(p).copy_(local(r).float() + DELTA)  # the policy sits DELTA above the bf16 reference
        for _ in range(K):
            ref.update()
            torch._foreach_lerp_([local(t) for t in naive.parameters()],
                                 [local(p).to(torch.bfloat16) for p in policy.parameters()], ALPHA)
    names = [n for n, _ in ref.model.named_parameters()]
    torch.save(dict(shipped_dtypes={local(t).dtype for t in shipped.model.parameters()},
                    shipped_master=shipped.master is not None, bf16_master=ref.master is not None,
                    bf16_dtypes={local(t).dtype for t in ref.model.parameters()},
                    ref0=ref0, ref={k: v.clone() for k, v in full_state_dict(ref.model).items()},
                    naive={k: v.clone() for k, v in full_state_dict(naive).items()},
                    master={n: m.clone() for n, m in zip(names, ref.master)}), out)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    worker(*sys.argv[1:3])
    from infra.parallel import close_distributed

    close_distributed()
