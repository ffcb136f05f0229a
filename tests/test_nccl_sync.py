"""The NCCL weight transport against a real GPU vLLM server. Skips without CUDA and vLLM:
the machines this project is developed on have neither a GPU nor a GPU build of vLLM,
so this test has never run here."""

import importlib.util

import pytest
import torch

import rollout
import weight_sync
from config import Config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                                reason="needs a CUDA GPU and the GPU build of vLLM")


@pytest.mark.slow
def test_nccl_sync_of_perturbed_weights(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = Config(weight_sync_transport="nccl", max_prompt_length=48, response_length=16, vllm_dtype="float32",
                 vllm_gpu_memory_utilization=0.3, output_dir=str(tmp_path))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).cuda()
    served = str(tmp_path / "serving")
    weight_sync.write_serving_dir(weight_sync.full_state_dict(model), model.config,
                                  AutoTokenizer.from_pretrained(tiny_model_dir), served)
    proc, url = rollout.launch_server(served, cfg, str(tmp_path / "vllm.log"), port=8071)
    try:
        client = rollout.VLLMClient([url], served, proc=proc, log_path=str(tmp_path / "vllm.log"))
        sync = weight_sync.make_weight_sync(cfg, client, 0, torch.device("cuda"))
        seqs = [[7, 8, 9, 10, 11, 12], [20, 21, 22, 23]]
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p) * p.abs().mean())
        before = weight_sync.logprob_diff(weight_sync.trainer_logprobs(model, seqs), client.score(seqs))
        sync.sync(model)
        after = weight_sync.logprob_diff(weight_sync.trainer_logprobs(model, seqs), client.score(seqs))
        assert before[1] > 1e-3 and after[1] < 1e-4, (before, after)
        sync.close()
    finally:
        rollout.stop_server(proc)
