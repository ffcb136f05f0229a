"""The reference (anchor) policy: every kind behind one seam, and the sharded exponential moving average.

    ref = make_reference(cfg, policy, load_copy)   # None without a KL term
    ref.prepare(samples)                           # every rank, each step before packing (update.py)
    ref.logprobs(forward, micro_batch, ...)        # its logprobs (update.py)
    ref.step(step)                                 # after step's update: moves when due (train.py)
    ref.state_dict(), ref.load_state_dict(state)   # what a checkpoint holds of it (checkpoint.py)
    ref.ref_params                                 # what it moves: inside the policy's module (LoRA's
                                                   # EMA adapter), the policy's part of a checkpoint holds them

The kinds: a fixed copy of the initial policy (Reference), an EMA of the policy (EMAReference),
with LoRA the base (the policy's module, adapters off) or an EMA adapter, and a teacher of another
model served by vLLM (distill/teacher.py: on-policy distillation). A new kind is a
class with those methods and ref_params (here, or in its own folder as the teacher is), and a line
in make_reference.

The EMA:

    ref <- lerp(ref, policy, alpha) = (1 - alpha) * ref + alpha * policy

every `ref_policy_update_freq` steps (open-instruct's Polyak update, alpha = 0.6 by
default). EMA-PG's (Zhang & Ba) EMA anchor theta_ema <- eta * theta_ema + (1 - eta) * theta is the
same update with alpha = 1 - eta; TRL's sync_ref_model / ref_model_sync_steps /
ref_model_mixup_alpha map to load_ref_policy / ref_policy_update_freq / alpha, where TRL's N
counts optimizer steps and ours rollout steps (N / (num_mini_batches x num_epochs) here).

The reference has the policy's architecture and the same FSDP2 sharding, so each of its
shards lives on the rank that owns the matching policy shard: the update is one
`torch._foreach_lerp_` over the local shards, with no gather and no collective, and
memory O(parameters / world size). The anchors we know loop over parameters with
mul_/add_ and, under ZeRO-3, gather full parameters to do it.

With lora_rank the reference is an adapter beside the trained one in the policy's module
(lora/adapters.py, imported by make_reference only then): the same update over the two adapters' local
shards, one adapter of memory.

With offload_ref_policy the reference's shards stay in CPU memory: the update then runs
there, on a copy of the policy's local shards (still no collective); with offload_params
too, both are there already.

parallel.load_model stores the parameters in float32 (bf16 is FSDP2's compute dtype on a GPU,
not the dtype of the shards), so as train.py builds it the update runs on them directly and
there is no master copy. When the parameters are stored in a low precision (a model loaded in
bf16, or a reference cast with .to(torch.bfloat16)), small increments alpha * (policy - ref)
round away; the EMA then runs on an fp32 master copy of the local shards and the bf16 shards
are copied from it (tests/test_reference.py, on the sharded tiny model).
"""

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor


def local(t):
    """The local shard of a DTensor parameter (a view: writing it writes the parameter)."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t.data


class Reference:
    """A reference that does not move. `model` computes its logprobs (its sequence_logprobs): a
    sharded copy of the initial policy, whose weights a checkpoint holds, or a view of the
    policy's own module (LoRA's), which the policy's checkpoint holds."""

    ref_params = ()  # the parameters it moves: none

    def __init__(self, model, every=None):
        self.model, self.every = model, every
        self.owns_weights = isinstance(model, torch.nn.Module)
        if self.owns_weights:
            model.requires_grad_(False)

    def prepare(self, samples):
        """Before the step's samples are packed: what this kind puts on them (a teacher's scores); returns
        its metrics of the step. Nothing here."""
        return {}

    def logprobs(self, forward, b, **kwargs):
        """forward(model, micro-batch, ...) of update.py, run on this reference: (logp, entropy, head_logp,
        head_ids), the last the ids of the top-k KL's head (those passed in, or the kind's own)."""
        return forward(self.model, b, **kwargs)

    def step(self, step):
        """After the policy's update of `step`: move when due (every `every` steps)."""
        if self.every and step % self.every == 0:
            self.update()

    def update(self):
        pass

    def state_dict(self):
        """Its part of a checkpoint: {"ref": its sharded weights}, or {} when the policy's holds it."""
        return {"ref": get_model_state_dict(self.model)} if self.owns_weights else {}

    def load_state_dict(self, state):
        """After DCP loaded `state` (a state_dict() it wrote into) in place."""
        if "ref" in state:
            set_model_state_dict(self.model, state["ref"])


