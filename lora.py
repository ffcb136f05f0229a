"""LoRA: low-rank adapters trained on a frozen base (PEFT), and a reference that is an adapter.

    torchrun --nproc_per_node 2 train.py --lora_rank 16 --lora_target_modules all-linear

The adapters are injected into the Hugging Face model before FSDP2 shards it (PEFT's
inject_adapter_in_model: the model keeps its class and layout), so each adapter matrix is
sharded like the layer it adapts. Only the trained adapter ("default") requires a gradient;
the optimizer holds state for it alone.

The reference is the policy's own module with another adapter active, never a second model:
- fixed (beta > 0, ref_policy_update_freq None): the adapters switched off, i.e. the base;
- EMA (ref_policy_update_freq): a second adapter, "reference", injected beside the trained one,
  equal to it at the start and moved toward it by reference.EMAReference's one foreach lerp
  over the local shards of the two (its shards sit on the same rank: no collective). It costs
  one adapter of memory instead of a model.

The server gets the adapter itself (weight_sync.AdapterSync: PEFT's adapter directory, which
vLLM's /v1/load_lora_adapter reads), or, from a server without LoRA, full weights with the
adapter folded in (merge). The trainer's base weights are never merged into: a merge is done
on the gathered copy.
"""

import contextlib
import json
import os
import re
import shutil
import warnings

import torch

ADAPTER, REFERENCE = "default", "reference"  # the trained adapter (PEFT's default name) and the EMA reference's
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's max_lora_rank values (config/lora.py)


def peft_config(cfg):
    from peft import LoraConfig

    targets = cfg.lora_target_modules
    return LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules="all-linear" if targets == ["all-linear"] else targets,
                      base_model_name_or_path=cfg.model_name_or_path)


def add_adapters(model, cfg):
    """Inject the trained adapter (and, for the EMA reference, its copy) into `model` in place and
    freeze everything else. Every rank draws the same lora_A (train.py seeds torch first), so the
    shards FSDP2 keeps of each rank's full tensor agree. A target module the model lacks, or one
    outside the decoder layers' linear modules (check_targets), is a ValueError naming it. Without
    lora_rank, nothing."""
    from peft import inject_adapter_in_model

    if not cfg.lora_rank:
        return

    config = peft_config(cfg)
    names = [n for n, _ in model.named_modules()]
    if missing := [t for t in cfg.lora_target_modules if t != "all-linear" and not
                   any(n == t or n.endswith("." + t) for n in names)]:  # PEFT refuses only when none is found
        raise ValueError(f"lora_target_modules: {type(model).__name__} has no module named {', '.join(missing)}; "
                         "use its own names (q_proj, v_proj, ...) or all-linear")
    try:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
        if cfg.uses_reference and cfg.ref_policy_update_freq:
            with warnings.catch_warnings():  # PEFT warns that a second adapter is a second adapter
                warnings.filterwarnings("ignore", message="Already found a `peft_config`")
                inject_adapter_in_model(config, model, adapter_name=REFERENCE)
    except ValueError as e:
        raise ValueError(f"lora_target_modules={','.join(cfg.lora_target_modules)}: {str(e).splitlines()[0]} "
                         "(PEFT names: q_proj, v_proj, ..., or all-linear)") from None
    check_targets(model, cfg)
    with torch.no_grad():
        for (_, ref), (_, trained) in zip(adapter_parameters(model, REFERENCE), adapter_parameters(model, ADAPTER)):
            ref.copy_(trained)  # the EMA starts at the policy
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name, ADAPTER))
    set_active(model, ADAPTER)
    # from_pretrained's models are in eval mode, the modules PEFT adds are not: without this its
    # dropout would act in every forward, the sampler's logprobs and the reference's included
    return model.eval()


def check(meta_model, cfg):
    """add_adapters on the model built on the meta device (policy.check_model_config): a target the
    model lacks, or one outside its decoder layers, refused before any process group or server starts."""
    with torch.device("meta"):
        add_adapters(meta_model, cfg)


def check_targets(model, cfg):
    """Refuse, in one line, an adapter outside the decoder layers' linear modules. The LM head's would
    get no gradient (sequence_logprobs reads lm_head.weight, the base's, into its own kernel) yet be
    merged into what the server serves; an embedding's is dropped by the merge and misnamed in the
    adapter file (its parameters are lora_embedding_A/B, not modules). vLLM's LoRA, besides, takes
    embedding and LM-head adapters for some architectures only (Llama, Qwen3; not Qwen2, Mistral)."""
    from peft.tuners.lora import Linear
    from peft.tuners.tuners_utils import BaseTunerLayer

    inside = {id(m) for m in model.model.layers.modules()}
    outside = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, BaseTunerLayer)
                      and (id(m) not in inside or not isinstance(m, Linear))})
    if outside:
        raise ValueError(f"lora_target_modules={','.join(cfg.lora_target_modules)}: {', '.join(outside)} is outside "
                         "the decoder layers' linear modules, the only ones adapted here (an LM head's adapter gets "
                         "no gradient, an embedding's is left out of the merge and the adapter file); name those "
                         "(q_proj,v_proj,...) or write all-linear")


