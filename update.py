"""The policy update of one step: GRPO on one rollout batch, every rank on its share.

    train_on_batch(cfg, state, samples, ...)
      frozen_logprobs          old_logp, ref_logp and the top-k KL's heads, under no_grad, before any update
      for epoch, mini-batch:
        mini_batch_backward    each micro-batch: micro_batch_loss (the objective, loss.py, with the
                               trainer/vLLM corrections), then backward
        check_sync             first mini-batch: trainer vs vLLM logprobs, before any update (SyncError)
      optimizer_step           clip, then step unless the loss or gradient is non-finite somewhere
    StepMetrics                per-token sums of this rank, reduced over ranks once (the sync check apart)
    check_health               train.py, each step: updates skipped in a row stop the run (max_consecutive_skipped_steps)

A step is one rollout batch (train.py's loop); an update is one optimizer step (num_mini_batches x
num_epochs of them per step). TrainState is what training changes: the policy, its reference,
AdamW and the learning-rate schedule.

The loss of each micro-batch is already divided by the whole optimizer step's denominator
(loss.step_denominator), so gradients accumulated over micro-batches and summed over ranks
are the gradient of one loss over the step.
"""

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from infra.faults import SyncError
from infra.vllm_server import server_dtype
from loss import ess_from_sums, ess_sums, grpo_loss, mismatch_mask, step_denominator
from packing import TOKENS, micro_batches


@dataclass
class TrainState:
    """What training changes, and a checkpoint holds (with the step and the prompt sampler's position)."""
    policy: torch.nn.Module  # FSDP2-sharded; with LoRA, the base frozen and the adapters in it
    ref: Optional[object]  # reference.Reference, or None without a KL term (beta = 0); reference.py has every kind
    optimizer: torch.optim.Optimizer  # AdamW over the trained parameters
    scheduler: torch.optim.lr_scheduler.LRScheduler  # warm-up and decay, stepped once per update


def make_optimizer(cfg, policy, total_updates, device):
    """AdamW (fused on CUDA, foreach on CPU or offloaded) and the warm-up + schedule, in optimizer steps."""
    from transformers import get_scheduler

    trained = [p for p in policy.parameters() if p.requires_grad]  # with LoRA: the adapter alone
    optimizer = torch.optim.AdamW(trained, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                  **({"fused": True} if device.type == "cuda" and not cfg.offload_params else {"foreach": True}))
    name = "constant_with_warmup" if cfg.lr_scheduler_type == "constant" else cfg.lr_scheduler_type
    return optimizer, get_scheduler(name, optimizer, num_warmup_steps=cfg.warm_up_steps,
                                    num_training_steps=total_updates)


@dataclass
class FrozenLogprobs:
    """What one micro-batch needs from before any update, fixed through the step's updates; (N,)
    over its completion tokens."""
    old_logp: Optional[torch.Tensor] = None  # None: the detached new logp (one mini-batch, one epoch: ratio 1)
    ref_logp: Optional[torch.Tensor] = None  # None: no KL term
    head_ids: Optional[torch.Tensor] = None  # (N, k) top-k KL: the sampling policy's (a teacher's) k most likely tokens
    ref_head_logp: Optional[torch.Tensor] = None  # (N, k) the reference's logp at head_ids
    in_head: Optional[torch.Tensor] = None  # (N,) bool: the sampled token is one of head_ids


