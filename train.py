"""GRPO on PyTorch FSDP2 with rollouts from a vLLM server and an EMA reference policy.

    .venv/bin/python scripts/make_tiny_model.py --out models/tiny   # a random 0.3 M model
    .venv/bin/python train.py --num_training_steps 20              # one process (breakpoint() works)
    .venv/bin/torchrun --nproc_per_node 2 train.py --output_dir output/demo  # 2 CPU ranks (gloo)
    torchrun --nproc_per_node 8 train.py --model_name_or_path Qwen/Qwen2.5-0.5B --dataset my.jsonl \
        --vllm_server_urls http://gpu-node:8000                  # 8 GPUs (nccl), your vLLM server
    torchrun --nproc_per_node 2 train.py --checkpoint_state_dir ckpt --checkpoint_state_freq 50  # resumes by itself
    torchrun --nproc_per_node 2 train.py --async_steps 1 --truncated_importance_sampling_ratio_cap 2  # generate ahead
    python train.py --help                                       # every config field

One step: rank 0 asks vLLM for completions, scores them and computes group advantages
(generator.py, rollout.py); every rank gets the batch, computes old/reference logprobs,
and trains on its share (update.py; FSDP2, one fully_shard per decoder layer then the
root); an EMA reference (ref_policy_update_freq) moves toward the policy (one foreach lerp on local shards); the
weights go back into vLLM; every checkpoint_state_freq steps each rank writes its shards
(checkpoint.py). With async_steps=k the batches of the next k steps are generated while
this one trains.

Where this differs from the papers:
- Advantages use the group std with Bessel's correction (like TRL), eps 1e-6.
- The "token" denominator counts the valid tokens of the whole optimizer step over all
  ranks and micro-batches (not a per-micro-batch mean, which overweights short answers).
- Logprobs, old and new, are taken at the sampling temperature (vLLM reports
  temperature-processed logprobs too), so the ratio compares the policies that sampled.
- With one mini-batch and one epoch, old_logp is the detached new logp (ratio 1, one
  forward pass saved). Every step compares vLLM's sampling logprobs with the trainer's
  on the first mini-batch, over the samples the current weights produced, and before its
  first optimizer step: a sync that did not take stops the run with the last good step's
  weights (and checkpoint).
"""

import contextlib
import os
import resource
import signal
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

import packing
from config import Config
from data import DRY_COMPLETION, PromptSampler, dry_call, load_prompts
from episodes import Completions
from packing import batch_plan
from reference import make_reference
from rollout import evaluate, rollout_batch
from update import TrainState, check_health, make_optimizer, train_on_batch
from infra import checkpoint, colocation, memory, ranks, tracking, vllm_server
from infra.cli import parse_args_or_exit
from infra.faults import Refused, SyncError, VLLMError
from infra.generator import Generator
from infra.model_files import load_model_config, load_tokenizer, locate_model
from infra.parallel import close_distributed, load_model, mesh_shape, setup_distributed
from infra.policy import check_model_config, check_vocabulary
from infra.vllm_server import server_dtype
from infra.weight_sync import make_weight_sync
from infra.worker_pool import RewardPool


def check_model(cfg, tokenizer, cuda):
    """The model's config.json against what the trainer implements: its vocabulary, its LM head and
    layout, LoRA's targets, the heads sequence parallelism splits, a teacher's tokenizer. ValueError naming
    the fix. Returns the config and the model built on the meta device (LoRA's adapters in it), for the
    memory plan."""
    if cfg.teacher_model_name_or_path:
        from distill import teacher  # noqa: PLC0415 - the optional concept's door
        teacher.check(cfg, tokenizer, cuda)
    model_config = load_model_config(cfg)
    check_vocabulary(model_config, cfg.kl_topk)
    meta_model = check_model_config(model_config)  # an LM head or layout the logprobs do not implement
    if cfg.lora_rank:  # LoRA targets the model lacks, or outside its decoder layers
        from lora import adapters  # noqa: PLC0415 - the optional concept's door
        adapters.check(meta_model, cfg)
    if cfg.sequence_parallel_size > 1:
        from sequence_parallel import check_heads  # noqa: PLC0415 - the optional concept's door
        check_heads(model_config, cfg.sequence_parallel_size)
    return model_config, meta_model


def server_plan(cfg, model_config, meta_model, cuda):
    """{item: bytes} of the servers we launch (infra/memory.py): the policy's and, distilling, the teacher's
    (distill/teacher.py, its door)."""
    plan = memory.server_plan(cfg, model_config, meta_model, cuda)
    if cfg.teacher_model_name_or_path:
        from distill import teacher  # noqa: PLC0415 - the optional concept's door
        plan |= teacher.server_plan(cfg, cuda)
    return plan


