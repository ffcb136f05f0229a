"""Resumable checkpoints (torch.distributed.checkpoint, sharded) and Hugging Face exports.

    checkpoint_state_dir/
        step_00000040/           a complete checkpoint: resumed from automatically
            .metadata, *.distcp  policy, reference (+ its fp32 master), optimizer: each rank writes its shards
                                 (not the frozen parameters: with LoRA the base, the model's own files)
            trainer_state.pt     step, scheduler, sampler position, config (rank 0)
            rng_0.pt, rng_1.pt   each rank's RNG states
        step_00000050.partial/   being written, or killed while being written: never resumed from

A checkpoint is written under the `.partial` name, every file is fsynced, and rank 0
renames it only when every rank has finished: the rename is the commit. Only the newest
`keep_last_n_checkpoints` complete ones are kept, and an older one is removed only after
a newer one is complete, so a checkpoint that was reported saved is never lost.

Exports (`save_freq`, and always at the end) are plain Hugging Face directories:
safetensors, config, tokenizer. `AutoModelForCausalLM.from_pretrained` and a vLLM server
load them as they are.
"""

import dataclasses
import os
import random
import re
import shutil
from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from infra import ranks
from infra.options import default
from infra.weight_sync import full_state_dict

COMPLETE = re.compile(r"^step_(\d{8})$")

def resumable(cfg):
    """The config fields a resumed run may change (resumable=True in config.py): where and how often it
    writes, logs and evaluates, how long it waits, which servers it talks to, and how the same
    computation is laid out on ranks and memory. Every other change would make the resumed run another
    run; num_training_steps only with lr_scheduler_type="constant" (a decaying schedule's length is its shape)."""
    return {f.name for f in dataclasses.fields(cfg) if f.metadata["resumable"]}


def check_resumable(saved, cfg, path):
    """Refuse, in one line naming the fields, to resume from a checkpoint whose saved config
    (a dict) differs from cfg in a field outside resumable(cfg)."""
    now, free = asdict(cfg), resumable(cfg)
    changed = [k for k in now if k not in free and saved.get(k, default(cfg, k)) != now[k]]
    if cfg.lr_scheduler_type != "constant" and saved.get("num_training_steps") != cfg.num_training_steps:
        changed.append("num_training_steps")
    if changed:
        raise ValueError(f"cannot resume from {path}: the config changed in "
                         + ", ".join(f"{k} ({saved.get(k, default(cfg, k))!r} -> {now[k]!r})" for k in changed)
                         + "; resume with the saved values, or give a new checkpoint_state_dir to start another run")