def frozen_logprobs(cfg, policy, ref, micro, forward, reuse_old, device):
    """One FrozenLogprobs per micro-batch: old_logp (recomputed, or vLLM's with use_vllm_logprobs), the
    reference's logp and, for the top-k KL, the sampling policy's top-k ids (a teacher's: its own)
    with the reference's logp there (O(k) per token)."""
    topk_kl, out = cfg.topk_kl, []
    with torch.no_grad():
        for b in micro:
            frozen = FrozenLogprobs()
            if (not reuse_old and not cfg.use_vllm_logprobs) or topk_kl:
                own = topk_kl and not cfg.teacher_model_name_or_path  # a teacher's head is its own (below)
                frozen.old_logp, _, _, frozen.head_ids = forward(policy, b, head_size=cfg.kl_topk if own else 0)
            if cfg.use_vllm_logprobs:
                frozen.old_logp = b["vllm_logp"]
            if not topk_kl:
                frozen.head_ids = None
            if cfg.beta > 0:  # a teacher's head is its own top k (distill/teacher.py)
                frozen.ref_logp, _, frozen.ref_head_logp, ids = ref.logprobs(forward, b, head_ids=frozen.head_ids)
                frozen.head_ids = ids if topk_kl else None
            if topk_kl:
                targets = (b["targets"] if "targets" in b else b["input_ids"][:, 1:])[b["mask"]].to(device)
                frozen.in_head = (frozen.head_ids == targets[:, None]).any(-1)
            out.append(frozen)
    return out


def micro_batch_loss(cfg, logp, head_logp, b, frozen, denom, ess_value):
    """grpo_loss of one micro-batch with the trainer/vLLM corrections the config asks for:
    truncated importance sampling and the token or sequence mask. Returns (loss, sums, masked)."""
    old_logp = logp.detach() if frozen.old_logp is None else frozen.old_logp
    tis = mask = None
    if cfg.truncated_importance_sampling_ratio_cap > 0:
        tis = torch.exp(old_logp - b["vllm_logp"]).clamp(max=cfg.truncated_importance_sampling_ratio_cap)
    if cfg.vllm_importance_sampling_mask != "none":
        mask = mismatch_mask(old_logp, b["vllm_logp"], b["seq_ids"], cfg.vllm_importance_sampling_mask,
                             cfg.vllm_importance_sampling_mask_cap)
    kl_heads = (head_logp, frozen.ref_head_logp, frozen.in_head) if frozen.in_head is not None else None
    loss, sums = grpo_loss(logp, old_logp, b["adv"], b["seq_ids"], denom, cfg, ref_logp=frozen.ref_logp,
                           tis_weight=tis, mismatch_mask=mask, ess_value=ess_value, kl_heads=kl_heads)
    return loss, sums, (mask == 0).sum() if mask is not None else torch.zeros((), device=logp.device)


def ess(rho):
    """ESS of the ratios rho over every rank's tokens (loss.ess_sums, reduced here)."""
    sums = ess_sums(rho)
    dist.all_reduce(sums)
    return ess_from_sums(sums)


def optimizer_step(cfg, state, step_loss):
    """Clip, then step unless the loss or the gradient norm is non-finite on some rank (every
    rank takes the same decision). Returns (gradient norm, whether the update was skipped)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(state.policy.parameters(), cfg.max_grad_norm or float("inf"))
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    finite = (torch.isfinite(grad_norm) & torch.isfinite(step_loss)).float()
    dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    if finite.item():
        state.optimizer.step()
    state.scheduler.step()
    state.optimizer.zero_grad(set_to_none=True)
    return grad_norm.item(), not finite.item()


def kl_name(cfg):
    """The logged KL's name: teacher_kl to a teacher, kl to the policy's own reference; _forward when it is the
    forward KL(ref || pi) (topk_forward), the others all estimating the reverse KL(pi || ref)."""
    return ("teacher_kl" if cfg.teacher_model_name_or_path else "kl") + (
        "_forward" if cfg.kl_estimator == "topk_forward" else "")


def sync_tolerance(cfg):
    """The sync check's bound on the mean |trainer - vLLM| logprob: vllm_logp_tolerance, or by the dtypes the
    two sides compute in (the trainer in bfloat16 on GPUs, parallel.py; the server in server_dtype).
    float32 on both (a CPU run): 1e-2, where a healthy sync agrees to ~1e-6 and a lost one differs by
    the step's update. bfloat16 on either side: 0.07. Healthy bf16 trainers against bf16 vLLM measured a
    mean gap of ~0.015 against 0.201 with stale weights (TRL issue 5312), and an RMS of 0.031 nats at
    0.5B with a float32 LM head, 0.041 without (Fast-LLM PR 525; a mean |gap| is at most the RMS): 0.07
    is 4.7x the healthy mean and 2.3x the RMS, and 2.9x below the stale gap. Measure yours on a GPU:
    the step's vllm_logp_diff_mean."""
    if cfg.vllm_logp_tolerance is not None:
        return cfg.vllm_logp_tolerance
    both_float32 = not torch.cuda.is_available() and server_dtype(cfg) in ("float32", "float")
    return 1e-2 if both_float32 else 0.07


