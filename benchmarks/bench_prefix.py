"""Shared against unshared prompts in training: one rollout batch's micro-batches, old and
reference logprobs, forward + backward, side by side in one process, with peak memory and exactness.

    .venv/bin/python benchmarks/bench_prefix.py                                # SmolLM2-135M-Instruct, math and tools
    .venv/bin/python benchmarks/bench_prefix.py --random smollm2 --repeats 1   # SmolLM2's shape, random weights
    .venv/bin/python benchmarks/bench_prefix.py --random path/config.json      # any config.json, random weights
    .venv/bin/python benchmarks/bench_prefix.py --random smollm2 --shapes 4x8:2000:200   # an agent-like batch
    python3 benchmarks/bench_prefix.py --random smollm2 --device cuda          # a GPU machine: torch and transformers,
                                                                               # no model files, no vLLM

Batches (--shapes; random token ids in the vocabulary, lengths from a seeded generator):
- math: the math demo's, 4 prompts x 8 samples, prompts of 58-64 tokens, completions of 65-90;
- tools: the tools demo's, 4 prompts x 8 samples, prompts of 150-160 tokens, episodes of 96
  tokens after the prompt: a policy turn of 15-40 tokens, a 13-token tool answer (mask 0: context,
  out of the loss) and the policy's final turn;
- PxG:PROMPT:NEW, e.g. 4x8:2000:200 or 2x16:1500-2000:100-300: P prompts x G samples, prompt
  and completion lengths (N or LO-HI).

The model: models/smollm2-135m-instruct when it is there, else (or with --random NAME) random
weights of a shape: smollm2 (SmolLM2-135M's config: Llama, hidden 576, 30 layers, 9 heads, 3 KV
heads, MLP 1536, vocabulary 49,152, tied embeddings), a make_tiny_model.SHAPES name (tiny, 24m,
0.5b, 1.5b) or a config.json, saved to a temporary directory. Both the policy and the reference
are built as train.py builds them, by parallel.load_model in a world of one: FSDP2 (gloo on
CPU, nccl on a GPU), float32 weights; on a GPU the trainer's MixedPrecisionPolicy (bf16
compute, float32 gradient reduction), so the GPU figures are bf16 ones. Attention is packed_sdpa.

What one pass times, per variant (shared: packing.collate(share=True); unshared: share=False),
over the whole batch as one mini-batch (world size 1):
- pack:  packing.pack_ranks under --max-tokens (max_tokens_per_micro_batch) and collate;
- old:   the policy's logprobs before the update, no grad (update.frozen_logprobs);
- ref:   the reference's logprobs, no grad;
- train: forward + backward of each micro-batch, loss.grpo_loss (dapo, k3 KL at beta 0.04).
As train.py runs them: old and ref micro-batch by micro-batch, then forward + backward; no
optimizer step (gradients are set to None between passes). train.py skips `old` with one
mini-batch and one epoch, and `ref` without a KL term; they are timed here as they run otherwise.
The variants alternate (A B B A ...): one warm-up pass each, then --repeats passes, medians.

Peak memory, of the warm-up pass: on CPU LiveBytes below (the bytes of tensor storage alive at
the peak, as torch's MemTracker counts them: both models' weights, gradients, activations,
temporaries; MemTracker itself refuses a module called again per micro-batch); on a GPU
torch.cuda.max_memory_allocated after a reset. "above weights" subtracts both models' weights.

Exactness: the first shared micro-batch's samples collated both ways, one forward + backward
each: the max abs difference of per-token logprobs and entropies, of the LM head's gradient
(the embedding's, when tied) and of the middle decoder layer's, the latter also relative to
the gradient's largest entry. Float32 on CPU; bf16 compute on a GPU (larger, and reported too).

The default run (SmolLM2, math and tools, 3 repeats) takes about 10 minutes on 2 CPU cores; the
timed passes run at torch's default thread count (printed).
"""

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import weakref

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
from episodes import Sample  # noqa: E402

