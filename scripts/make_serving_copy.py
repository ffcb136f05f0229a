"""Write the copy of a model that a vLLM server you run yourself should serve.

    python scripts/make_serving_copy.py --model Qwen/Qwen2.5-0.5B --out serving/qwen0.5b
    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model serving/qwen0.5b ...

The trainer pushes untied weights (lm_head.weight next to the embedding) into the server;
a server started on a tied model ignores the pushed LM head and keeps stale logits, so it
must start from this untied copy. train.py writes the same copy itself when it launches
the server (OUTPUT_DIR/vllm_model).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="hub name or local model directory")
    p.add_argument("--out", required=True, help="directory to write")
    args = p.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infra.weight_sync import write_serving_dir

    try:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError) as e:
        p.error(f"--model {args.model!r} could not be loaded ({type(e).__name__}); give a local model "
                f"directory or a hub name this machine can reach")
    write_serving_dir(model.state_dict(), model.config, tokenizer, args.out)
    print(f"wrote {args.out} (tie_word_embeddings=false)")


if __name__ == "__main__":
    main()
