"""LM heads (parallel.py): the logit scales of Cohere and Granite in the chunked kernel against
float64 autograd and against the model's own forward; the heads and layouts that are refused
at load, in one line, from the config alone."""


import pytest
import torch
from transformers import (AutoConfig, AutoModelForCausalLM, CohereConfig, Gemma2Config, GPT2Config, GraniteConfig, LlamaConfig,
                          Qwen2Config)

from infra.policy import check_architecture, check_model_config, sequence_logprobs, token_logprobs

SMALL = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=64)


@pytest.mark.parametrize("logit_scale, temperature", [(0.0625, 1.0), (0.0625, 0.7), (1 / 8.0, 1.3), (3.0, 0.7)])
def test_scaled_logprobs_match_float64_autograd(logit_scale, temperature):
    """z = logit_scale * hidden @ weight.T / T: logp, entropy and head logp, and the gradients of
    hidden and weight through logp and head_logp, against log_softmax of the full logits."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (37,), generator=g)
    logp, ent, head, ids = token_logprobs(hidden, weight, targets, temperature, chunk_size=8, head_size=3,
                                          logit_scale=logit_scale)
    logp_all = torch.log_softmax(logit_scale * (hidden @ weight.t()) / temperature, -1)  # (N, V)
    assert torch.equal(ids, logp_all.topk(3, -1).indices)
    ref_logp, ref_head = logp_all.gather(-1, targets[:, None])[:, 0], logp_all.gather(-1, ids)
    assert torch.allclose(logp, ref_logp, atol=1e-12) and torch.allclose(head, ref_head, atol=1e-12)
    assert torch.allclose(ent, -(logp_all.exp() * logp_all).sum(-1), atol=1e-12)
    c, c_head = torch.randn(37, generator=g, dtype=torch.float64), torch.randn(37, 3, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((c * logp).sum() + (c_head * head).sum(), (hidden, weight))
    ref_grads = torch.autograd.grad((c * ref_logp).sum() + (c_head * ref_head).sum(), (hidden, weight))
    for got, ref in zip(grads, ref_grads):
        assert torch.allclose(got, ref, atol=1e-12), (got - ref).abs().max()


@pytest.mark.parametrize("config", [CohereConfig(logit_scale=0.25, **SMALL), GraniteConfig(logits_scaling=4.0, **SMALL),
                                    LlamaConfig(**SMALL)], ids=["cohere", "granite", "llama"])
def test_sequence_logprobs_match_the_models_own_logits(config):
    """sequence_logprobs against log_softmax of the model's forward (which applies Cohere's
    logit_scale and Granite's logits_scaling itself), at temperature 0.7: the scale is applied
    before the temperature, as vLLM does."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    ids = torch.randint(0, 50, (2, 12))
    mask = torch.ones(2, 11, dtype=torch.bool)
    with torch.no_grad():
        logp, _, _, _ = sequence_logprobs(model, ids, mask, 0.7)
        expected = torch.log_softmax(model(ids).logits[:, :-1] / 0.7, -1).gather(-1, ids[:, 1:, None])[..., 0]
    assert (expected[mask] - logp).abs().max() < 1e-5


def meta_model(config):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("config, field", [
    (Gemma2Config(**SMALL, head_dim=16), "final_logit_softcapping=30.0"),
    (GPT2Config(n_embd=32, n_layer=1, n_head=2), "no model.model.layers"),
])
def test_unsupported_models_are_refused_in_one_line(config, field):
    with pytest.raises(ValueError, match=field) as e:
        check_architecture(meta_model(config))
    assert "\n" not in str(e.value)


def test_a_biased_lm_head_is_refused():
    model = meta_model(Qwen2Config(**SMALL))
    model.lm_head = torch.nn.Linear(32, 50, bias=True, device="meta")
    with pytest.raises(ValueError, match="lm_head has a bias"):
        check_architecture(model)
    check_architecture(meta_model(Qwen2Config(**SMALL)))  # the same model without the bias passes


def test_the_refusal_reads_only_the_config(tmp_path):
    """check_model_config on a saved config.json, with no weights: the check before any process group."""
    Gemma2Config(**SMALL, head_dim=16).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        check_model_config(AutoConfig.from_pretrained(tmp_path))
    Qwen2Config(**SMALL).save_pretrained(tmp_path)
    check_model_config(AutoConfig.from_pretrained(tmp_path))


@pytest.mark.subprocess
def test_train_refuses_a_soft_capped_model_in_one_line(tiny_model_dir, tmp_path):
    """train.py on a Gemma-2 config (the tiny tokenizer beside it): one `error:` line naming the
    field, exit 2, before any process group, model or server."""
    import os
    import shutil
    import subprocess
    import sys

    model_dir = tmp_path / "gemma2"
    shutil.copytree(tiny_model_dir, model_dir)
    Gemma2Config(**{**SMALL, "vocab_size": 64}, head_dim=16).save_pretrained(model_dir)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "train.py"), "--model_name_or_path", str(model_dir),
                          "--output_dir", str(tmp_path / "out")], capture_output=True, text=True, timeout=300, cwd=root)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert out.returncode == 2 and len(errors) == 1, out.stderr[-2000:]
    assert "final_logit_softcapping=30.0" in errors[0] and "Traceback" not in out.stderr
    assert not os.path.exists(tmp_path / "out" / "vllm.log")
