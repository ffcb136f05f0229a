"""LoRA against full fine-tuning on SmolLM2-135M-Instruct, side by side in one invocation.

    .venv/bin/python benchmarks/bench_lora.py              # memory and weight sync (a few minutes)
    .venv/bin/python benchmarks/bench_lora.py --train 20   # and the demo's math task, 20 steps each way

1. Memory, in a world of one, the models built as train.py builds them with beta > 0 and the EMA
   reference: trainable parameters, their gradients and AdamW's state after one optimizer step,
   and the reference's bytes (a sharded copy of the model, or the reference adapter).
2. Weight sync, on real vLLM CPU servers: full weights (reload_weights), the LoRA policy as merged
   weights (reload_weights, a server without LoRA) and as an adapter (load_lora_adapter, a server
   with --enable-lora): median seconds over --repeats syncs after one warm-up, bytes written per
   sync, and the max |trainer - vLLM| logprob after the last one.
3. With --train N: `bash scripts/demo.sh` (2 ranks, the vLLM server train.py launches) for N steps,
   once as it is and once with LoRA (--lora_rank 16 --lora_alpha 32 at --lora_learning_rate): the
   step's time split (means over steps 2..N), peak memory of rank 0, and held-out greedy accuracy.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # parts 1-2: rank 0's work is single-threaded in training too

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # helpers: the plain logprobs of the check
from lora import sync as lora_sync  # noqa: E402
import train  # noqa: E402
from infra import vllm_client  # noqa: E402
from infra import vllm_server  # noqa: E402
from infra import weight_sync  # noqa: E402
from config import Config  # noqa: E402
from infra.generator import make_sync  # noqa: E402
from helpers import logprob_diff, prompt_logprobs, trainer_logprobs  # noqa: E402
from reference import local, make_reference  # noqa: E402

MODEL = os.path.join(ROOT, "models", "smollm2-135m-instruct")
LORA = dict(lora_rank=16, lora_alpha=32.0)


def nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def memory(cfg, device, mesh):
    """Trainable parameters, gradient, AdamW state and reference bytes of one run's models."""
    policy = train.load_model(cfg, device, mesh, convert=train.model_doors(cfg)[1])  # LoRA's adapters
    ref = make_reference(cfg, policy, lambda: train.load_model(cfg, device, mesh, reference=True))
    optimizer, _ = train.make_optimizer(cfg, policy, 10, device)
    ids = torch.arange(1, 65)[None]
    logp = policy.sequence_logprobs(ids, torch.ones(1, 63, dtype=torch.bool), 1.0, position_ids=torch.arange(64)[None])
    logp[0].mean().backward()
    optimizer.step()
    trained = [p for p in policy.parameters() if p.requires_grad]
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    row = dict(params=sum(p.numel() for p in trained), grads=nbytes([local(p.grad) for p in trained]),
               adam=nbytes(state), ref=nbytes([local(p) for p in ref.ref_params]) + nbytes(ref.master or []))
    return row, policy


@torch.no_grad()
def perturb(params, seed):
    """Move the trained weights a little, so each sync carries new values the check can see."""
    g = torch.Generator().manual_seed(seed)
    for p in params:
        t = local(p)
        t.add_(0.05 * (t.abs().mean() + 1e-3) * torch.randn(t.shape, generator=g))


def time_syncs(name, sync, policy, client, repeats):
    """Median seconds of a sync, its bytes, and the max |trainer - vLLM| logprob after the last one."""
    seqs = [list(range(100, 140)), list(range(2000, 2030))]
    trained = [p for p in policy.parameters() if p.requires_grad]
    times = []
    for i in range(repeats + 1):
        perturb(trained, i)
        t = time.perf_counter()
        sent = sync.sync(policy)
        times.append(time.perf_counter() - t)
        print(f"[{name}] sync {i}: {times[-1]:.3f}s, {sent / 1e6:.1f} MB", flush=True)
    # one sequence a request: vLLM 0.32's LoRA path fails prompt_logprobs for two requests in one engine
    # step (punica_cpu's add_lora_logits indexes by request, not by prompt token; vllm#29955, #17766)
    served = [prompt_logprobs(client, [seq])[0] for seq in seqs]
    diff = logprob_diff(trainer_logprobs(policy, seqs), served)[1]
    return dict(seconds=statistics.median(times[1:]), bytes=sent, diff=diff)


def serve(cfg, workdir, port, full, hf_config):
    """A vLLM CPU server on the base model, launched with cfg's flags (LoRA enabled or not)."""
    from transformers import AutoTokenizer

    serving = os.path.join(workdir, f"serving_{port}")
    weight_sync.write_serving_dir(full, hf_config, AutoTokenizer.from_pretrained(MODEL), serving)
    log = os.path.join(workdir, f"vllm_{port}.log")
    proc, url = vllm_server.launch_server(serving, cfg, log, port=port, extra_args=lora_sync.server_flags(cfg))
    return vllm_client.VLLMClient([url], serving, timeout=600, max_retries=0, proc=proc, log_path=log)


