"""The weight sync's parts in the served dtype, against a real vLLM CPU server serving in bfloat16: vLLM's
reload copies each tensor into its parameter (default_weight_loader's copy_), so bf16 parts give the
server exactly the weights float32 parts give it, at half the bytes."""

import pytest
import torch

from helpers import VLLM_CFG, prompt_logprobs, serve, trainer_logprobs
from infra import vllm_server, weight_sync

SEQS = [[7, 8, 9, 10, 11, 12, 13, 14], [20, 21, 22, 5, 6], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]]


@pytest.mark.slow
def test_bf16_parts_load_into_a_bf16_server_as_float32_parts_do(tiny_model_dir, tmp_path):
    import dataclasses

    cfg = dataclasses.replace(VLLM_CFG, vllm_dtype="bfloat16")
    model, client = serve(tiny_model_dir, str(tmp_path / "serve"), 8091, cfg)
    try:
        assert weight_sync.served_dtype(cfg, cuda=False) == torch.bfloat16
        before = prompt_logprobs(client, SEQS)
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.2 * torch.randn_like(p) * p.abs().mean())
        written, served = {}, {}
        for dtype in (torch.float32, torch.bfloat16):
            sync = weight_sync.FilesystemSync(client, 0, str(tmp_path / str(dtype)), dtype=dtype)
            written[dtype] = sync.sync(model)
            served[dtype] = prompt_logprobs(client, SEQS)
            sync.close()
        assert written[torch.bfloat16] * 2 == written[torch.float32]
        assert served[torch.bfloat16] == served[torch.float32]  # the same bf16 weights, bit for bit
        moved = max(abs(a - b) for s, t in zip(before, served[torch.bfloat16]) for a, b in zip(s, t))
        assert moved > 1e-2, "the perturbation did not reach the server; the test would prove nothing"
        rounded = model.to(torch.bfloat16).float()  # the trainer's weights as the server holds them
        gap = max(abs(a - b) for s, t in zip(trainer_logprobs(rounded, SEQS), served[torch.bfloat16])
                  for a, b in zip(s, t))
        assert gap < moved / 4, (gap, moved)  # bf16 arithmetic apart, the served model is the trainer's
    finally:
        vllm_server.stop_server(client.proc)
