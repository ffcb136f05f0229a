"""Run by test_vllm under torchrun: sync an FSDP2-sharded model into a vLLM server."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from infra import vllm_client
from infra.parallel import close_distributed
from infra import weight_sync
from helpers import logprob_diff, prompt_logprobs, trainer_logprobs

model_dir, url, served, tmp = sys.argv[1:5]
dist.init_process_group("gloo")
rank = dist.get_rank()
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
torch.manual_seed(123)
with torch.no_grad():
    for p in model.parameters():
        p.add_(0.05 * torch.randn_like(p) * p.abs().mean())
full = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
full.load_state_dict(model.state_dict())
mesh = dist.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),))
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
assert type(model.model.layers[0].mlp.up_proj.weight).__name__ == "DTensor"
client = vllm_client.VLLMClient([url], served, timeout=60, max_retries=1)
weight_sync.FilesystemSync(client, rank, tmp).sync(model)
if rank == 0:
    seqs = [[7, 8, 9, 10, 11, 12], [20, 21, 22, 23]]
    mean, mx = logprob_diff(trainer_logprobs(full, seqs), prompt_logprobs(client, seqs))
    assert mx < 1e-4, (mean, mx)
    print("SYNC OK", mean, mx)
del model, full
close_distributed()