def choose_player(cfg, tokenizer):
    """What plays the episodes (episodes.Player), and the environment whose first messages the prompts
    start with, if any. The optional concepts' doors: envs/ (--environment) and agent_programs/ (--agent)."""
    if cfg.environment:  # episodes of several turns, answered by an environment
        from envs.environment import Environment  # noqa: PLC0415 - the optional concept's one door
        env = Environment(cfg.environment, tokenizer, cfg)
        return env, env
    if cfg.agent_program:  # episodes played by a program, through the gateway
        try:
            from agent_programs.runner import Agents  # noqa: PLC0415 - the optional concept's one door
        except ModuleNotFoundError as e:  # agent_programs/ or envs/, which it uses, deleted
            raise ValueError(f"--agent needs agent_programs/ and envs/ ({e}); restore them, or run without an "
                             "agent") from None
        return Agents(cfg, tokenizer), None
    return Completions(cfg, tokenizer), None


def load_inputs(cfg):
    """Before any process group, model or server: the tokenizer, the player, the prompts, the reward,
    the memory plan and the tracker, each checked; bad input exits with one line naming the fix (exit 2)."""
    rank0, world = int(os.environ.get("RANK", 0)) == 0, int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available()
    try:
        colocation.check_launch(cfg, cuda)  # where our vLLM server would go, before any model
        mesh_shape(cfg, world)  # a world the mesh does not fit
        locate_model(cfg.model_name_or_path)  # in seconds offline, not after the hub's minute of retries
        tokenizer = load_tokenizer(cfg)
        model_config, meta_model = check_model(cfg, tokenizer, cuda)
        tracking.make_dirs(cfg)  # output_dir claimed: a second run into it stops here
        if rank0:
            vllm_server.check_vllm(cfg)  # the servers you run answer; every vLLM is the pinned one
        player, env = choose_player(cfg, tokenizer)
        train_rows, eval_rows, skipped, reward_fn = load_prompts(cfg, tokenizer, env)
        if rank0 and cfg.reward_fn:  # called once on a real row, in seconds: a value of the wrong length stops here
            ids = tokenizer(DRY_COMPLETION, add_special_tokens=False)["input_ids"]
            for line in dry_call(cfg.reward_fn, cfg.reward_weights, train_rows[0], ids, cfg.reward_timeout,
                          player.multi_turn):
                print(f"warning: {line}", file=sys.stderr)
        plan = (memory.trainer_plan(cfg, model_config, meta_model, world, cuda),
                server_plan(cfg, model_config, meta_model, cuda),  # then a colocated GPU's headroom, the host's
                *memory.node_plan(cfg, model_config, meta_model, world, cuda, colocation.colocated(cfg, cuda)))
        if rank0:  # this node's ranks and our server against its memory, or a rank against its GPU
            memory.check(cfg, *plan, int(os.environ.get("LOCAL_WORLD_SIZE", world)), cuda)
            if cuda and colocation.colocated(cfg, cuda):  # what the plan leaves a server on the training GPUs
                colocation.fraction(cfg, *plan, int(os.environ.get("LOCAL_WORLD_SIZE", world)),
                                    torch.cuda.mem_get_info()[1])
        return (tokenizer, player, (train_rows, eval_rows, skipped, reward_fn), plan,
                tracking.open_tracker(cfg) if rank0 else None)
    except ValueError as e:
        if rank0:
            print(f"error: {e}", file=sys.stderr)
        else:  # torchrun ends every rank when one exits: rank 0 says why first
            time.sleep(5)
        sys.exit(2)


def what_scores(cfg, player, reward_fn):
    """The reward, as the data: line names it: an environment or an agent that scores its episodes,
    plus a --reward_fn you set (an agent's None left to the reward), or the reward alone."""
    reward = ", ".join(getattr(fn, "__name__", str(fn)) for fn in (reward_fn if isinstance(reward_fn, list) else
                                                                   [reward_fn]))
    if not player.scores:
        return reward
    return (f"{player.name}'s {'return' if cfg.agent_program else 'own'}" + (
        f" + {cfg.reward_fn}" if cfg.reward_fn else f" (None: {reward})" if cfg.agent_program else ""))