def fsync(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state():
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def policy_state(policy, moved=()):
    """The policy's part of a checkpoint: its state dict less the frozen parameters, which a resumed run
    reads from model_name_or_path again (with LoRA the base: the part holds the adapters), save those
    in `moved`, which the reference moves (LoRA's EMA adapter, a frozen part of the policy's module)."""
    moved = {id(p) for p in moved}
    frozen = {name for name, p in policy.state_dict(keep_vars=True).items()  # the names get_model_state_dict gives
              if isinstance(p, torch.nn.Parameter) and not p.requires_grad and id(p) not in moved}
    return {k: v for k, v in get_model_state_dict(policy).items() if k not in frozen}


def sharded_state(train_state):
    """What DCP writes and reads in place: every tensor a DTensor shard on its own rank.
    For a fresh optimizer this initialises its state (a step at lr 0), so it can be loaded."""
    policy, ref = train_state.policy, train_state.ref
    state = {"policy": policy_state(policy, ref.ref_params if ref is not None else ()),
             "optimizer": get_optimizer_state_dict(policy, train_state.optimizer)}
    if ref is not None:
        state.update(ref.state_dict())  # {} where the policy's state holds it (LoRA's adapters)
    return state


def save(root, step, train_state, position, cfg, keep_last):
    """Write checkpoint `step` of `train_state` (update.TrainState; every rank calls it) and keep the
    newest `keep_last` complete ones. `position` is the prompt sampler's after the batch of `step`.
    Returns its path."""
    rank = dist.get_rank()
    final = os.path.join(root, f"step_{step:08d}")
    partial = final + ".partial"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    ranks.barrier()
    dcp.save(sharded_state(train_state), checkpoint_id=partial)  # fsyncs its files
    files = [(os.path.join(partial, f"rng_{rank}.pt"), rng_state())]
    if rank == 0:
        files.append((os.path.join(partial, "trainer_state.pt"),
                      dict(step=step, scheduler=train_state.scheduler.state_dict(), sampler_position=position,
                           config=asdict(cfg), world_size=dist.get_world_size())))
    for path, obj in files:
        torch.save(obj, path)
        fsync(path)
    ranks.barrier()  # every rank's shards are on disk
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)  # a re-run of the same step replaces it
        os.rename(partial, final)
        fsync(root)
        for old in complete(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    ranks.barrier()
    return final


def complete(root):
    """Complete checkpoints under root, oldest first."""
    if not root or not os.path.isdir(root):
        return []
    names = sorted(n for n in os.listdir(root) if COMPLETE.match(n))
    paths = [os.path.join(root, n) for n in names]
    return [p for p in paths if os.path.exists(os.path.join(p, ".metadata"))
            and os.path.exists(os.path.join(p, "trainer_state.pt"))]


def latest(root):
    found = complete(root)
    return found[-1] if found else None


def load(path, train_state, cfg=None):
    """Restore everything `save` wrote into train_state, in place, on every rank. Returns the trainer state
    (step, sampler_position, config, ...). A world size other than the saved one reshards; RNG states then
    come only for the ranks that existed. With cfg, first refuse a config that changes the run
    (check_resumable)."""
    trainer = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
    if cfg is not None:
        check_resumable(trainer["config"], cfg, path)
    state = sharded_state(train_state)
    policy, ref = train_state.policy, train_state.ref
    try:
        dcp.load(state, checkpoint_id=path)
    except CheckpointException as e:  # a traceback per rank; its last line says what did not fit
        cause = [line for line in str(e).splitlines() if line.strip()][-1].strip()
        raise ValueError(f"cannot resume from {path}: {cause[:300]}; it was written for another model or setup: "
                         "give a new checkpoint_state_dir, or the model it was made with") from None
    # Not strict: state["policy"] has the keys of policy_state, each one filled by dcp.load or refused
    # there; what it leaves out (the frozen parameters) stays as loaded from model_name_or_path.
    set_model_state_dict(policy, state["policy"], options=StateDictOptions(strict=False))
    set_optimizer_state_dict(policy, train_state.optimizer, state["optimizer"])
    if ref is not None:
        ref.load_state_dict(state)
    train_state.scheduler.load_state_dict(trainer["scheduler"])
    rng = os.path.join(path, f"rng_{dist.get_rank()}.pt")
    if os.path.exists(rng):
        set_rng_state(torch.load(rng, weights_only=False))
    return trainer


def remove_partials(root):
    """Checkpoints that were being written when a run died (rank 0, at start)."""
    if root and os.path.isdir(root):
        for n in os.listdir(root):
            if n.endswith(".partial"):
                shutil.rmtree(os.path.join(root, n), ignore_errors=True)


def export(cfg, policy, tokenizer, rank, name, transform=None):
    """A Hugging Face directory of the full policy in output_dir/name, replaced atomically (gathered on every
    rank, written by rank 0). transform(state_dict, name) -> state_dict runs first on rank 0: train.py hands
    LoRA's (the adapter merged in, and PEFT's adapter directory in output_dir/name_adapter)."""
    from safetensors.torch import save_file

    full = full_state_dict(policy)
    if rank != 0:
        return
    if transform is not None:
        full = transform(full, name)
    sd = {k: v.contiguous() for k, v in full.items()}
    if getattr(policy.config, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)  # stored once; from_pretrained ties it back
    out_dir = os.path.join(cfg.output_dir, name)
    tmp = out_dir + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(sd, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    policy.config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.rename(tmp, out_dir)
