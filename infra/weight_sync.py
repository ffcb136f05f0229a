"""Weight sync: the trainer's sharded weights into the vLLM server (update.py checks that a sync took:
the logprobs vLLM reports against the trainer's, before the step's first optimizer step).

Two transports behind one call, `sync(model)`, made on every rank and called on every rank (the
gathers are collectives); train.make_sync picks one. Each also gives a server we launch what it
starts from (launch_state_dict), its flags (server_flags) and whether a sync comes first:

- filesystem (default, CPU and GPU): gather the weights part by part (serving_parts: about
  PART_BYTES at a time), rank 0 writes each part as a safetensors file in the served dtype
  (vllm_server.server_dtype: float32 on a CPU, bfloat16 on GPUs; vLLM's loader copies each tensor
  into its parameter, casting as it goes) to memory-backed /dev/shm (or weight_sync_dir, a
  directory every server can read: servers on other nodes need a shared filesystem; sync_base)
  with the index that names them, asks each server to `reload_weights` through /collective_rpc and
  resets its prefix cache. Rank 0 holds one part at a time (LoRA's merge and the copy a launched
  server starts from take the whole state dict). The directory holds the whole serving copy from
  the first sync on, and a part more while one is written (write_weights); the memory plan
  checks its free space before the first step (free_bytes).
- nccl (GPU servers started with --weight-transfer-config '{"backend": "nccl"}'): vLLM's
  native weight-transfer API, in the server's dtype: nccl_sync.py, an optional file of its own.

Both are bounded by weight_sync_timeout: the reload request is an HTTP timeout; the NCCL
transfer, which would otherwise wait forever for a peer that is gone, runs in a thread
that is abandoned with a TimeoutError when it takes longer.

LoRA's syncs (the adapter, or the merged weights) are lora/sync.py's, picked by train.make_sync.

Tied embeddings: the CPU server's `reload_weights` does not refresh a tied LM head
("ParallelLMHead: Failed to load weights"), so the server always gets an untied copy:
config.json says tie_word_embeddings=false and the weights carry lm_head.weight equal to the
input embedding. It costs the server one vocab x hidden matrix.
"""

import json
import os
import re
import shutil

import torch

from infra.faults import VLLMError
from infra.tracking import private_dir

PART_BYTES = 2**27  # 128 MiB: rank 0 holds one part of the serving copy at a time (serving_parts; the memory plan's)