def announce(cfg, plan, memory_plan, world_size, device, data, player, resumed_from, start, policy):
    """Rank 0, before step 0: what reproduces the run (run_info.json), the batch arithmetic, the memory
    plan, the data."""
    train_rows, eval_rows, skipped, reward_fn = data
    tracking.write_run_info(cfg, world_size, device, skipped_rows=skipped, resumed_from=resumed_from,
                            memory_plan=[{k: v / memory.GB for k, v in part.items()} for part in memory_plan])
    print(packing.describe(cfg, plan))
    print(memory.describe(*memory_plan))
    if line := packing.unshared_reason(cfg):
        print(line)
    print(f"data: {len(train_rows)} train / {len(eval_rows)} eval prompts from {cfg.dataset!r}, skipped {skipped}; "
          f"reward {what_scores(cfg, player, reward_fn)}")
    if cfg.lora_rank:
        from lora import adapters  # noqa: PLC0415 - the optional concept's door
        print(adapters.describe(policy, cfg))
    if resumed_from:
        print(f"resumed from {resumed_from} (step {start})")


def model_doors(cfg):
    """What load_model is handed: the attention and the policy's converter. With sequence parallelism
    (sequence_parallel.py, its door) its rank groups, made now, and packed_sdpa over whole rows between two
    all-to-alls for every model; with LoRA (lora/adapters.py, its door) its adapters, injected before the
    sharding so that each is sharded with its layer."""
    attn, convert = cfg.attn_implementation, None
    if cfg.sequence_parallel_size > 1:
        import sequence_parallel  # noqa: PLC0415 - the optional concept's door
        sequence_parallel.init_groups(cfg.sequence_parallel_size)  # consecutive ranks: inside a shard group
        attn = sequence_parallel.register_attention()
    if cfg.lora_rank:
        from lora import adapters  # noqa: PLC0415 - the optional concept's door
        convert = lambda model: adapters.add_adapters(model, cfg)  # noqa: E731
    return attn, convert


def build_state(cfg, device, mesh, plan):
    """The TrainState train.py starts from: the sharded policy, its reference, AdamW and the schedule."""
    attn, convert = model_doors(cfg)
    policy = load_model(cfg, device, mesh, attn=attn, convert=convert)
    ref = make_reference(cfg, policy, lambda: load_model(cfg, device, mesh, reference=True, attn=attn))
    optimizer, scheduler = make_optimizer(cfg, policy, cfg.num_training_steps * plan["optimizer_steps"], device)
    return TrainState(policy, ref, optimizer, scheduler)


def resume(cfg, rank, state, sampler):
    """Load the newest complete checkpoint, if there is one. Returns (its path or None, its step)."""
    path = None
    if rank == 0 and cfg.checkpoint_state_dir:
        checkpoint.remove_partials(cfg.checkpoint_state_dir)
        path = checkpoint.latest(cfg.checkpoint_state_dir)
    path = ranks.share(path)
    if not path:
        return None, 0
    try:
        saved = checkpoint.load(path, state, cfg)
    except ValueError as e:  # nothing is started or overwritten yet
        raise SystemExit(f"error: {e}") from None
    sampler.position = saved["sampler_position"]
    return path, saved["step"]


def train_step(cfg, state, samples, plan, gen, world_size, device):
    """The update on this step's batch (update.py); its metrics. A colocated server sleeps meanwhile
    (its weights in host memory) and wakes in gen.sync."""
    gen.sleep()
    m = {}
    if samples:
        m = train_on_batch(cfg, state, samples, dist.get_rank(), world_size, device)
    else:  # every group was filtered out: no update, the schedule still moves
        for _ in range(plan["optimizer_steps"]):
            state.scheduler.step()
    return m


@contextlib.contextmanager
def timed(m, key):
    """m[key] = the seconds the block took."""
    start = time.perf_counter()
    try:
        yield
    finally:
        m[key] = time.perf_counter() - start