REAL = os.path.join(ROOT, "models", "smollm2-135m-instruct")
# models/smollm2-135m-instruct/config.json's shape
SMOLLM2 = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=576, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536, vocab_size=49152,
               tie_word_embeddings=True, hidden_act="silu", rms_norm_eps=1e-5, max_position_embeddings=8192,
               rope_parameters=dict(rope_type="default", rope_theta=100000.0), bos_token_id=1, eos_token_id=2,
               pad_token_id=2)
SHAPES = {"math": dict(prompts=4, group=8, prompt=(58, 64), new=(65, 90), tool=0),
          "tools": dict(prompts=4, group=8, prompt=(150, 160), new=(96, 96), tool=13)}
PHASES = ("pack", "old", "ref", "train")
BETA = 0.04


def parse_shape(text):
    """A SHAPES name, or PxG:PROMPT:NEW with lengths N or LO-HI."""
    if text in SHAPES:
        return SHAPES[text]
    try:
        counts, prompt, new = text.split(":")
        prompts, group = map(int, counts.split("x"))
        span = lambda s: tuple(map(int, s.split("-"))) if "-" in s else (int(s), int(s))  # noqa: E731
        return dict(prompts=prompts, group=group, prompt=span(prompt), new=span(new), tool=0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: math, tools or PxG:PROMPT:NEW "
                                         "(4x8:2000:200, 4x8:1500-2000:100-300)")


def rollouts(shape, vocab, seed=0):
    """shape's batch: prompts x group Samples, group after group, random ids, seeded lengths."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    ids = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    samples = []
    for _ in range(shape["prompts"]):
        prompt = ids(draw(*shape["prompt"]))
        for _ in range(shape["group"]):
            n = draw(*shape["new"])
            if shape["tool"]:  # a policy turn, the tool's answer (the environment's: mask 0), the final turn
                first = draw(15, 40)
                mask = [1] * first + [0] * shape["tool"] + [1] * (n - first - shape["tool"])
            else:
                mask = [1] * n
            logprobs = [-3 * float(torch.rand(1, generator=g)) if m else 0.0 for m in mask]
            samples.append(Sample(prompt_ids=prompt, token_ids=ids(n), logprobs=logprobs, mask=mask,
                                  adv=float(torch.randn(1, generator=g))))
    return samples


def describe(name, shape, samples):
    span = lambda lo, hi: str(lo) if lo == hi else f"{lo}-{hi}"  # noqa: E731
    tool = f" ({shape['tool']} of them a tool's answer, mask 0)" if shape["tool"] else ""
    whole = sum(len(s.prompt_ids) + len(s.token_ids) for s in samples)
    return (f"{name}: {shape['prompts']} prompts x {shape['group']} samples, prompt {span(*shape['prompt'])} tokens, "
            f"{span(*shape['new'])} tokens after it{tool}; {whole:,} tokens whole, "
            f"{sum(s.policy_tokens for s in samples):,} of them the policy's")


def random_model(name):
    """Random weights of a named shape (smollm2, make_tiny_model.SHAPES) or of a config.json."""
    import make_tiny_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    if name in make_tiny_model.SHAPES:
        return make_tiny_model.build_model(**make_tiny_model.SHAPES[name])
    if name == "smollm2":
        fields = dict(SMOLLM2)
    else:
        with open(name) as f:
            fields = json.load(f)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields),
                                            dtype=torch.float32)


def model_dir(random):
    """(directory, description, temporary): the real SmolLM2, or random weights saved for load_model."""
    if random is None and os.path.isdir(REAL):
        return REAL, "SmolLM2-135M-Instruct (models/smollm2-135m-instruct)", False
    name = random or "smollm2"
    model = random_model(name)
    path = tempfile.mkdtemp(prefix="bench_prefix_")
    model.save_pretrained(path)
    return path, f"random weights, shape {name}", True


def load(path):
    """The policy and its reference as train.py builds them (a world of one), and the config."""
    from config import Config
    from infra.parallel import load_model, setup_distributed

    cfg = Config(model_name_or_path=path, beta=BETA)
    _, _, device, mesh = setup_distributed(cfg)
    policy = load_model(cfg, device, mesh)
    ref = load_model(cfg, device, mesh, reference=True).requires_grad_(False)
    return cfg, device, policy, ref


def forward(model, b, cfg, device):
    """update.py's forward: logp, entropy, head_logp, head_ids of b's policy tokens."""
    return model.sequence_logprobs(b["input_ids"].to(device), b["mask"].to(device), cfg.temperature,
                                   position_ids=b["position_ids"].to(device))


@contextlib.contextmanager
def phase(seconds, name, device):
    """Adds the block's wall time (the GPU's work included) to seconds[name]."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    yield
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds[name] += time.perf_counter() - t0