class StepMetrics:
    """One step's statistics: float64 sums over this rank's tokens, reduced over ranks once,
    then divided by the step's tokens; ESS values, gradient norms and skipped updates."""
    SUMS = ("loss", "pg_loss", "kl", "clipped", "entropy", "ess_trust", "masked", "tokens")

    def __init__(self, device):
        self.sums = {k: torch.zeros((), dtype=torch.float64, device=device) for k in self.SUMS}
        self.vllm_diff = torch.zeros(2, dtype=torch.float64, device=device)  # sum of |diff|, tokens
        self.vllm_logp_diff_max = torch.zeros((), device=device)
        self.vllm_logp_diff_mean = 0.0
        self.ess, self.grad_norms, self.skipped = [], [], 0
        self.micro_batch_tokens = 0  # this rank's largest micro-batch (row tokens): the memory plan's step figure

    def add(self, **values):
        for k, v in values.items():
            self.sums[k] += v.double() if torch.is_tensor(v) else v

    def add_vllm_diff(self, diff):
        """|trainer logp - vLLM logp| over the tokens the current weights sampled: the sync check."""
        self.vllm_diff[0] += diff.sum().double()
        self.vllm_diff[1] += diff.numel()
        if diff.numel():
            self.vllm_logp_diff_max = torch.maximum(self.vllm_logp_diff_max, diff.max())

    def check_sync(self, cfg):
        """Reduce the sync check over ranks and raise SyncError on every rank when the last weight
        sync did not take: called before the step's first optimizer step, so the policy, its
        optimizer and the reference stay those of the last good step (train.py checkpoints them)."""
        dist.all_reduce(self.vllm_diff)
        dist.all_reduce(self.vllm_logp_diff_max, op=dist.ReduceOp.MAX)
        total, tokens = self.vllm_diff.tolist()
        self.vllm_logp_diff_mean = total / max(tokens, 1.0)
        if self.vllm_logp_diff_mean > sync_tolerance(cfg):
            raise SyncError(f"trainer and vLLM logprobs differ by {self.vllm_logp_diff_mean:.3g} on average "
                            f"(> vllm_logp_tolerance={sync_tolerance(cfg):g}) before this step's update: the "
                            f"last weight sync did not take, or the server runs another dtype (vllm_dtype)")

    def reduce(self, cfg):
        """Reduce over ranks (a collective) and return the metrics dict of the step."""
        sums = torch.stack([self.sums[k] for k in self.SUMS])
        dist.all_reduce(sums)  # the sync check's figures were reduced by check_sync
        s = dict(zip(self.SUMS, sums.tolist()))
        n = max(s["tokens"], 1)
        m = dict(loss=s["loss"] / n, pg_loss=s["pg_loss"] / n, clip_frac=s["clipped"] / n,
                 **{kl_name(cfg): s["kl"] / n},  # KL to the reference
                 entropy=s["entropy"] / n, grad_norm=sum(self.grad_norms) / max(len(self.grad_norms), 1),
                 grad_norm_max=max(self.grad_norms, default=0.0),
                 vllm_logp_diff_mean=self.vllm_logp_diff_mean,
                 vllm_logp_diff_max=self.vllm_logp_diff_max.item(), skipped_updates=self.skipped,
                 trained_tokens=int(s["tokens"]), micro_batch_tokens=self.micro_batch_tokens)
        if cfg.objective.ess:
            m.update(ess=sum(self.ess) / len(self.ess), ess_trust=s["ess_trust"] / n)
        if cfg.vllm_importance_sampling_mask != "none":
            m["vllm_importance_sampling_masked_frac"] = s["masked"] / n
        return m


