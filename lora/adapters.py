"""LoRA: low-rank adapters trained on a frozen base (PEFT), and a reference that is an adapter.

    torchrun --nproc_per_node 2 train.py --lora_rank 16 --lora_target_modules all-linear

The adapters are injected into the Hugging Face model before FSDP2 shards it (PEFT's
inject_adapter_in_model: the model keeps its class and layout), so each adapter matrix is
sharded like the layer it adapts. Only the trained adapter ("default") requires a gradient;
the optimizer holds state for it alone, and a checkpoint holds the adapters alone (checkpoint.py
leaves out the frozen parameters but those the reference moves: the base is read from
model_name_or_path again on resume).

The reference is the policy's own module with another adapter active, never a second model:
- fixed (beta > 0, ref_policy_update_freq None): the adapters switched off, i.e. the base;
- EMA (ref_policy_update_freq): a second adapter, "reference", injected beside the trained one,
  equal to it at the start and moved toward it by reference.EMAReference's one foreach lerp
  over the local shards of the two (its shards sit on the same rank: no collective). It costs
  one adapter of memory instead of a model.

The adapter leaves the trainer through lora/sync.py: into the servers (the adapter itself, or
full weights with it folded in) and into the exports.

Its doors: lora/__init__.py.
"""

import contextlib
import warnings

import torch

ADAPTER, REFERENCE = "default", "reference"  # the trained adapter (PEFT's default name) and the EMA reference's


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
    outside the decoder layers' linear modules (check_targets), is a ValueError naming it."""
    from peft import inject_adapter_in_model

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
    for name, m in model.named_modules():  # update.dropout: PEFT's lora_dropout of the trained adapter alone
        if name.endswith(f"lora_dropout.{ADAPTER}"):
            m.dropout_in_training = True
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


def describe(policy, cfg):
    """The start-up line on the trained adapter's size (the EMA reference's adapter apart)."""
    total = sum(p.numel() for n, p in policy.named_parameters() if not is_adapter(n, REFERENCE))
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    return f"lora: rank {cfg.lora_rank}, {trainable:,} trainable parameters of {total:,} ({trainable / total:.2%})"