class EMAReference(Reference):
    """A reference whose parameters follow policy_model's, or with params=(ref_params, policy_params)
    those two lists: with LoRA the reference adapter follows the trained one inside the policy's
    own module (lora/adapters.py). Moves every `every` steps (step), or at each update()."""

    def __init__(self, ref_model, policy_model, alpha, params=None, every=None):
        ref_params, pol_params = params or (list(ref_model.parameters()), list(policy_model.parameters()))
        assert len(ref_params) == len(pol_params), "reference and policy must have the same parameters"
        for r, p in zip(ref_params, pol_params):
            assert r.shape == p.shape and getattr(r, "placements", None) == getattr(p, "placements", None), \
                "reference and policy must be sharded the same way"
            r.requires_grad_(False)
        super().__init__(ref_model, every)
        self.alpha, self.updates = alpha, 0
        self.ref_params, self.policy_params = ref_params, pol_params
        low = any(local(r).dtype != torch.float32 for r in ref_params)
        self.master = [local(r).float().clone() for r in ref_params] if low else None

    @torch.no_grad()
    def update(self):
        """One Polyak step on this rank's shards. Issues no collective."""
        # Shard views are taken anew each time: FSDP2 may re-point a parameter's local tensor.
        ref = [local(r) for r in self.ref_params]
        policy = [local(p) for p in self.policy_params]
        if policy[0].device != ref[0].device:  # an offloaded reference (offload_ref_policy) beside a policy
            policy = [t.to(ref[0].device) for t in policy]  # on the GPU: a copy of the local shards, no collective
        if self.master is None:
            torch._foreach_lerp_(ref, policy, self.alpha)
        else:
            policy = [t.float() for t in policy] if policy[0].dtype != torch.float32 else policy
            torch._foreach_lerp_(self.master, policy, self.alpha)
            torch._foreach_copy_(ref, self.master)
        self.updates += 1

    def state_dict(self):
        """Also the fp32 master shards, wrapped with their parameter's sharding."""
        state = super().state_dict()
        if state and self.master is not None:
            state["ref_master"] = {
                name: DTensor.from_local(m, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                if isinstance(p, DTensor) else m
                for (name, p), m in zip(self.model.named_parameters(), self.master)}
        return state

    def load_state_dict(self, state):
        super().load_state_dict(state)
        if "ref_master" in state:  # DCP loaded into the wrappers; a no-op where they alias the master
            for m, t in zip(self.master, state["ref_master"].values()):
                m.copy_(t.to_local() if isinstance(t, DTensor) else t)


def make_reference(cfg, policy, load_copy):
    """The reference the config asks for; None without a KL term; a teacher's server with
    teacher_model_name_or_path. load_copy() builds a sharded
    copy of the initial policy (parallel.load_model(..., reference=True)); with LoRA the
    reference is the policy's own module: the base (adapters off) when fixed, else the EMA
    adapter."""
    if not cfg.uses_reference:
        return None
    if cfg.teacher_model_name_or_path:
        from distill import teacher  # noqa: PLC0415 - the optional concept's door
        return teacher.Teacher(cfg, torch.distributed.get_rank() if torch.distributed.is_initialized() else 0)
    every = cfg.ref_policy_update_freq
    if not cfg.lora_rank:
        return EMAReference(load_copy(), policy, cfg.alpha, every=every) if every else Reference(load_copy())
    from lora import adapters  # noqa: PLC0415 - the optional concept's door
    if not every:
        return Reference(adapters.WithAdapter(policy, None))
    pairs = [[p for _, p in adapters.adapter_parameters(policy, a)] for a in (adapters.REFERENCE, adapters.ADAPTER)]
    return EMAReference(adapters.WithAdapter(policy, adapters.REFERENCE), policy, cfg.alpha, params=pairs, every=every)
