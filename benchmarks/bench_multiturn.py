"""Generated tokens/s of multi-turn episodes against the single-turn path, side by side on one
vLLM CPU server (what train.py launches) in one invocation.

    .venv/bin/python benchmarks/bench_multiturn.py                   # SmolLM2, 2 repeats of each
    .venv/bin/python benchmarks/bench_multiturn.py --repeats 3
    .venv/bin/python benchmarks/bench_multiturn.py --server_args "--block-size 128"
    .venv/bin/python benchmarks/bench_multiturn.py --prompts 16   # 128 episodes at once

Both play the tools demo's batch through a player (episodes.Completions, envs.environment.Environment):
4 prompts (--prompts) x 8 samples of
the `calc` task (3 digits, + - *) with the calculator's first messages, at most 96 tokens
after the prompt, T 0.7. "multi-turn": the calculator answers, at most 3 assistant turns;
"single-turn": no environment, one turn on the same prompts. tokens/s counts the policy's
sampled tokens over the seconds spent generating (tool time apart); "client CPU" is this
process's CPU seconds (HTTP, the chat template's rendering, the calculator's round trips),
taken from the cores the server computes on.
"""

import argparse
import json
import os
import shlex
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), ROOT]
from infra import vllm_client  # noqa: E402
from infra import vllm_server  # noqa: E402
from bench_generation import cpu_name  # noqa: E402
from config import Config  # noqa: E402
from data import load_prompts  # noqa: E402
from envs.environment import Environment  # noqa: E402
from episodes import Completions  # noqa: E402
from infra.model_files import load_tokenizer, stop_token_ids  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.join(ROOT, "models", "smollm2-135m-instruct"))
    p.add_argument("--repeats", type=int, default=2, choices=range(1, 100), metavar="N")
    p.add_argument("--port", type=int, default=8032)
    p.add_argument("--prompts", type=int, default=4, help="prompts a batch, 8 samples each (the tools demo: 4)")
    p.add_argument("--server_args", default="", help="more flags for the vLLM server, e.g. \"--block-size 128\"")
    args = p.parse_args(argv)
    if args.prompts < 1:
        p.error(f"--prompts {args.prompts}: give at least 1 prompt a batch")
    cfg = Config(model_name_or_path=args.model, dataset="calc", environment="envs.calculator:calculator", math_digits=3,
                 math_operations="+-*", max_prompt_length=160, response_length=96, max_turns=3, temperature=0.7,
                 num_unique_prompts_rollout=args.prompts, num_samples_per_prompt_rollout=8, vllm_port=args.port)
    tok = load_tokenizer(cfg)
    env = Environment(cfg.environment, tok, cfg)
    rows = load_prompts(cfg, tok, env)[0][:cfg.num_unique_prompts_rollout]
    env.start()
    log = os.path.join(tempfile.mkdtemp(prefix="bench_multiturn_"), "vllm.log")
    proc, url = vllm_server.launch_server(args.model, cfg, log, extra_args=shlex.split(args.server_args))
    try:
        client = vllm_client.VLLMClient([url], args.model, stop_token_ids=stop_token_ids(tok, args.model))
        env.play(client, rows, cfg.num_samples_per_prompt_rollout, 0, cfg.temperature)  # warm-up
        out = {}
        for name, e in [("single-turn", Completions(cfg, tok)), ("multi-turn", env)] * args.repeats:
            cpu = time.process_time()  # this process's CPU: the client's share of the machine's cores
            episodes, stats = e.play(client, rows, cfg.num_samples_per_prompt_rollout, len(out), cfg.temperature)
            cpu = time.process_time() - cpu
            tokens = sum(x.sample.policy_tokens for x in episodes)
            r = out.setdefault(name, dict(tokens_per_s=[], turns=[], tool_calls=[], seconds=[], time_tools=[],
                                          client_cpu_s=[]))
            r["tokens_per_s"].append(tokens / stats["time_generate"])
            r["seconds"].append(stats["time_generate"])
            r["time_tools"].append(stats.get("time_tools", 0.0))
            r["client_cpu_s"].append(cpu)
            r["turns"].append(sum(x.turns for x in episodes) / len(episodes))
            r["tool_calls"].append(sum(x.tool_calls for x in episodes) / len(episodes))
            print(f"{name:12s} {tokens} policy tokens in {stats['time_generate']:.1f} s generating -> "
                  f"{tokens / stats['time_generate']:.0f} tokens/s; {r['turns'][-1]:.2f} turns and "
                  f"{r['tool_calls'][-1]:.2f} tool calls an episode; tools {stats.get('time_tools', 0.0):.2f} s; "
                  f"client CPU {cpu:.2f} s", flush=True)
    finally:
        vllm_server.stop_server(proc)
        env.close()
    best = {k: max(v["tokens_per_s"]) for k, v in out.items()}
    print(f"{cpu_name()}: multi-turn / single-turn tokens/s (best of {args.repeats}) = "
          f"{best['multi-turn'] / best['single-turn']:.2f}")
    print(json.dumps(dict(cpu=cpu_name(), **out)))


if __name__ == "__main__":
    main()
