"""LoRA's adapter out of the trainer: into the vLLM servers, and into the exports.

    sync = make_weight_sync(cfg, client, rank)   # train.make_sync, with lora_rank > 0
    export(full, cfg, adapter_dir)               # checkpoint.export: the adapter directory, the merged weights

The servers get the adapter itself (lora_weight_sync='adapter', AdapterSync: PEFT's adapter
directory, which vLLM's /v1/load_lora_adapter reads; the server runs with --enable-lora and one
we launch starts from the unmerged base), or, from a server without LoRA, full weights with the
adapter folded in (lora_weight_sync='merged': weight_sync.FilesystemSync with merge). The
trainer's base weights are never merged into: a merge is done on the gathered copy.

Its doors (lora/__init__.py lists all of LoRA's): train.py:make_sync (make_weight_sync, whose sync
carries the server's flags), train.py:export_transform (export), and the command line of a server you run,
scripts/serve.py:main (server_flags).
"""

import json
import os
import re
import shutil
import uuid

from lora.adapters import ADAPTER, adapter_parameters, is_adapter, peft_config
from infra.faults import VLLMError
from infra.weight_sync import FilesystemSync, failure, full_state_dict, raise_on_every_rank

VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank values (config/lora.py)


# --- the adapter as files, and merged into full weights


def peft_key(name, adapter=ADAPTER):
    """A parameter's name as PEFT's adapter_model.safetensors spells it (what vLLM reads)."""
    name = name.replace("_checkpoint_wrapped_module.", "").replace(f".{adapter}.", ".")
    return "base_model.model." + name


def gather_adapter(model, rank, adapter=ADAPTER):
    """Every rank (each full_tensor() is a collective, in the same order on every rank): the
    adapter's full tensors, in PEFT's file names, on rank 0 in CPU memory; {} on the others."""
    out = {}
    for name, p in adapter_parameters(model, adapter):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        if rank == 0:
            out[peft_key(name, adapter)] = full.cpu().contiguous()
    return out


def write_adapter(tensors, cfg, out_dir):
    """PEFT's adapter directory (adapter_model.safetensors, adapter_config.json), which
    PeftModel.from_pretrained and vLLM's load_lora_adapter read; replaced atomically. Returns
    the bytes of the tensors."""
    from safetensors.torch import save_file

    tmp = out_dir.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = peft_config(cfg).to_dict()
    config["target_modules"] = sorted({re.sub(r"\.lora_[AB]\.weight$", "", k).rsplit(".", 1)[-1] for k in tensors})
    with open(os.path.join(tmp, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2, default=list)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.rename(tmp, out_dir)
    return sum(v.numel() * v.element_size() for v in tensors.values())


def base(state_dict):
    """The base model's state dict under its own names (PEFT's ...q_proj.base_layer.weight is
    ...q_proj.weight), every adapter tensor dropped: what a server that loads the adapter starts from."""
    return {key.replace(".base_layer.", "."): value for key, value in state_dict.items() if ".lora_" not in key}


def merge(state_dict, cfg):
    """The base model's state dict with the trained adapter folded in, W + (lora_alpha / lora_rank)
    B A, under the base's own names; every adapter tensor dropped. The input is a full state dict
    (weight_sync.full_state_dict), not the live parameters."""
    scale = cfg.lora_alpha / cfg.lora_rank
    out = base(state_dict)
    for key, a in state_dict.items():
        if key.endswith(f".lora_A.{ADAPTER}.weight"):
            layer = key[:-len(f".lora_A.{ADAPTER}.weight")]
            w, b = out[f"{layer}.weight"], state_dict[f"{layer}.lora_B.{ADAPTER}.weight"]
            out[f"{layer}.weight"] = (w.double() + scale * (b.double() @ a.double())).to(w.dtype)
    return out


def export(full, cfg, adapter_dir):
    """An export's weights (a full state dict): PEFT's adapter directory written to adapter_dir, and
    the adapter merged in."""
    write_adapter({peft_key(k): v for k, v in full.items() if is_adapter(k, ADAPTER)}, cfg, adapter_dir)
    return merge(full, cfg)


# --- into the servers


def serves_adapter(cfg):
    """Whether the servers get the adapter itself (lora_weight_sync='adapter', AdapterSync) rather
    than full weights."""
    return bool(cfg.lora_rank) and cfg.lora_weight_sync == "adapter"


def server_flags(cfg):
    """vllm serve's flags for a server we launch: LoRA on when each sync loads the new adapter by name."""
    if not serves_adapter(cfg):
        return []
    rank = next(r for r in VLLM_MAX_LORA_RANKS if r >= cfg.lora_rank)
    return ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "1"]


