"""Build a randomly initialised Qwen2-style causal LM with a character-level tokenizer.

    python scripts/make_tiny_model.py --out models/tiny                 # 0.3 M parameters
    python scripts/make_tiny_model.py --out models/tiny-tied --tie-word-embeddings
    python scripts/make_tiny_model.py --out models/24m --shape 24m        # a named shape (SHAPES below)

The directory loads with AutoModelForCausalLM, AutoTokenizer and the vLLM server. head_dim
is hidden-size / heads, 64 by default: vLLM's CPU attention kernels refuse 16. The tokenizer maps one character
to one token (lower-case letters, digits, punctuation, space, newline) plus ChatML-style
special tokens, and carries a chat template so the chat path can be exercised.
Characters outside that set (upper case, for one) are dropped by the tokenizer.
"""

import argparse
import os

# Named shapes for the benchmarks (build_model's keyword arguments); weights are always random.
SHAPES = {
    "tiny": dict(),  # hidden 128, 2 layers, vocab 64: 0.3 M parameters
    "24m": dict(hidden_size=512, layers=8, heads=8, kv_heads=2, intermediate_size=1536),  # 24 M, vocab 64
    "0.5b": dict(vocab_size=151936, hidden_size=896, layers=24, heads=14, kv_heads=2, intermediate_size=4864,
                 tie_word_embeddings=True),  # Qwen2.5-0.5B's shape: 494 M
    "1.5b": dict(vocab_size=151936, hidden_size=1536, layers=28, heads=12, kv_heads=2, intermediate_size=8960,
                 tie_word_embeddings=True),  # Qwen2.5-1.5B's shape: 1.54 B
}
SPECIALS = ["<pad>", "<unk>", "<eos>", "<|im_start|>", "<|im_end|>"]
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 \n+-*/=?:.,!'\"()<>_#%&|")  # 59 + 5 specials = 64
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # Byte-level, like GPT-2 and Qwen2 (space is stored as "Ġ", newline as "Ċ"), so that
    # AutoTokenizer's Qwen2Tokenizer, which re-applies its own byte-level pre-tokenizer,
    # reads the file as the same tokenizer. BPE without merges splits into characters.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for c in CHARS:
        vocab[byte_level.pre_tokenize_str(c)[0][0]] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens(SPECIALS)
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                   eos_token="<eos>", chat_template=CHAT_TEMPLATE)


def build_model(vocab_size=64, hidden_size=128, layers=2, heads=2, kv_heads=1, intermediate_size=None,
                tie_word_embeddings=False, seed=0, max_position_embeddings=2048):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden_size // heads,
        intermediate_size=intermediate_size or 2 * hidden_size, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=None, eos_token_id=2, pad_token_id=0,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory to write (created)")
    p.add_argument("--tie-word-embeddings", action="store_true", help="share the input embedding and the LM head")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--intermediate-size", type=int, default=None, help="default 2 x hidden size")
    p.add_argument("--vocab-size", type=int, default=64, help="at least the tokenizer's 64 tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shape", choices=list(SHAPES), default=None, help="a named shape; overrides the size flags")
    args = p.parse_args(argv)
    if args.shape:
        shape = dict(vocab_size=64, hidden_size=128, layers=2, heads=2, kv_heads=1, intermediate_size=None,
                     tie_word_embeddings=False) | SHAPES[args.shape]
        for k, v in shape.items():
            setattr(args, k, v)
    if args.hidden_size % args.heads or args.hidden_size // args.heads < 32:
        p.error(f"hidden-size / heads is the head dim and must be a whole number >= 32 (vLLM's CPU kernels "
                f"refuse 16; 64 is tested); got {args.hidden_size} / {args.heads}")
    tokenizer = build_tokenizer()
    if args.vocab_size < len(tokenizer):
        p.error(f"--vocab-size {args.vocab_size} is below the tokenizer's {len(tokenizer)} tokens")
    model = build_model(args.vocab_size, args.hidden_size, args.layers, args.heads, args.kv_heads,
                        args.intermediate_size, args.tie_word_embeddings, args.seed)
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: Qwen2, {n / 1e6:.2f} M parameters, vocab {args.vocab_size}, "
          f"tied={args.tie_word_embeddings}")


if __name__ == "__main__":
    main()
