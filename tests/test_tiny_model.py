import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import make_tiny_model


def test_tokenizer_is_character_level_and_round_trips(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "copy: abca=\n12+7=19"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert len(tok) == 64 and tok.eos_token == "<eos>" and tok.eos_token_id == 2 and tok.pad_token_id == 0
    assert tok("Z", add_special_tokens=False)["input_ids"] == []  # outside the vocabulary: dropped
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_ids_to_tokens(tok(chat, add_special_tokens=False)["input_ids"])[0] == "<|im_start|>"


def test_model_shape_and_round_trip(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    c = model.config
    assert c.model_type == "qwen2" and c.head_dim == 64 and c.vocab_size == 64 and not c.tie_word_embeddings
    assert 0.25e6 < sum(p.numel() for p in model.parameters()) < 0.35e6
    again = make_tiny_model.build_model(seed=0)
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)  # saved == built in code, bit for bit


def test_tied_model_ties(tied_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tied_model_dir)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_refuses_head_dim_16(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit):
        make_tiny_model.main(["--out", str(tmp_path), "--hidden-size", "32", "--heads", "2"])
    assert "head dim" in capsys.readouterr().err


def test_serving_copy_of_a_tied_model_is_untied_and_equal(tied_model_dir, tmp_path):
    import make_serving_copy

    make_serving_copy.main(["--model", tied_model_dir, "--out", str(tmp_path / "serve")])
    tied = AutoModelForCausalLM.from_pretrained(tied_model_dir)
    copy = AutoModelForCausalLM.from_pretrained(tmp_path / "serve")
    assert not copy.config.tie_word_embeddings
    assert copy.lm_head.weight.data_ptr() != copy.model.embed_tokens.weight.data_ptr()
    assert torch.equal(copy.lm_head.weight, tied.model.embed_tokens.weight)
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        assert torch.equal(copy(ids).logits, tied(ids).logits)