def make_weight_sync(cfg, client, rank):
    """The LoRA run's weight sync (config.py allows it the filesystem transport alone): the adapter
    (AdapterSync), or full weights with the adapter merged in."""
    if serves_adapter(cfg):
        return AdapterSync(client, rank, cfg.output_dir, cfg.weight_sync_timeout, cfg.weight_sync_dir, cfg)
    return FilesystemSync(client, rank, cfg.output_dir, cfg.weight_sync_timeout, cfg.weight_sync_dir,
                          serving=lambda sd: merge(sd, cfg))


class AdapterSync(FilesystemSync):
    """LoRA (lora_weight_sync='adapter'): gather the trained adapter alone; rank 0 writes PEFT's
    adapter directory and each server loads it under a new name (/v1/load_lora_adapter), which
    every later request names; the previous adapter is then unloaded. A new name is a new LoRA id
    in vLLM, and its prefix cache is keyed by that id: no cached prefix of the old adapter serves a
    new request (the cache is reset too, as after a full-weight sync)."""

    sync_at_start = True  # a server we launch serves the base until the first sync loads the adapter

    def __init__(self, client, rank, output_dir, timeout=None, base=None, cfg=None):
        super().__init__(client, rank, output_dir, timeout, base)
        self.cfg, self.server_flags = cfg, server_flags(cfg)
        self.tag, self.syncs, self.loaded = uuid.uuid4().hex[:8], 0, None  # names unique across runs of one server

    def launch_state_dict(self, model):
        """The base alone, since each sync loads the adapter on top of it; merged weights there would hold
        it twice (vLLM computing W + 2 s B A once lora_B has moved, as after a resume)."""
        return base(full_state_dict(model))

    def sync(self, model):
        tensors = gather_adapter(model, self.rank)  # a collective per tensor
        nbytes, error = 0, None
        if self.rank == 0:
            try:
                self.syncs += 1
                name = f"policy-{self.tag}-{self.syncs}"
                path = os.path.join(self.dir, name)
                nbytes = write_adapter(tensors, self.cfg, path)
                with self.client.updating():  # in-flight generations finish on the old adapter; new ones wait
                    self.load(name, path)
                    self.client.model = name  # what every request names from now on
                    if self.loaded:
                        self.client.broadcast("/v1/unload_lora_adapter", {"lora_name": self.loaded})
                        shutil.rmtree(os.path.join(self.dir, self.loaded), ignore_errors=True)
                    self.loaded = name
                    self.client.reset_prefix_cache()
            except Exception as e:  # noqa: BLE001 -- whatever it was, every rank must hear of it
                error = failure(self.client, e)
        raise_on_every_rank(error)
        return nbytes

    def load(self, name, path):
        """Each server loads the adapter directory `path` as model `name` (vLLM's runtime LoRA
        routes: the server runs with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)."""
        try:
            self.client.broadcast("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}, timeout=self.timeout)
        except VLLMError as e:
            raise VLLMError(f"weight sync: {e}\n(a server you run needs --enable-lora, --max-lora-rank >= "
                            "lora_rank and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; or set lora_weight_sync=merged)") from None