def is_adapter(name, adapter):
    """Whether parameter `name` belongs to `adapter` (PEFT names it ...q_proj.lora_A.<adapter>.weight)."""
    parts = name.split(".")
    return adapter in parts and any(p.startswith("lora_") for p in parts)


def adapter_parameters(model, adapter):
    """(name, parameter) of `adapter`, in module order: the same order for every adapter."""
    return [(n, p) for n, p in model.named_parameters() if is_adapter(n, adapter)]


def tuner_layers(model):
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def set_active(model, adapter):
    """Make `adapter` the one the forward adds (None: none, the base model alone). PEFT's own
    set_adapter and enable_adapters also flip requires_grad, which FSDP2 reads once, when it first
    gathers a parameter; so the layers' two flags are set directly."""
    for layer in tuner_layers(model):
        layer._disable_adapters = adapter is None
        if adapter is not None:
            layer._active_adapter = [adapter]


@contextlib.contextmanager
def active(model, adapter):
    """Inside the block the forward uses `adapter` (None: the base); the trained one after."""
    set_active(model, adapter)
    try:
        yield
    finally:
        set_active(model, ADAPTER)


class WithAdapter:
    """The policy's module with another adapter active (the reference adapter, or None: the base),
    as a model the reference's logprobs come from."""

    def __init__(self, policy, adapter):
        self.policy, self.adapter = policy, adapter

    def sequence_logprobs(self, *args, **kwargs):
        with active(self.policy, self.adapter):
            return self.policy.sequence_logprobs(*args, **kwargs)


@contextlib.contextmanager
def dropout(model, on):
    """With on, PEFT's lora_dropout of the trained adapter in train mode inside the block. The
    models otherwise stay in eval mode (from_pretrained's): no other dropout is ever switched on."""
    modules = [m for name, m in model.named_modules() if on and name.endswith(f"lora_dropout.{ADAPTER}")]
    for m in modules:
        m.train(True)
    try:
        yield
    finally:
        for m in modules:
            m.train(False)


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
    (weight_sync.full_state_dict), not the live parameters. Without lora_rank, the input."""
    if not cfg.lora_rank:
        return state_dict
    scale = cfg.lora_alpha / cfg.lora_rank
    out = base(state_dict)
    for key, a in state_dict.items():
        if key.endswith(f".lora_A.{ADAPTER}.weight"):
            layer = key[:-len(f".lora_A.{ADAPTER}.weight")]
            w, b = out[f"{layer}.weight"], state_dict[f"{layer}.lora_B.{ADAPTER}.weight"]
            out[f"{layer}.weight"] = (w.double() + scale * (b.double() @ a.double())).to(w.dtype)
    return out


# --- what the rest of the trainer asks of LoRA (nothing there tests lora_rank)


def serves_adapter(cfg):
    """Whether the servers get the adapter itself (lora_weight_sync='adapter', weight_sync.AdapterSync)
    rather than full weights."""
    return bool(cfg.lora_rank) and cfg.lora_weight_sync == "adapter"


def server_flags(cfg):
    """vllm serve's flags for a server we launch: LoRA on when each sync loads the new adapter by name."""
    if not serves_adapter(cfg):
        return []
    rank = next(r for r in VLLM_MAX_LORA_RANKS if r >= cfg.lora_rank)
    return ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "1"]


def describe(policy, cfg):
    """The start-up line on the trained adapter's size (the EMA reference's adapter apart); None without LoRA."""
    if not cfg.lora_rank:
        return None
    total = sum(p.numel() for n, p in policy.named_parameters() if not is_adapter(n, REFERENCE))
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    return f"lora: rank {cfg.lora_rank}, {trainable:,} trainable parameters of {total:,} ({trainable / total:.2%})"


def export(full, cfg, adapter_dir):
    """An export's weights (a full state dict): with LoRA, PEFT's adapter directory written to
    adapter_dir and the adapter merged in; without, `full` as it is."""
    if not cfg.lora_rank:
        return full
    write_adapter({peft_key(k): v for k, v in full.items() if is_adapter(k, ADAPTER)}, cfg, adapter_dir)
    return merge(full, cfg)


def checkpoint_part(state_dict):
    """The policy's part of a checkpoint: with LoRA its adapters alone (the trained one and the EMA
    reference's; the frozen base is read from model_name_or_path again on resume), else all of it."""
    return {k: v for k, v in state_dict.items() if ".lora_" in k} or state_dict