def finish_log(cfg, log, m, evaluate_now, last, started, device, trainer_plan):
    """Rank 0: evaluation when due (evaluate_now(): its metrics), the step's time, throughput, peak memory
    and the memory plan at the step's largest micro-batch (GB = 1e9 bytes), then one log line."""
    if cfg.eval_freq > 0 and (m["step"] % cfg.eval_freq == 0 or last):
        m.update(evaluate_now())
    m["time_step"] = time.perf_counter() - started
    m["tokens_per_s"] = m.pop("response_tokens") / m["time_step"]
    m["peak_memory_gb"] = (torch.cuda.max_memory_allocated() if device.type == "cuda" else
                           resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / memory.GB
    if "micro_batch_tokens" in m:  # a step that trained
        m["memory_plan_gb"] = memory.at_tokens(trainer_plan, m.pop("micro_batch_tokens")) / memory.GB
    log.write(m)


def make_sync(cfg):
    """How weights go into the servers, for the generator: make(client, rank, device) -> a weight sync.
    The full weights through files (infra/weight_sync.py) or NCCL (nccl_sync.py, its door), or with LoRA
    the adapter's or the merged weights' (lora/sync.py, LoRA's door): each imported only then."""
    if cfg.lora_rank:
        from lora import sync as lora_sync  # noqa: PLC0415 - the optional concept's door
        return lambda client, rank, device: lora_sync.make_weight_sync(cfg, client, rank)
    if cfg.weight_sync_transport == "nccl":
        from nccl_sync import NCCLSync  # noqa: PLC0415 - the optional concept's door
        return lambda client, rank, device: NCCLSync(client, rank, cfg.weight_sync_master_address,
                                                     cfg.weight_sync_master_port, device, cfg.weight_sync_timeout,
                                                     getattr(torch, server_dtype(cfg)))
    return lambda client, rank, device: make_weight_sync(cfg, client, rank, device)


def export_transform(cfg):
    """What an export does first to the gathered weights (checkpoint.export): with LoRA, the adapter
    merged in and written apart as PEFT's directory (lora/sync.py, LoRA's door); else nothing."""
    if not cfg.lora_rank:
        return None
    from lora import sync as lora_sync  # noqa: PLC0415 - the optional concept's door
    return lambda full, name: lora_sync.export(full, cfg, os.path.join(cfg.output_dir, f"{name}_adapter"))


def evaluation(gen, eval_rows, pool, player):
    """Rank 0: greedy accuracy on the held-out prompts (and with episodes of several turns the fraction
    that called a tool), as metrics."""
    accuracy, tool_calls = evaluate(gen.client, eval_rows, pool, player)
    return dict(eval_accuracy=accuracy, **({"eval_tool_calls": tool_calls} if player.multi_turn else {}))


def save(cfg, state, step, position, tokenizer, rank, stopping):
    """A checkpoint when due (and at the last step, or on a SIGTERM), then an export when due. Returns
    whether a checkpoint was written."""
    last = step == cfg.num_training_steps
    saved = bool(cfg.checkpoint_state_dir) and (step % cfg.checkpoint_state_freq == 0 or last or stopping)
    if saved:
        checkpoint.save(cfg.checkpoint_state_dir, step, state, position, cfg, cfg.keep_last_n_checkpoints)
    if last or (cfg.save_freq > 0 and step % cfg.save_freq == 0):
        checkpoint.export(cfg, state.policy, tokenizer, rank, "final" if last else f"step_{step}", export_transform(cfg))
    return saved


def keep_trained(cfg, state, log, m, trained, saved, position):
    """A run that stops inside a step: log the step if it trained (m: its metrics, else None) and checkpoint the
    last trained step (not twice: the last checkpoint may be it). Every rank calls it. Returns the step saved."""
    if log is not None and m is not None:
        m.pop("micro_batch_tokens", None)
        log.write(m)
    if cfg.checkpoint_state_dir and saved < trained:
        checkpoint.save(cfg.checkpoint_state_dir, trained, state, position, cfg, cfg.keep_last_n_checkpoints)
        return trained
    return saved


def stopped(cfg, rank, step):
    """A SIGTERM's (or a gone launcher's) end: one line on rank 0, exit status 143."""
    if rank == 0:
        print(f"SIGTERM: stopped after step {step}" + (f", checkpoint in {cfg.checkpoint_state_dir}"
                                                        if cfg.checkpoint_state_dir else ""))
    return 128 + signal.SIGTERM


def main(cfg: Config):
    """One run; returns the exit status (0, or 143 after a SIGTERM). The caller then calls
    close_distributed(), once the run's models are out of scope."""
    tokenizer, player, data, memory_plan, tracker = load_inputs(cfg)
    train_rows, eval_rows, skipped, reward_fn = data
    rank, world_size, device, mesh = setup_distributed(cfg)
    plan = batch_plan(cfg, world_size)
    torch.manual_seed(cfg.seed)  # before the models: LoRA's lora_A is drawn, the same on every rank
    state = build_state(cfg, device, mesh, plan)
    sampler = PromptSampler(train_rows, cfg.seed)
    resumed_from, start = resume(cfg, rank, state, sampler)
    # rewards in worker processes with a per-sample timeout (daemons); a failed one is NaN, never trained on
    pool = RewardPool(cfg.reward_fn or reward_fn, cfg.reward_workers, cfg.reward_timeout, fallback=float("nan"),
                      weights=cfg.reward_weights) if rank == 0 else None
    log = tracking.MetricsLog(cfg.output_dir, start, tracker) if rank == 0 else None
    if rank == 0:
        announce(cfg, plan, memory_plan, world_size, device, data, player, resumed_from, start, state.policy)
    gen, saved, trained, skipped_in_a_row = None, start, start, 0
    try:
        # inside the try: a server we launched is stopped (finally) however the run ends, its start included
        batch = (lambda client, step: rollout_batch(cfg, client, sampler, step, pool, tokenizer, player))  # rank 0
        gen = Generator(cfg, state.policy, tokenizer, rank, device, batch, make_sync(cfg), sampler, player, memory_plan)
        if rank == 0 and cfg.eval_freq > 0 and eval_rows and not start:  # a resumed run has its step 0 logged
            log.write({"step": 0, **evaluation(gen, eval_rows, pool, player), "skipped_rows": skipped})
        ranks.R.in_loop = True  # a SIGTERM now stops every rank after a step (infra/ranks.py), not at once
        for step in tqdm(range(start + 1, cfg.num_training_steps + 1), disable=rank != 0, desc="grpo",
                         initial=start, total=cfg.num_training_steps):
            started, position = time.perf_counter(), gen.position  # the sampler after the last trained step
            try:
                # --- batch: rank 0 generates and scores (or takes what was generated ahead); every rank gets it
                samples, rollout_metrics = gen.batch(step, state.policy)
                m = dict(step=step, **rollout_metrics, time_wait=time.perf_counter() - started)
                if rank == 0:
                    log.write_samples(m.pop("samples", None))
                # --- train: old/ref logprobs, mini-batches x epochs, updates (the sync check comes first)
                with timed(m, "time_train"):
                    m.update(train_step(cfg, state, samples, plan, gen, world_size, device))
                    if samples:  # a step whose groups were all filtered out takes no update to judge
                        skipped_in_a_row = skipped_in_a_row + 1 if m["skipped_updates"] else 0
                        check_health(cfg, step, skipped_in_a_row)
                trained, m["lr"] = step, state.scheduler.get_last_lr()[0]
                # --- EMA reference. Part of the step, so before the sync: a failed sync checkpoints this
                # step (trained == step), and a run resumed from there must find the reference moved
                if state.ref is not None:
                    state.ref.step(step)
                # --- weight sync into vLLM
                with timed(m, "time_sync"):  # a colocated server's wake-ups too, synced or not
                    gen.sync(state.policy, trained=bool(samples))
            except (VLLMError, SyncError, Refused, ranks.Stop) as e:  # a server we cannot repair, a sync that did
                # not take (found before the step's update: vLLM would go on sampling from other weights than
                # these, and training on its samples would be off-policy unseen), a step nobody could score, or a
                # SIGTERM while rank 0 drove the server: keep what was trained, then stop
                saved = keep_trained(cfg, state, log, m if trained == step else None, trained, saved,
                                     gen.position if trained == step else position)
                if not isinstance(e, ranks.Stop):
                    raise
                return stopped(cfg, rank, trained)
            # --- checkpoint and export. A SIGTERM reaches the ranks at different moments; asking them all
            # (a collective) stops every rank after the same step, where one rank alone would leave the
            # others waiting in the next step's collectives
            stopping = ranks.stopping()
            saved = step if save(cfg, state, step, gen.position, tokenizer, rank, stopping) else saved
            if rank == 0:  # --- evaluation and log
                finish_log(cfg, log, m, lambda: evaluation(gen, eval_rows, pool, player), step == cfg.num_training_steps,
                           started, device, memory_plan[0])
            if stopping:
                return stopped(cfg, rank, step)
    finally:
        if gen:
            gen.close()
    return 0


if __name__ == "__main__":
    cfg = parse_args_or_exit(Config)
    try:
        status = main(cfg)
    except (Refused, VLLMError, SyncError) as e:  # nobody could score, a server not up or past repair, a sync that
        # did not take: every rank is here (infra/ranks.py carried it), rank 0 says it in one line (main wrote
        # the last good step's checkpoint)
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {e}", file=sys.stderr)
        status = 1
    except ranks.Ended as e:  # another rank failed (and said why), or our launcher is gone: no barrier to meet
        ranks.exit_now(e.status)
    except SystemExit as e:  # a SIGTERM before the loop (infra/ranks.py): every rank was told, none failed
        if e.code != 128 + signal.SIGTERM:
            ranks.abort()
        raise
    except BaseException:  # this rank failed: every other rank ends within seconds, this one says why
        if ranks.failed_elsewhere():  # or another rank did first, and this is the echo (a peer's closed socket)
            ranks.exit_now(1)
        ranks.abort()
        raise
    finally:
        ranks.ending()  # torchrun's SIGTERM, once a rank has exited, no longer breaks into this one's exit
    close_distributed()  # main's models are gone: the process group goes with them, before exit
    sys.exit(status)
