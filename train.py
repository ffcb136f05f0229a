"""GRPO on PyTorch FSDP2 with rollouts from a vLLM server and an EMA reference policy.

    python scripts/make_tiny_model.py --out models/tiny          # a random 0.3 M model
    python train.py --num_training_steps 20                      # one process (breakpoint() works)
    torchrun --nproc_per_node 2 train.py --output_dir output/demo  # 2 CPU ranks (gloo)
    torchrun --nproc_per_node 8 train.py --model_name_or_path Qwen/Qwen2.5-0.5B --dataset my.jsonl \
        --vllm_server_urls http://gpu-node:8000                  # 8 GPUs (nccl), your vLLM server
    torchrun --nproc_per_node 2 train.py --checkpoint_state_dir ckpt --checkpoint_state_freq 50  # resumes by itself
    torchrun --nproc_per_node 2 train.py --async_steps 1 --truncated_importance_sampling_ratio_cap 2  # generate ahead
    python train.py --help                                       # every config field

One step: rank 0 asks vLLM for completions, scores them and computes group advantages;
every rank gets the batch, computes old/reference logprobs, and trains on its share
(FSDP2, one fully_shard per decoder layer then the root); the reference moves toward
the policy (one foreach lerp on local shards); the weights go back into vLLM; every
checkpoint_state_freq steps each rank writes its shards (checkpoint.py). With
async_steps=k the batches of the next k steps are generated while this one trains.

Where this differs from the papers:
- Advantages use the group std with Bessel's correction (like TRL), eps 1e-6.
- The "token" denominator counts the valid tokens of the whole optimizer step over all
  ranks and micro-batches (not a per-micro-batch mean, which overweights short answers).
- Logprobs, old and new, are taken at the sampling temperature (vLLM reports
  temperature-processed logprobs too), so the ratio compares the policies that sampled.
- With one mini-batch and one epoch, old_logp is the detached new logp (ratio 1, one
  forward pass saved). Every step compares vLLM's sampling logprobs with the trainer's
  on the first mini-batch, before any update, over the samples the current weights
  produced: a sync that did not take stops the run.
"""

import json
import os
import resource
import signal
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

import checkpoint
import rollout
import tracking
from weight_sync import full_state_dict, make_weight_sync, write_serving_dir
from cli import parse_args
from config import Config
from data import PromptSampler, collate, load_prompts, load_tokenizer, split_for_ranks
from episodes import Rollouts, drop_stale, evaluate, rollout_batch
from loss import ess, grpo_loss, mismatch_keep, step_denominator
from parallel import close_distributed, load_model, setup_distributed
from reward_pool import RewardPool
from reference import EMAReference


def make_optimizer(cfg, policy, total_updates, device):
    """AdamW (fused on CUDA, foreach on CPU or offloaded) and the warm-up + schedule, in optimizer steps."""
    from transformers import get_scheduler

    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                  **({"fused": True} if device.type == "cuda" and not cfg.offload_params else {"foreach": True}))
    name = "constant_with_warmup" if cfg.lr_scheduler_type == "constant" else cfg.lr_scheduler_type
    return optimizer, get_scheduler(name, optimizer, num_warmup_steps=cfg.warm_up_steps,
                                    num_training_steps=total_updates)


def old_and_ref_logprobs(cfg, policy, ref_model, micro, fwd, topk, reuse_old, device):
    """Before any update: old_logp (or vLLM's), the reference's logp and, for the top-k KL, the
    sampling policy's top-k ids with the reference's values there (O(k) per token), in place."""
    with torch.no_grad():
        for b in (b for mbs in micro for b in mbs):
            for key in ("vllm_logp", "adv", "seq_ids"):
                b[key] = b[key].to(device)
            if (not reuse_old and not cfg.use_vllm_logprobs) or topk:
                b["old_logp"], _, _, b["head_ids"] = fwd(policy, b, topk=cfg.kl_topk if topk else 0)
            if cfg.use_vllm_logprobs:
                b["old_logp"] = b["vllm_logp"]
            if cfg.beta > 0:
                b["ref_logp"], _, b["ref_head_logp"], _ = fwd(ref_model, b, head_ids=b.get("head_ids"))
            if topk:
                targets = b["input_ids"][:, 1:][b["mask"]].to(device)
                b["in_head"] = (b["head_ids"] == targets[:, None]).any(-1)