def full_state_dict(model):
    """The full, unsharded state dict, on CPU, on rank 0 (empty on other ranks).
    Every rank must call it: it gathers FSDP2/DTensor shards with collectives. In a world
    of one the tensors may alias the live parameters: copy them to keep a snapshot."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not dist.is_initialized():
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def untie(state_dict):
    """The serving copy of a state dict: lm_head.weight present (equal to the embedding for a
    tied model) and no tensor stored twice."""
    sd = {k: v.contiguous() for k, v in state_dict.items()}
    if "lm_head.weight" not in sd and "model.embed_tokens.weight" in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    elif "lm_head.weight" in sd and "model.embed_tokens.weight" in sd and \
            sd["lm_head.weight"].data_ptr() == sd["model.embed_tokens.weight"].data_ptr():
        sd["lm_head.weight"] = sd["lm_head.weight"].clone()
    return sd


def serving_parts(model, rank, budget=None, dtype=None, device=None):
    """Every rank: the serving copy of the model's weights in parts of about `budget` bytes
    (PART_BYTES; a larger tensor is a part of its own), each a {name: tensor} dict in CPU memory
    (in `dtype` if given) on rank 0, nothing on the others. Each DTensor is gathered whole by a
    collective (on `device` if given), in state-dict order, one at a time, so every rank runs it
    to the end. lm_head.weight is a tensor of its own, as untie makes it."""
    budget = PART_BYTES if budget is None else budget
    sd = model.state_dict()
    if "lm_head.weight" not in sd and "model.embed_tokens.weight" in sd:  # a tied head left out
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    part, size, stored = {}, 0, set()
    for name, t in sd.items():
        t = t.detach() if device is None else t.detach().to(device)
        whole = t.full_tensor() if hasattr(t, "full_tensor") else t
        if rank != 0:
            del whole  # one full tensor at a time
            continue
        whole = whole.to(dtype or whole.dtype).cpu().contiguous()
        n = whole.numel() * whole.element_size()
        if part and size + n > budget:
            yield part
            part, size, stored = {}, 0, set()
        if n and whole.data_ptr() in stored:  # the tied head undistributed: a file holds no storage twice
            whole = whole.clone()
        part[name], size = whole, size + n
        stored.add(whole.data_ptr())
    if part:
        yield part


def write_weights(parts, out_dir):
    """Write the serving copy into out_dir: each part ({name: tensor}; a whole state dict is one
    part, untied here) a safetensors file, then the index that names them, each file replacing
    its last version atomically: the last sync's files stay until each is replaced, so the directory
    holds a whole copy and the part being written (the memory plan's sync_dir). Consumes `parts`
    (serving_parts streams them); returns the bytes written."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    weight_map, nbytes = {}, 0
    for i, part in enumerate([untie(parts)] if isinstance(parts, dict) else parts):
        name = f"model-{i + 1:05d}.safetensors"
        save_file(part, os.path.join(out_dir, ".tmp"), metadata={"format": "pt"})
        os.replace(os.path.join(out_dir, ".tmp"), os.path.join(out_dir, name))
        weight_map.update(dict.fromkeys(part, name))
        nbytes += sum(v.numel() * v.element_size() for v in part.values())
        del part
    with open(os.path.join(out_dir, ".tmp"), "w") as f:  # vLLM loads the files the index names, no others
        json.dump({"metadata": {"total_size": nbytes}, "weight_map": weight_map}, f)
    os.replace(os.path.join(out_dir, ".tmp"), os.path.join(out_dir, "model.safetensors.index.json"))
    for stale in set(os.listdir(out_dir)) - set(weight_map.values()):  # an earlier layout's (transformers
        if re.fullmatch(r"model(-\d{5})?\.safetensors", stale):  # would read a model.safetensors first)
            os.remove(os.path.join(out_dir, stale))
    return nbytes


def write_serving_dir(state_dict, hf_config, tokenizer, out_dir):
    """A model directory the server can start from: untied config, tokenizer, weights."""
    os.makedirs(out_dir, exist_ok=True)
    cfg = hf_config.to_dict()
    cfg["tie_word_embeddings"] = False
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    tokenizer.save_pretrained(out_dir)
    write_weights(state_dict, out_dir)


class FilesystemSync:
    """Every rank gathers, part by part, while rank 0 writes each part as a safetensors file; then
    rank 0 asks each server to reload. `serving` turns the gathered state dict into what the servers
    get (LoRA's merge, lora/sync.py): it takes the whole state dict at once."""

    server_flags = ()  # a server we launch needs none for it (lora.sync.AdapterSync's: LoRA on)
    sync_at_start = False  # a server we launch needs no sync before it serves (AdapterSync's does)

    def __init__(self, client, rank, output_dir, timeout=None, base=None, serving=None, device=None, dtype=None):
        self.client, self.rank, self.dir, self.timeout, self.serving = client, rank, None, timeout, serving
        self.device = device  # where shards are gathered: offloaded (offload_params) ones too, over NCCL
        self.dtype = dtype  # of the parts written (the served dtype); None: as the trainer holds them
        if rank == 0:
            shared = base is not None  # weight_sync_dir: other machines' runs may write there too
            base = sync_base(base, output_dir)
            os.makedirs(base, exist_ok=True)
            # named for this process: a run killed by SIGKILL leaves its model copy, which the next run
            # removes (in a shared directory only a run of the machine that made it could tell it was dead)
            self.dir = private_dir("flatgrpo-weights-", base, clean=not shared)

    def launch_state_dict(self, model):
        """What a server we launch starts from, on rank 0 (every rank must call it: a gather):
        what a sync sends, whole."""
        sd = full_state_dict(model)
        return self.serving(sd) if self.serving and sd else sd

    def parts(self, model, gather_failed):
        """What a sync sends (every rank runs it to the end: gathers): serving_parts, or with
        `serving` (LoRA's merge, which needs every weight at once) the whole state dict as one
        part. A gather that fails (not the merge or a write: rank 0's alone) is marked in
        `gather_failed`: it is the trainer's own error, raised as it is."""
        try:
            if self.serving is None:
                yield from serving_parts(model, self.rank, dtype=self.dtype, device=self.device)
                return
            sd = full_state_dict(model)
        except Exception:
            gather_failed.append(True)
            raise
        if sd:
            yield untie(self.serving(sd))

    def sync(self, model):
        """Returns the bytes written (rank 0) or 0. A failed reload raises VLLMError on every
        rank, so all can save a checkpoint first; unless it failed because a server we
        launched died: then the next rollout restarts it and pushes the weights again."""
        gather_failed = []
        parts = self.parts(model, gather_failed)
        nbytes, error = 0, None
        if self.rank == 0:
            try:
                nbytes = write_weights(parts, self.dir)  # an OSError (a full /dev/shm) must reach every rank too
                with self.client.updating():  # in-flight generations finish first; new ones wait
                    self.client.reload_weights(self.dir, timeout=self.timeout)
            except Exception as e:  # noqa: BLE001 -- whatever it was, every rank must hear of it
                if gather_failed:
                    raise
                error = failure(self.client, e)
        for _ in parts:  # every gather on every rank: the other ranks', and those a failed write left on rank 0
            pass
        raise_on_every_rank(error)
        return nbytes

    def close(self):
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def failure(client, e):
    """Rank 0's message for a failed sync, printed; None when a server we launched died (the
    next rollout restarts it and pushes the weights again, so the run goes on)."""
    died = client.proc is not None and client.proc.poll() is not None
    print(f"weight sync failed{' (the server died; it will be restarted)' if died else ''}: {e}", flush=True)
    if died:
        return None
    return str(e) if isinstance(e, (VLLMError, TimeoutError)) else f"weight sync: {type(e).__name__}: {e}"


def raise_on_every_rank(error):
    """Rank 0's error (or None) to every rank, raised there as VLLMError, so every rank can save a
    checkpoint of the last finished step. The broadcast (on the CPU: infra/ranks.py) is also the barrier:
    the weights are in place."""
    from infra import ranks

    error = ranks.share(error)
    if error:
        raise VLLMError(error)


def sync_base(weight_sync_dir, output_dir):
    """Where rank 0 writes the serving copy: weight_sync_dir, else memory-backed /dev/shm when there is one
    we may write, else output_dir."""
    if weight_sync_dir is not None:
        return weight_sync_dir
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else output_dir


def free_bytes(path):
    """Free bytes of the filesystem that holds `path`, or would once it is made (its nearest existing
    parent: weight_sync_dir may not exist yet). A 64 MB /dev/shm, a container's default, says so here."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def served_dtype(cfg, cuda):
    """The dtype the servers we sync serve in, as vllm_server.server_dtype names it (vllm_dtype; "auto" the
    trainer's compute dtype), asked here and by the memory plan, which vllm_server imports."""
    return getattr(torch, cfg.vllm_dtype if cfg.vllm_dtype != "auto" else "bfloat16" if cuda else "float32")


def make_weight_sync(cfg, client, rank, device):
    """The filesystem transport, its parts in the served dtype; `.sync(model)` on every rank after each step
    (the NCCL one is nccl_sync.py's, LoRA's lora/sync.py's: train.make_sync picks)."""
    return FilesystemSync(client, rank, cfg.output_dir, cfg.weight_sync_timeout, cfg.weight_sync_dir, device=device,
                          dtype=served_dtype(cfg, torch.cuda.is_available()))
