"""Run by test_nccl_sync under torchrun: NCCLSync's gather and its failures on 2 gloo ranks,
against fake servers (the NCCL calls themselves need a GPU and never run here)."""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from infra import vllm_client
from infra import weight_sync
from nccl_sync import NCCLSync
from infra.parallel import close_distributed



def say(line):
    """One line in one write: both ranks share the pipe, and print() writes the newline apart."""
    os.write(1, (line + "\n").encode())


model_dir, urls = sys.argv[1], sys.argv[2:]
dist.init_process_group("gloo")
rank = dist.get_rank()
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
full = {k: v.clone() for k, v in model.state_dict().items()}
mesh = dist.device_mesh.init_device_mesh("cpu", (dist.get_world_size(),))
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)

sync = NCCLSync(None, rank, "127.0.0.1", 29655, torch.device("cpu"), timeout=3.0, dtype=torch.bfloat16)
gathered = sync.gather(model)
if rank == 0:  # the serving copy (untied), cast to the server's dtype
    want = weight_sync.untie(full)
    assert list(gathered) == list(want), (list(gathered), list(want))
    assert all(v.dtype == torch.bfloat16 and torch.equal(v, want[k].to(torch.bfloat16)) for k, v in gathered.items())
else:
    assert gathered == {}
say(f"RANK {rank} GATHER OK")

for url in urls:  # each fake server fails the sync its own way
    sync.client = vllm_client.VLLMClient([url], "m", timeout=3.0, max_retries=1)
    t = time.monotonic()
    try:
        sync.sync(model)
        say(f"RANK {rank} NO ERROR")
    except vllm_client.VLLMError as e:
        say(f"RANK {rank} VLLMError after {time.monotonic() - t:.1f}s: {str(e).splitlines()[0]}")
    except Exception as e:  # noqa: BLE001 -- reported, for the test to see which
        say(f"RANK {rank} {type(e).__name__}: {e}")
del model
close_distributed()