def train_on_batch(cfg, state, samples, rank, world_size, device):
    """Mini-batches x epochs of GRPO updates of `state` (a TrainState) on one rollout batch; the step's metrics."""
    policy, scheduler = state.policy, state.scheduler
    # Each mini-batch's sequences, tokens balanced over ranks and packed into micro-batches of at most
    # max_tokens_per_micro_batch tokens; every rank runs as many as the others (packing.py). Under
    # sequence parallelism the S ranks of a group share their rows, each keeping a piece of every row.
    # what the reference puts on the samples first (a teacher's scores), and its metrics
    prepared = state.ref.prepare(samples) if state.ref is not None else {}
    size = cfg.sequence_parallel_size
    minis = micro_batches(samples, cfg, world_size // size, rank // size)
    if size > 1:
        from sequence_parallel import piece

        minis = [([piece(b, rank % size, size) for b in mbs], n_tokens, n_seqs) for mbs, n_tokens, n_seqs in minis]
    micro = [mbs for mbs, _, _ in minis]
    for b in (b for mbs in micro for b in mbs):
        for key in TOKENS.keys() & b.keys():
            b[key] = b[key].to(device)

    def forward(model, b, **kw):  # logp, entropy, head_logp, head_ids of b's completion tokens
        piece_of_row = {k: b[k].to(device) for k in ("targets", "row_position_ids") if k in b}
        return model.sequence_logprobs(b["input_ids"].to(device), b["mask"].to(device), cfg.temperature,
                                       position_ids=b["position_ids"].to(device), **piece_of_row, **kw)

    # lora_dropout: the ratio compares the dropout forward with the dropout-free one that sampled
    reuse_old = (cfg.num_mini_batches == 1 and cfg.num_epochs == 1 and not cfg.use_vllm_logprobs and not cfg.topk_kl
                 and not cfg.lora_dropout)
    frozen_per_mini = [frozen_logprobs(cfg, policy, state.ref, mbs, forward, reuse_old, device) for mbs in micro]
    # Dr GRPO's constant denominator counts the configured sequences of a mini-batch, not those
    # left after filtering: a token weighs the same at every step
    configured = cfg.num_unique_prompts_rollout * cfg.num_samples_per_prompt_rollout // cfg.num_mini_batches
    check = next(j for j, (_, _, n_seqs) in enumerate(minis) if n_seqs)  # the sync check's mini-batch
    metrics = StepMetrics(device)
    for epoch in range(cfg.num_epochs):
        for j, ((_, n_tokens, n_seqs), mbs, frozens) in enumerate(zip(minis, micro, frozen_per_mini)):
            if not n_seqs:  # every group of this mini-batch was filtered out (alike on every rank): no update
                if epoch or j > check:  # those before the sync check step the schedule once it has passed
                    scheduler.step()
                continue
            denom = step_denominator(cfg.loss_denominator, n_tokens, configured)
            step_loss = mini_batch_backward(cfg, policy, mbs, frozens, forward, denom, world_size, metrics,
                                            sync_check=epoch == 0 and j == check)
            if epoch == 0 and j == check:  # before any update: a sync that did not take stops the run here
                metrics.check_sync(cfg)
                for _ in range(check):
                    scheduler.step()
            grad_norm, skipped = optimizer_step(cfg, state, step_loss)
            metrics.grad_norms.append(grad_norm)
            metrics.skipped += skipped  # a non-finite loss or gradient norm on some rank: the weights are kept
    return {**metrics.reduce(cfg), **prepared}


@contextlib.contextmanager
def dropout(model, on):
    """With on, the modules the model build marked `dropout_in_training` (lora.adapters.add_adapters: PEFT's dropout
    on the trained adapter's input) in train mode inside the block. The models otherwise stay in eval mode
    (from_pretrained's): no other dropout is ever switched on."""
    modules = [m for m in model.modules() if on and getattr(m, "dropout_in_training", None)]
    for m in modules:
        m.train(True)
    try:
        yield
    finally:
        for m in modules:
            m.train(False)


def mini_batch_backward(cfg, policy, mbs, frozens, forward, denom, world_size, metrics, sync_check):
    """Forward and backward of one mini-batch's micro-batches on this rank (gradients accumulate
    until the last one reduce-scatters them); their summed loss."""
    ess_value, reads_ess = 1.0, cfg.objective.ess
    if reads_ess and cfg.ess_scope == "step" and frozens[0].old_logp is not None:
        with torch.no_grad():  # ESS of the whole optimizer step's ratios: one extra forward
            ess_value = ess(torch.cat([torch.exp(forward(policy, b, head_ids=fz.head_ids)[0] - fz.old_logp)
                                       for b, fz in zip(mbs, frozens)]))
    if reads_ess and cfg.ess_scope == "step":
        metrics.ess.append(ess_value)  # once per optimizer step, however many micro-batches it packs
    losses = []
    with dropout(policy, cfg.lora_dropout > 0):  # on through backward: a checkpointed layer recomputes it
        for i, (b, frozen) in enumerate(zip(mbs, frozens)):
            policy.set_requires_gradient_sync(i == len(mbs) - 1)  # reduce-scatter once per optimizer step
            metrics.micro_batch_tokens = max(metrics.micro_batch_tokens, b["input_ids"].numel())
            logp, entropy, head_logp, _ = forward(policy, b, head_ids=frozen.head_ids)
            if reads_ess and cfg.ess_scope == "micro_batch":  # over this micro-batch on every rank
                old_logp = logp.detach() if frozen.old_logp is None else frozen.old_logp
                ess_value = ess(torch.exp(logp.detach() - old_logp))
                metrics.ess.append(ess_value)
            loss, s, masked = micro_batch_loss(cfg, logp, head_logp, b, frozen, denom, ess_value)
            # The loss is already divided by the step's global count; FSDP averages gradients over
            # ranks, so scale by the world size to get their sum (gloo has no premul-sum).
            (loss * world_size).backward()
            metrics.add(loss=loss.detach().double() * denom, pg_loss=s["pg_loss"], kl=s["kl"], clipped=s["clipped"],
                        entropy=entropy.sum(), ess_trust=s["ess_trust"], masked=masked, tokens=logp.numel())
            if sync_check:  # trainer vs vLLM on the tokens the current weights sampled, before any update
                # (with lora_dropout, the dropout-free old logprobs: the same weights, the forward vLLM runs)
                trainer = frozen.old_logp if cfg.lora_dropout else logp.detach()
                metrics.add_vllm_diff((trainer - b["vllm_logp"]).abs()[b["fresh"].to(logp.device)])
            losses.append(loss.detach())
    return torch.stack(losses).sum()


def check_health(cfg, step, skipped_in_a_row):
    """train.py, after each step that trained: stop the run when updates keep being skipped (the skip rule:
    train_on_batch). A sync that did not take stops it sooner, in train_on_batch, before the step trains."""
    if skipped_in_a_row >= cfg.max_consecutive_skipped_steps:
        raise RuntimeError(f"step {step}: {skipped_in_a_row} steps in a row had a non-finite loss or "
                           f"gradient norm (max_consecutive_skipped_steps): the run diverged; lower "
                           f"learning_rate or resume from an earlier checkpoint")
