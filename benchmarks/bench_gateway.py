"""What the agent gateway (agent_programs/gateway.py) adds to a model call: an OpenAI-client agent's calls
through the gateway, against the same calls made straight to the client (token ids in, token
ids out), both answered at once by a stand-in for vLLM, so that only the gateway's own work is
timed (HTTP, the chat template, tokenization, tool-call parsing, the record); and of that, the
time spent in the gateway's own handling (the trainer's side; the rest is HTTP and the agent's
client, which run in the agent's worker processes in a real run). Episodes of
`--calls` calls with a tool result between them, `--episodes` at a time on threads, as agent
workers send them.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_gateway.py [--model models/smollm2-135m-instruct]
"""

import argparse
import concurrent.futures
import json
import platform
import time

import openai
from transformers import AutoTokenizer

from envs import tool_calls
from config import Config
from agent_programs.gateway import Gateway

CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "214 + 659"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "calculate", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


class Instant:
    """Answers every request at once with the same turn (a tool call) and its end-of-turn token."""

    def __init__(self, tokenizer):
        self.ids = tokenizer(CALL, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids("<|im_end|>")]

    def submit(self, prompt_ids, n, max_tokens, temperature=1.0, top_p=1.0, seed=None, stop=()):
        future = concurrent.futures.Future()
        future.set_result([dict(token_ids=self.ids, logprobs=[-0.5] * len(self.ids), finish_reason="stop", eos=True,
                                version=0, text="")])
        return future


def episode(base_url, key, calls):
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
    messages = [{"role": "system", "content": "You can use a calculator."}, {"role": "user", "content": "What is 214 + 659?"}]
    for _ in range(calls):
        reply = client.chat.completions.create(model="any", messages=messages, tools=TOOLS).choices[0].message
        messages += [reply.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "873"}]


def direct(client, tokenizer, calls):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 214 + 659?"}], add_generation_prompt=True,
                                        return_dict=True)["input_ids"]
    for _ in range(calls):
        ids = ids + client.submit(ids, 1, 64, 1.0, 1.0).result()[0]["token_ids"]


def cpu():
    """The CPU's model name and its AVX flags (compare times within one run only)."""
    info = open("/proc/cpuinfo").read() if platform.system() == "Linux" else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    return f"{name} ({', '.join(f for f in ('avx2', 'avx512f') if f in flags)})"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    cfg = Config(agent="x.py:f", tool_call_parser="hermes", max_prompt_length=512, response_length=2048, max_turns=64)
    g = Gateway(tok, cfg, tool_calls.Parser("hermes", tok, None))
    g.client = Instant(tok)
    spent, chat = [], g.chat

    def timed(trace, body):  # the trainer's side of a call: the rest is HTTP and the agent's client
        t = time.perf_counter()
        out = chat(trace, body)
        spent.append(time.perf_counter() - t)
        return out
    g.chat = timed
    times = {"gateway": [], "direct": []}
    with concurrent.futures.ThreadPoolExecutor(args.episodes) as pool:
        for r in range(args.rounds):
            keys = [g.open(f"r{r}e{k}", 1.0, lambda t: None) for k in range(args.episodes)]
            t = time.perf_counter()
            list(pool.map(lambda uk: episode(*uk, args.calls), keys))
            times["gateway"].append(time.perf_counter() - t)
            traces = [g.close(key) for _, key in keys]
            assert all(tr.calls == args.calls and tr.sample.restarts == () for tr in traces)
            t = time.perf_counter()
            list(pool.map(lambda _: direct(g.client, tok, args.calls), range(args.episodes)))
            times["direct"].append(time.perf_counter() - t)
    g.shutdown()
    calls = args.episodes * args.calls
    per = {k: 1000 * min(v) / calls for k, v in times.items()}
    print(json.dumps(dict(cpu=cpu(), episodes=args.episodes, calls=args.calls,
                          ms_per_call_gateway=round(per["gateway"], 2), ms_per_call_direct=round(per["direct"], 2),
                          ms_added_per_call=round(per["gateway"] - per["direct"], 2),
                          ms_in_the_gateway_per_call=round(1000 * sum(spent) / len(spent), 2))))


if __name__ == "__main__":
    main()