def one_pass(policy, ref, samples, share, group, budget, cfg, device):
    """The training phase on the batch: seconds per phase, row tokens and micro-batches."""
    import packing
    from loss import grpo_loss

    seconds = dict.fromkeys(PHASES, 0.0)
    denom = float(sum(s.policy_tokens for s in samples))
    with phase(seconds, "pack", device):
        mbs = [packing.collate(mb, share) for mb in packing.pack_ranks(samples, 1, budget, group, share)[0]]
        for b in mbs:
            for k in packing.PER_TOKEN:
                b[k] = b[k].to(device)
    with torch.no_grad():
        for b in mbs:
            with phase(seconds, "old", device):
                b["old_logp"] = forward(policy, b, cfg, device)[0]
            with phase(seconds, "ref", device):
                b["ref_logp"] = forward(ref, b, cfg, device)[0]
    for i, b in enumerate(mbs):
        with phase(seconds, "train", device):
            policy.set_requires_gradient_sync(i == len(mbs) - 1)  # reduce-scatter once per step, as update.py
            logp = forward(policy, b, cfg, device)[0]
            loss, _ = grpo_loss(logp, b["old_logp"], b["adv"], b["seq_ids"], denom, cfg, ref_logp=b["ref_logp"])
            loss.backward()
    seconds["total"] = sum(seconds.values())
    return seconds, sum(b["input_ids"].numel() for b in mbs), len(mbs)