def micro_batch_loss(cfg, logp, old_logp, head_logp, b, denom, e, topk):
    """grpo_loss of one micro-batch with the trainer/vLLM corrections the config asks for:
    truncated importance sampling and the token or sequence mask. Returns (loss, sums, masked)."""
    tis = keep = None
    if cfg.truncated_importance_sampling_ratio_cap > 0:
        tis = torch.exp(old_logp - b["vllm_logp"]).clamp(max=cfg.truncated_importance_sampling_ratio_cap)
    if cfg.vllm_importance_sampling_mask != "none":
        keep = mismatch_keep(old_logp, b["vllm_logp"], b["seq_ids"], cfg.vllm_importance_sampling_mask,
                             cfg.vllm_importance_sampling_mask_cap)
    loss, s = grpo_loss(logp, old_logp, b["adv"], denom, loss_fn=cfg.loss_fn, clip_lower=cfg.clip_lower,
                        clip_higher=cfg.clip_higher, ref_logp=b.get("ref_logp"), beta=cfg.beta,
                        kl_estimator=cfg.kl_estimator, tis_weight=tis, keep=keep, ess_value=e,
                        topk=(head_logp, b["ref_head_logp"], b["in_head"]) if topk else None)
    return loss, s, (keep == 0).sum() if keep is not None else torch.zeros((), device=logp.device)