def memory_and_sync(repeats, port, logs):
    common = dict(model_name_or_path=MODEL, beta=0.01, ref_policy_update_freq=1, max_prompt_length=64,
                  response_length=64, seed=1)
    cfgs = {"full": Config(**common), "lora merged": Config(**common, **LORA, lora_weight_sync="merged"),
            "lora adapter": Config(**common, **LORA)}
    _, _, device, mesh = train.setup_distributed(cfgs["full"])
    rows, policies = {}, {}
    for name in ("full", "lora adapter"):
        torch.manual_seed(1)
        rows[name], policies[name] = memory(cfgs[name], device, mesh)
    rows["lora merged"], policies["lora merged"] = dict(rows["lora adapter"]), policies["lora adapter"]
    with tempfile.TemporaryDirectory(prefix="bench_lora_") as workdir:
        # both servers start from the model's own weights: the LoRA policy's frozen base (the full
        # policy took an AdamW step above; its syncs replace every weight anyway)
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).state_dict()
        config = policies["full"].config
        plain = serve(cfgs["full"], workdir, port, base, config)
        with_lora = serve(cfgs["lora adapter"], workdir, port + 1, base, config)
        try:
            for name, client in (("full", plain), ("lora merged", plain), ("lora adapter", with_lora)):
                sync = make_sync(cfgs[name], client, 0, device)  # as the trainer makes it
                rows[name].update(time_syncs(name, sync, policies[name], client, repeats))
                sync.close()
        finally:
            vllm_server.stop_server(plain.proc)
            vllm_server.stop_server(with_lora.proc)
            for client in (plain, with_lora):
                shutil.copy(client.log_path, os.path.join(logs, os.path.basename(client.log_path)))
    print("\n| run | trainable params | their gradients | AdamW state | reference | sync s | bytes per sync "
          "| max logprob diff after sync |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['params'] / 1e6:.2f} M | {r['grads'] / 1e6:.1f} MB | {r['adam'] / 1e6:.1f} MB "
              f"| {r['ref'] / 1e6:.1f} MB | {r['seconds']:.3f} | {r['bytes'] / 1e6:.1f} MB | {r['diff']:.1e} |",
              flush=True)


def demo(steps, out, extra):
    """One `bash scripts/demo.sh` run; its per-step metrics."""
    cmd = ["bash", os.path.join(ROOT, "scripts", "demo.sh"), "--num_training_steps", str(steps),
           "--eval_freq", str(steps), *extra]
    print(f"$ OUT={out}", " ".join(cmd), flush=True)
    t = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # demo.sh sets the ranks' own
    subprocess.run(cmd, cwd=ROOT, check=True, env=dict(env, OUT=out))
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return rows, time.perf_counter() - t


def training(steps, lr):
    results = {}
    for name, extra in (("full", []), ("lora", ["--lora_rank", "16", "--lora_alpha", "32", "--learning_rate", lr])):
        rows, seconds = demo(steps, os.path.join(ROOT, "output", f"bench_lora_{name}"), extra)
        timed = [r for r in rows if "time_train" in r and r["step"] >= 2]
        evals = [r for r in rows if "eval_accuracy" in r]
        mean = lambda k: statistics.mean(r[k] for r in timed)  # noqa: E731
        results[name] = dict(generate=mean("time_generate"), train=mean("time_train"), sync=mean("time_sync"),
                             step=mean("time_step"), peak=max(r["peak_memory_gb"] for r in timed),
                             before=evals[0]["eval_accuracy"], after=evals[-1]["eval_accuracy"], wall=seconds)
    print(f"\n| run | generate s | train s | sync s | step s | peak memory rank 0 | held-out accuracy step 0 -> "
          f"{steps} | wall |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['generate']:.1f} | {r['train']:.1f} | {r['sync']:.2f} | {r['step']:.1f} "
              f"| {r['peak']:.2f} GB | {r['before']:.3f} -> {r['after']:.3f} | {r['wall'] / 60:.1f} min |", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="timed syncs of each kind, after one warm-up")
    p.add_argument("--port", type=int, default=8071, help="the plain server's port; the LoRA server's is port + 1")
    p.add_argument("--logs", default=os.path.join(ROOT, "output", "bench_lora"), help="where the servers' logs go")
    p.add_argument("--train", type=int, default=0, help="also run the demo for this many steps, full and LoRA")
    p.add_argument("--lora_learning_rate", default="5e-5", help="LoRA's learning rate in --train (the demo's is 5e-6)")
    args = p.parse_args()
    if not os.path.isdir(MODEL):
        p.error(f"{MODEL} is missing: run .venv/bin/python scripts/prepare_smollm2.py first")
    os.makedirs(args.logs, exist_ok=True)
    memory_and_sync(args.repeats, args.port, args.logs)
    train.close_distributed()  # the models are gone: the demo's ranks get the memory
    if args.train:
        training(args.train, args.lora_learning_rate)


if __name__ == "__main__":
    main()