class LiveBytes(TorchDispatchMode):
    """The peak bytes of tensor storage alive during a pass on CPU, counted as MemTracker counts
    them (which refuses a module called once per micro-batch): the storages of `tensors` at the
    start, then each storage an op returns, until it is freed, and the storage resizes by which
    FSDP2 allocates and frees gathered parameters (UntypedStorage.resize_ escapes the dispatcher:
    patched while the mode is on). Temporaries freed inside one op are not seen."""

    def __init__(self, tensors):
        super().__init__()
        self.sizes, self.refs = WeakIdKeyDictionary(), {}  # storage -> [bytes]; its weak references
        self.now = self.peak = 0
        for t in tensors:
            self.track(t)

    def add(self, n):
        self.now += n
        self.peak = max(self.peak, self.now)

    def track(self, t):
        st = t.untyped_storage()
        if st in self.sizes:
            return
        size = self.sizes[st] = [st.nbytes()]
        ref = weakref.ref(st, lambda r: self.free(r, size))
        self.refs[id(ref)] = ref
        self.add(size[0])

    def free(self, ref, size):
        """A storage is gone: its weak reference fires."""
        del self.refs[id(ref)]
        self.add(-size[0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            return NotImplemented  # DTensor runs its local ops, which come back here
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self.track, out)
        return out

    def __enter__(self):
        resize = self.resize = torch.UntypedStorage.resize_

        def tracked_resize(st, n):
            resize(st, n)
            if (size := self.sizes.get(st)) is not None:
                self.add(st.nbytes() - size[0])
                size[0] = st.nbytes()
        torch.UntypedStorage.resize_ = tracked_resize
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self.resize
        return super().__exit__(*exc)


def with_peak(models, run, device):
    """run() under the peak-memory probe: (its result, peak bytes)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        out = run()
        return out, torch.cuda.max_memory_allocated()
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    with LiveBytes([local(t) for m in models for t in (*m.parameters(), *m.buffers())]) as probe:
        out = run()
    return out, probe.peak


def compare(policy, ref, samples, group, budget, cfg, device, repeats):
    """Both variants, alternating, a warm-up pass each (its peak memory) then `repeats` timed:
    {variant: dict(seconds={phase: median}, rows, micro, peak)}."""
    res = {v: dict(times=[]) for v in ("shared", "unshared")}
    for rep in range(repeats + 1):
        for v in (("shared", "unshared") if rep % 2 == 0 else ("unshared", "shared")):
            policy.zero_grad(set_to_none=True)
            run = lambda: one_pass(policy, ref, samples, v == "shared", group, budget, cfg, device)  # noqa: E731
            if rep == 0:
                (_, res[v]["rows"], res[v]["micro"]), res[v]["peak"] = with_peak((policy, ref), run, device)
            else:
                res[v]["times"].append(run()[0])
            took = "" if rep == 0 else f" {res[v]['times'][-1]['total']:.2f} s"
            print(f"  {'warm-up' if rep == 0 else f'rep {rep}'} {v}{took}", file=sys.stderr, flush=True)
    policy.zero_grad(set_to_none=True)
    for r in res.values():
        r["seconds"] = {k: statistics.median(t[k] for t in r["times"]) for k in (*PHASES, "total")}
    return res


def full_grad(p):
    g = p.grad
    return (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().float().cpu().flatten()


def grads_of(samples, share, policy, cfg, device):
    """logp, entropy and the LM head's and middle layer's gradients of one forward + backward."""
    import packing
    from loss import grpo_loss

    b = packing.collate(samples, share)
    policy.zero_grad(set_to_none=True)
    policy.set_requires_gradient_sync(True)
    logp, entropy, _, _ = forward(policy, b, cfg, device)
    seq_ids, adv = b["seq_ids"].to(device), b["adv"].to(device)
    loss, _ = grpo_loss(logp, logp.detach(), adv, seq_ids, float(logp.numel()), cfg)  # ratio 1: -adv logp / N
    loss.backward()
    layers = policy.model.layers
    middle = len(layers) // 2
    out = {"logp": logp.detach().float().cpu(), "entropy": entropy.float().cpu(),
           "LM-head grad": full_grad(policy.lm_head.weight),
           f"layer {middle} grad": torch.cat([full_grad(p) for p in layers[middle].parameters()])}
    policy.zero_grad(set_to_none=True)
    return out


def exactness(policy, samples, group, budget, cfg, device):
    """Shared - unshared on the first shared micro-batch's samples: {name: (max abs diff, relative)}."""
    import packing

    first = packing.pack_ranks(samples, 1, budget, group, True)[0][0]
    shared, whole = (grads_of(first, share, policy, cfg, device) for share in (True, False))
    diffs = {}
    for k in shared:
        d = (shared[k] - whole[k]).abs().max().item() if shared[k].numel() else 0.0
        diffs[k] = (d, d / max(whole[k].abs().max().item(), 1e-30))
    return diffs, len(first)


def gb(n):
    return f"{n / 2**30:.2f}"


def report(name, res, diffs, n_exact, weights, fp32):
    sh, un = res["shared"], res["unshared"]
    print(f"  {'variant':9} {'micro':>5} {'row tokens':>10} " + " ".join(f"{p + ' s':>8}" for p in (*PHASES, "total"))
          + f" {'peak GB':>8} {'above weights':>13}")
    for v, r in res.items():
        print(f"  {v:9} {r['micro']:5d} {r['rows']:10,d} " + " ".join(f"{r['seconds'][p]:8.3f}" for p in
                                                                   (*PHASES, "total"))
              + f" {gb(r['peak']):>8} {gb(r['peak'] - weights):>13}")
    ratios = " ".join(f"{p} {un['seconds'][p] / max(sh['seconds'][p], 1e-12):.2f}x" for p in (*PHASES, "total"))
    print(f"  unshared / shared: {ratios}; row tokens {un['rows'] / sh['rows']:.2f}x; "
          f"peak {un['peak'] / sh['peak']:.2f}x "
          f"(above weights {(un['peak'] - weights) / max(sh['peak'] - weights, 1):.2f}x)")
    flag = lambda d: " (> 1e-5)" if fp32 and d > 1e-5 else ""  # noqa: E731
    print(f"  exactness, shared - unshared, the first shared micro-batch ({n_exact} samples) collated both ways, "
          f"max abs (relative to the largest entry):")
    print("    " + ", ".join(f"{k} {d:.2e} ({rel:.1e}){flag(d)}" for k, (d, rel) in diffs.items()))
    speed = un["seconds"]["total"] / sh["seconds"]["total"]
    speed = f"{speed:.2f}x faster" if speed >= 1 else f"{1 / speed:.2f}x slower"
    return (f"{name}: shared {speed}, rows {sh['rows']:,} vs {un['rows']:,} tokens, "
            f"peak {gb(sh['peak'])} vs {gb(un['peak'])} GB")


def cpu_model():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return "unknown"


def weight_bytes(*models):
    local = lambda p: p.to_local() if hasattr(p, "to_local") else p  # noqa: E731
    return sum(local(p).numel() * local(p).element_size() for m in models for p in m.parameters())


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", type=str, default=["math", "tools"], help="math, tools, PxG:PROMPT:NEW")
    p.add_argument("--random", metavar="CONFIG_JSON_OR_NAME", help="random weights: smollm2, tiny, 24m, 0.5b, 1.5b, "
                   "or a config.json (default: models/smollm2-135m-instruct if present, else smollm2)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA when there is one")
    p.add_argument("--max-tokens", type=int, default=4096, help="max_tokens_per_micro_batch")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per variant, after one warm-up")
    args = p.parse_args()
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    try:
        shapes = {s: parse_shape(s) for s in args.shapes}
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before CUDA starts: setup_distributed takes a GPU when it sees one
    elif args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device")

    import transformers

    from infra.parallel import close_distributed

    path, what, temporary = model_dir(args.random)
    cfg, device, policy, ref = load(path)
    if temporary:
        shutil.rmtree(path)
    n_params = sum(p.numel() for p in policy.parameters())
    fp32 = device.type == "cpu"
    print(f"cpu: {cpu_model()}; torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads; device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    precision = "float32" if fp32 else "bf16 compute (FSDP2 mixed precision)"
    print(f"model: {what}, {n_params / 1e6:.1f} M parameters, {precision}; "
          f"policy + reference by parallel.load_model (world of one); max_tokens_per_micro_batch {args.max_tokens}; "
          f"peak by {'LiveBytes' if fp32 else 'max_memory_allocated'}; medians of {args.repeats} after a warm-up; "
          f"load average {os.getloadavg()[0]:.2f}")
    summary = []
    for name, shape in shapes.items():
        samples = rollouts(shape, policy.config.vocab_size)
        group = shape["group"]
        print(describe(name, shape, samples), flush=True)
        res = compare(policy, ref, samples, group, args.max_tokens, cfg, device, args.repeats)
        diffs, n_exact = exactness(policy, samples, group, args.max_tokens, cfg, device)
        summary.append(report(name, res, diffs, n_exact, weight_bytes(policy, ref), fp32))
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    print("\n".join(summary))
    del policy, ref
    close_distributed()


if __name__ == "__main__":
    main()