def optimizer_step(cfg, policy, optimizer, scheduler, step_loss):
    """Clip, then step unless the loss or the gradient norm is non-finite on some rank (every
    rank takes the same decision). Returns (gradient norm, whether the update was skipped)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm or float("inf"))
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    finite = (torch.isfinite(grad_norm) & torch.isfinite(step_loss)).float()
    dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    if finite.item():
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm.item(), not finite.item()


def train_on_rollouts(cfg, policy, ref_model, optimizer, scheduler, samples, rank, world_size, device, pad_id):
    """Mini-batches x epochs of GRPO updates on one rollout batch. Returns summed metrics."""
    minis = split_for_ranks(samples, cfg.num_mini_batches, world_size, rank, cfg.num_samples_per_prompt_rollout)
    micro = [[collate(mine[i:i + cfg.per_device_train_batch_size], pad_id) for i in
              range(0, len(mine), cfg.per_device_train_batch_size)] for mine, _, _ in minis]
    fwd = lambda model, b, **kw: model.sequence_logprobs(b["input_ids"].to(device), b["attention_mask"].to(device),  # noqa: E731
                                                         b["mask"].to(device), cfg.temperature, **kw)
    topk = cfg.kl_estimator == "topk" and cfg.beta > 0
    reuse_old = cfg.num_mini_batches == 1 and cfg.num_epochs == 1 and not cfg.use_vllm_logprobs and not topk
    old_and_ref_logprobs(cfg, policy, ref_model, micro, fwd, topk, reuse_old, device)
    # Dr GRPO's constant denominator counts the configured sequences of a mini-batch, not those
    # left after filtering: a token weighs the same at every step
    configured = cfg.num_unique_prompts_rollout * cfg.num_samples_per_prompt_rollout // cfg.num_mini_batches
    ess_values, grad_norms, skipped = [], [], 0
    first = next(k for k, (_, _, n_seqs) in enumerate(minis) if n_seqs)  # the sync check's mini-batch
    # local sums: loss x denom, pg_loss, kl, clipped, entropy, ESS trust term, masked tokens, tokens,
    # |logp - vllm_logp|, its tokens; then its max
    sums, diff_max = torch.zeros(10, dtype=torch.float64, device=device), torch.zeros(1, device=device)
    step_loss = torch.zeros((), device=device)  # this rank's loss over the optimizer step's micro-batches
    for epoch in range(cfg.num_epochs):
        for k, ((_, n_tokens, n_seqs), mbs) in enumerate(zip(minis, micro)):
            if not n_seqs:  # every group of this mini-batch was filtered out (alike on every rank): no update
                scheduler.step()
                continue
            denom = step_denominator(cfg.loss_denominator, n_tokens, configured)
            e = 1.0
            if cfg.loss_fn == "ess" and cfg.ess_scope == "step" and not reuse_old:
                with torch.no_grad():  # ESS of the whole optimizer step's ratios: one extra forward
                    e = ess(torch.cat([torch.exp(fwd(policy, b, head_ids=b.get("head_ids"))[0] - b["old_logp"])
                                       for b in mbs]))
            for i, b in enumerate(mbs):
                policy.set_requires_gradient_sync(i == len(mbs) - 1)  # reduce-scatter once per step
                logp, entropy, head_logp, _ = fwd(policy, b, head_ids=b.get("head_ids"))  # --- loss
                old_logp = logp.detach() if reuse_old else b["old_logp"]
                if cfg.loss_fn == "ess" and cfg.ess_scope == "micro_batch":
                    e = ess(torch.exp(logp.detach() - old_logp))  # over this micro-batch on every rank
                ess_values.append(e)
                loss, s, masked = micro_batch_loss(cfg, logp, old_logp, head_logp, b, denom, e, topk)
                # The loss is already divided by the step's global count; FSDP averages gradients
                # over ranks, so scale by the world size to get their sum (gloo has no premul-sum).
                (loss * world_size).backward()
                step_loss += loss.detach()
                zero = torch.zeros((), dtype=torch.float64, device=device)
                # trainer vs vLLM on the tokens the current weights sampled, before any update: the sync check
                diff = (logp.detach() - b["vllm_logp"]).abs()[b["fresh"].to(device)] if epoch == 0 and k == first else None
                sums += torch.stack([loss.detach().double() * denom, s["pg_loss"].double(), s["kl"].double(),
                                     s["clip_frac"].double(), entropy.sum().double(), s["ess_trust"].double(),
                                     masked.double(), zero + logp.numel(),
                                     diff.sum().double() if diff is not None else zero,
                                     zero + (diff.numel() if diff is not None else 0)])
                if diff is not None and diff.numel():
                    diff_max = torch.maximum(diff_max, diff.max())
            grad_norm, was_skipped = optimizer_step(cfg, policy, optimizer, scheduler, step_loss)  # --- optimizer
            grad_norms.append(grad_norm)
            skipped += was_skipped  # a non-finite loss or gradient norm on some rank: the weights are kept
            step_loss.zero_()
    dist.all_reduce(sums)
    dist.all_reduce(diff_max, op=dist.ReduceOp.MAX)
    n = int(sums[7].item())
    loss, pg_loss, kl, clip_frac, entropy, trust, masked = (sums[:7] / max(n, 1)).tolist()
    return dict(loss=loss, pg_loss=pg_loss, kl=kl, clip_frac=clip_frac, entropy=entropy,
                grad_norm=sum(grad_norms) / max(len(grad_norms), 1), grad_norm_max=max(grad_norms, default=0.0),
                vllm_logp_diff_mean=sums[8].item() / max(sums[9].item(), 1.0), vllm_logp_diff_max=diff_max.item(),
                skipped_steps=skipped, trained_tokens=n,
                **({"ess": sum(ess_values) / len(ess_values), "ess_trust": trust} if cfg.loss_fn == "ess" else {}),
                **({"vllm_importance_sampling_masked_frac": masked}
                   if cfg.vllm_importance_sampling_mask != "none" else {}))


def main(cfg: Config):
    """One run; returns the exit status (0, or 143 after a SIGTERM). The caller then calls
    close_distributed(), once the run's models are out of scope."""
    try:  # bad input: one line naming the fix, before any process group, model or server
        cfg.batch_plan(int(os.environ.get("WORLD_SIZE", 1)))
        tokenizer = load_tokenizer(cfg)
        train_rows, eval_rows, skipped, reward_fn = load_prompts(cfg, tokenizer)
        tracker = tracking.open_tracker(cfg) if int(os.environ.get("RANK", 0)) == 0 else None
    except ValueError as e:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    # SIGTERM (a scheduler, torchrun stopping the job): before the loop it unwinds like an
    # exception, so the finally below stops the vLLM server we started; inside the loop the
    # current step finishes, a checkpoint is written, and then the run exits.
    stop = {"in_loop": False, "requested": False}

    def on_sigterm(*_):
        if not stop["in_loop"]:
            sys.exit(128 + signal.SIGTERM)
        stop["requested"] = True

    signal.signal(signal.SIGTERM, on_sigterm)
    rank, world_size, device, mesh = setup_distributed(cfg)
    plan = cfg.batch_plan(world_size)
    torch.manual_seed(cfg.seed)
    os.makedirs(cfg.output_dir, exist_ok=True)
    policy = load_model(cfg, device, mesh)
    ref = EMAReference(load_model(cfg, device, mesh, reference=True), policy, cfg.alpha) if cfg.uses_reference else None
    optimizer, scheduler = make_optimizer(cfg, policy, cfg.num_training_steps * plan["optimizer_steps"], device)
    sampler = PromptSampler(train_rows, cfg.seed)
    # --- resume from the newest complete checkpoint, if there is one
    resume = [None]
    if rank == 0 and cfg.checkpoint_state_dir:
        checkpoint.remove_partials(cfg.checkpoint_state_dir)
        resume = [checkpoint.latest(cfg.checkpoint_state_dir)]
    dist.broadcast_object_list(resume, src=0)
    start = 0
    if resume[0]:
        try:
            trainer_state = checkpoint.load(resume[0], policy, ref, optimizer, scheduler, cfg)
        except ValueError as e:  # nothing is started or overwritten yet
            raise SystemExit(f"error: {e}") from None
        start, sampler.position = trainer_state["step"], trainer_state["sampler_position"]
    client, server, weights, rollouts = None, None, None, None
    # rewards scored in worker processes with a per-sample timeout; daemons: they end with this process
    pool = RewardPool(cfg.reward_fn or reward_fn, cfg.reward_workers, cfg.reward_timeout) if rank == 0 else None
    if rank == 0:
        info = tracking.run_info(cfg, world_size)
        with open(os.path.join(cfg.output_dir, "run_info.json"), "w") as f:
            json.dump(dict(info, skipped_rows=skipped, resumed_from=resume[0]), f, indent=2)
        print(f"run: {json.dumps(info['versions'])}, git {info['git_sha']}, world size {world_size}, device {device}")
        print(f"batch: {cfg.num_unique_prompts_rollout} prompts x {cfg.num_samples_per_prompt_rollout} samples = "
              f"{plan['sequences']} sequences -> {plan['mini_batches']} mini-batch(es) of {plan['per_mini_batch']} -> "
              f"{plan['per_rank']} per rank -> {plan['accumulation_steps']} micro-batch(es) of "
              f"{cfg.per_device_train_batch_size}; {plan['optimizer_steps']} optimizer step(s) per rollout")
        print(f"data: {len(train_rows)} train / {len(eval_rows)} eval prompts from {cfg.dataset!r}, skipped {skipped}; "
              f"reward {reward_fn.__name__}")
        if resume[0]:
            print(f"resumed from {resume[0]} (step {start})")
    try:
        # --- the vLLM server: ours, started on an untied copy of the policy, or the user's, given our weights
        log_path, served = os.path.join(cfg.output_dir, "vllm.log"), os.path.join(cfg.output_dir, "vllm_model")
        if rank == 0 and cfg.vllm_server_urls:
            client = rollout.VLLMClient(cfg.vllm_server_urls, None, cfg.vllm_request_timeout, cfg.vllm_max_retries)
        full = full_state_dict(policy)  # a collective: every rank takes part
        if rank == 0 and not cfg.vllm_server_urls:
            write_serving_dir(full, policy.config, tokenizer, served)
            server, url = rollout.launch_server(served, cfg, log_path)
            client = rollout.VLLMClient([url], served, cfg.vllm_request_timeout, cfg.vllm_max_retries,
                                        proc=server, log_path=log_path)
        del full
        weights = make_weight_sync(cfg, client, rank, device)
        if cfg.vllm_server_urls:  # the user's server starts from our weights
            weights.sync(policy)
        log = tracking.MetricsLog(cfg.output_dir, start, tracker) if rank == 0 else None
        if rank == 0 and cfg.eval_freq > 0 and eval_rows and not start:
            acc = evaluate(cfg, client, eval_rows, pool, tokenizer)
            log.write({"step": 0, "eval_accuracy": acc, "skipped_rows": skipped})
        restarts, skipped_in_a_row, saved, position = 0, 0, start, sampler.position
        max_staleness = cfg.async_steps if cfg.max_sample_staleness is None else cfg.max_sample_staleness
        make_batch = lambda j: rollout_batch(cfg, client, sampler, j, pool, tokenizer)  # noqa: E731
        rollouts = Rollouts(make_batch, start + 1, cfg.num_training_steps, cfg.async_steps) if rank == 0 else None

        def keep_and_raise(error, done):
            """A server failure we cannot repair: checkpoint what was trained (step `done`), then stop."""
            if cfg.checkpoint_state_dir and saved < done:
                checkpoint.save(cfg.checkpoint_state_dir, done, policy, ref, optimizer, scheduler, position, cfg,
                                cfg.keep_last_n_checkpoints)
            raise rollout.VLLMError(error)

        stop["in_loop"] = True
        bar = tqdm(range(start + 1, cfg.num_training_steps + 1), disable=rank != 0, desc="grpo", initial=start,
                   total=cfg.num_training_steps)
        for step in bar:
            t0 = time.perf_counter()
            m = {"step": step}
            # --- rollout and reward (rank 0 talks to vLLM; the batch is broadcast to every rank)
            while True:
                payload = [None]
                if rank == 0:
                    try:
                        samples, rollout_metrics = rollouts.get(step)
                        payload = [(*drop_stale(samples, client.version, max_staleness), rollout_metrics)]
                    except rollout.VLLMError as e:  # restart a server we launched that died; else stop
                        died = server is not None and server.poll() is not None
                        payload = [dict(error=str(e), restart=died and restarts < cfg.vllm_max_restarts)]
                dist.broadcast_object_list(payload, src=0)
                if isinstance(payload[0], tuple):
                    samples, stale_metrics, rollout_metrics = payload[0]
                    break
                if not payload[0]["restart"]:
                    keep_and_raise(payload[0]["error"], step - 1)
                restarts += 1
                if rank == 0:
                    tqdm.write(f"step {step}: the vLLM server died; restart {restarts} of {cfg.vllm_max_restarts}")
                    rollouts.close()
                    sampler.position = position  # this step's prompts again
                    rollout.stop_server(server)
                    server, _ = rollout.launch_server(served, cfg, log_path)
                    client.proc = server
                weights.close()
                weights = make_weight_sync(cfg, client, rank, device)
                weights.sync(policy)  # the restarted server gets the current weights
                if rank == 0:
                    rollouts = Rollouts(make_batch, step, cfg.num_training_steps, cfg.async_steps)
            position = rollout_metrics["prompts_seen"]  # the sampler's position a checkpoint of this step records
            if rank == 0:
                m.update(rollout_metrics, **stale_metrics, vllm_restarts=restarts, time_wait=time.perf_counter() - t0)
                log.write_samples(m.pop("samples", None))
            # --- train: old/ref logprobs, mini-batches x epochs, optimizer steps
            t2 = time.perf_counter()
            if cfg.single_gpu_mode:  # the server frees the GPU for training (its weights go to CPU memory)
                client.sleep()
            if samples:
                m.update(train_on_rollouts(cfg, policy, ref.model if ref else None, optimizer, scheduler, samples,
                                           rank, world_size, device, tokenizer.pad_token_id))
                if m["vllm_logp_diff_mean"] > cfg.vllm_logp_tolerance:
                    raise RuntimeError(f"step {step}: trainer and vLLM logprobs differ by {m['vllm_logp_diff_mean']:.3g} "
                                       f"on average (> vllm_logp_tolerance={cfg.vllm_logp_tolerance}): the last weight "
                                       f"sync did not take, or the server runs another dtype (vllm_dtype)")
                skipped_in_a_row = skipped_in_a_row + 1 if m["skipped_steps"] else 0
                if skipped_in_a_row >= cfg.max_consecutive_skipped_steps:
                    raise RuntimeError(f"step {step}: {skipped_in_a_row} steps in a row had a non-finite loss or "
                                       f"gradient norm (max_consecutive_skipped_steps): the run diverged; lower "
                                       f"learning_rate or resume from an earlier checkpoint")
            else:
                for _ in range(plan["optimizer_steps"]):
                    scheduler.step()
            m["time_train"] = time.perf_counter() - t2
            m["lr"] = scheduler.get_last_lr()[0]
            # --- EMA reference
            if ref is not None and cfg.ref_policy_update_freq and step % cfg.ref_policy_update_freq == 0:
                ref.update()
            # --- weight sync into vLLM
            t3 = time.perf_counter()
            if cfg.single_gpu_mode:  # awake before its weights are reloaded and it generates again
                client.wake_up()
            if samples:
                try:
                    weights.sync(policy)
                except rollout.VLLMError as e:  # raised on every rank; this step was trained: log and keep it
                    if rank == 0:
                        log.write(m)
                    keep_and_raise(str(e), step)
            m["time_sync"] = time.perf_counter() - t3
            # --- checkpoint and export (a SIGTERM on any rank stops every rank after this step's checkpoint)
            stopping = torch.tensor([float(stop["requested"])], device=device)
            dist.all_reduce(stopping, op=dist.ReduceOp.MAX)
            last = step == cfg.num_training_steps
            if cfg.checkpoint_state_dir and (step % cfg.checkpoint_state_freq == 0 or last or stopping.item()):
                checkpoint.save(cfg.checkpoint_state_dir, step, policy, ref, optimizer, scheduler, position, cfg,
                                cfg.keep_last_n_checkpoints)
                saved = step
            if last or (cfg.save_freq > 0 and step % cfg.save_freq == 0):
                full = full_state_dict(policy)
                if rank == 0:
                    checkpoint.export(full, policy.config, tokenizer,
                                      os.path.join(cfg.output_dir, "final" if last else f"step_{step}"))
                del full
            # --- evaluation and log
            if rank == 0:
                if cfg.eval_freq > 0 and (step % cfg.eval_freq == 0 or last):
                    m["eval_accuracy"] = evaluate(cfg, client, eval_rows, pool, tokenizer)
                m["time_step"] = time.perf_counter() - t0
                m["tokens_per_s"] = m.pop("response_tokens") / m["time_step"]
                m["peak_memory_gb"] = (torch.cuda.max_memory_allocated() if device.type == "cuda" else
                                       resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**30
                log.write(m)
            if stopping.item():
                if rank == 0:
                    print(f"SIGTERM: stopped after step {step}" + (f", checkpoint in {cfg.checkpoint_state_dir}"
                                                                    if cfg.checkpoint_state_dir else ""))
                return 128 + signal.SIGTERM
    finally:
        if rollouts:
            rollouts.close()
        if weights:
            weights.close()
        if rank == 0:
            rollout.stop_server(server)
    return 0


if __name__ == "__main__":
    try:
        cfg = parse_args()
    except ValueError as e:  # a contradiction between fields: one line, before anything starts
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    status = main(cfg)
    close_distributed()  # main's models are gone: the process group goes with them, before exit
    sys.exit(status)
