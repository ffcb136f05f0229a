"""What several test files share: running train.py and the workers, a vLLM server on the tiny
model, a scripted server for episodes, tokenizers with real chat templates, the LoRA model.
Tests import these from here, never from each other."""

import concurrent.futures
import json
import os
import re
import socket
import subprocess
import sys
import time
import types

import torch

from lora import adapters
from lora import sync as lora_sync
from infra import vllm_client
from infra import vllm_server
from infra import weight_sync
from config import Config
from infra.policy import sequence_logprobs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- train.py and the test workers, in processes of their own
ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=ROOT)
VOLATILE = ("time_", "tokens_per_s", "peak_memory_gb", "memory_plan_gb")  # differ between any two runs
WORKER = os.path.join(ROOT, "tests", "dist_worker.py")


# The servers the tests launch skip torch.compile's warm-up (a minute or two of every start on a CPU): they
# sample what a compiled server samples (test_vllm.py's eager test, the one place a compiled server runs)
EAGER = ["--vllm_enforce_eager", "true"]


def free_port():
    """A port nothing listens on now, for torchrun's rendezvous: the suite runs two test files at once
    (pytest-xdist), so no two runs may be given the same fixed port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(args, nproc=1, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
                str(free_port())] if nproc > 1 else [sys.executable]
    return subprocess.run(launcher + [os.path.join(ROOT, "train.py")] + EAGER + args, env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def command(script, nproc, port=None):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
                str(port or free_port())] if nproc > 1 else [sys.executable]
    return launcher + [os.path.join(ROOT, script)]


def flags(tiny_model_dir, run_dir, steps, *extra, url=None):
    return ["--model_name_or_path", tiny_model_dir, "--output_dir", str(run_dir / "out"), "--checkpoint_state_dir",
            str(run_dir / "ckpt"), "--num_training_steps", str(steps), "--eval_freq", "0", "--beta", "0.1",
            "--ref_policy_update_freq", "1", "--seed", "5", *EAGER] + (["--vllm_server_urls", url] if url else []) \
        + list(extra)


def run(cmd, timeout=600):
    out = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return out


def start(cmd):
    """A run we will interrupt: its own session, so the whole job can be killed at once."""
    return subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def metrics(run_dir):
    path = run_dir / "out" / "metrics.jsonl"
    return [json.loads(line) for line in open(path)] if path.exists() else []


def wait_for_step(proc, run_dir, step, timeout=600):
    deadline = time.monotonic() + timeout
    while not any(r["step"] >= step for r in metrics(run_dir)):
        assert proc.poll() is None, f"the run ended early:\n{proc.stdout.read()[-3000:]}"
        assert time.monotonic() < deadline, "the run did not reach step {step}"
        time.sleep(0.2)


def stable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def full(ckpt):
    """A DCP checkpoint read back as one plain state dict."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = str(ckpt) + ".pt"
    dcp_to_torch_save(str(ckpt), out)
    return torch.load(out, weights_only=False)


def served_weights(model_dir):
    """The weights a server reads from model_dir: every file its safetensors index names."""
    from safetensors.torch import load_file

    with open(os.path.join(model_dir, "model.safetensors.index.json")) as f:
        files = set(json.load(f)["weight_map"].values())
    return {k: v for name in sorted(files) for k, v in load_file(os.path.join(model_dir, name)).items()}


def run_worker(mode, model_dir, out, nproc, port, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, WORKER, mode, model_dir, str(out), *extra] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(port),
         WORKER, mode, model_dir, str(out), *extra]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return torch.load(out)


# --- a vLLM server, and a scripted one for episodes
VLLM_CFG = Config(max_prompt_length=48, response_length=16, vllm_startup_timeout=400, vllm_request_timeout=60,
                  vllm_max_retries=1, vllm_enforce_eager=True)


def serve(model_dir, tmp, port, cfg=None):
    """Launch a server on the untied serving copy of model_dir, as the trainer does (cfg: its flags; with
    lora_rank, LoRA's too)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    serving = os.path.join(tmp, "serving")
    weight_sync.write_serving_dir(weight_sync.full_state_dict(model), model.config, AutoTokenizer.from_pretrained(model_dir),
                              serving)
    cfg = cfg or VLLM_CFG
    proc, url = vllm_server.launch_server(serving, cfg, os.path.join(tmp, "vllm.log"), port=port,
                                          extra_args=lora_sync.server_flags(cfg))
    return model, vllm_client.VLLMClient([url], serving, timeout=60, max_retries=1, proc=proc,
                                     log_path=os.path.join(tmp, "vllm.log"))

IM_END = 4  # the tiny tokenizer's <|im_end|>, a stop id of the model like SmolLM2's (llama_like_dir)


class ScriptedClient:
    """Answers like VLLMClient.submit, at once: turn t of every episode says script[t] (its tokens,
    then <|im_end|> when the text does not end on a stop string); logprobs -0.1, -0.2, ...; cut at
    the request's max_tokens. An episode's turn is read off its prompt: the prompt of an earlier
    request and its answer, extended. Records each request as (turn, prompt)."""

    def __init__(self, tokenizer, script, eos_id=IM_END):
        self.tokenizer, self.script, self.eos_id, self.requests, self.answered = tokenizer, script, eos_id, [], {}

    def submit(self, prompt_ids, n, max_tokens, temperature=1.0, top_p=1.0, seed=None, stop=(), server=None,
               request_id=None):
        turn = max((t + 1 for sent, t in self.answered.items() if tuple(prompt_ids[:len(sent)]) == sent), default=0)
        self.requests.append((turn, prompt_ids))
        text = self.script[turn]
        stopped = any(text.endswith(s) for s in stop)
        ids = (self.tokenizer(text, add_special_tokens=False)["input_ids"] + ([] if stopped else [self.eos_id]))
        cut = len(ids) > max_tokens
        ids = ids[:max_tokens]
        self.answered[tuple(prompt_ids) + tuple(ids)] = turn
        out = [dict(token_ids=ids, logprobs=[-0.1 * (j + 1) for j in range(len(ids))],
                    finish_reason="length" if cut else "stop", eos=not cut and not stopped, version=0, text="")
               for _ in range(n)]
        future = concurrent.futures.Future()
        future.set_result(out)
        return future

    def abort(self, request_ids):
        self.aborted = getattr(self, "aborted", []) + list(request_ids)
        return True


def with_prompts(env, tokenizer, rows):
    """Give rows what data.tokenize_rows gives them: the environment's first messages, rendered."""
    for row in rows:
        row["messages"] = env.reset(row)
        row["prompt_text"] = tokenizer.apply_chat_template(row["messages"], tools=env.tools, tokenize=False,
                                                           add_generation_prompt=True)
        row["prompt_ids"] = tokenizer(row["prompt_text"], add_special_tokens=False)["input_ids"]
    return rows


def documented(name):
    """The code block of docs/data.md that defines `name`, as written."""
    text = open(os.path.join(ROOT, "docs", "data.md")).read().split("\n## Writing an environment\n", 1)[1]
    return next(c for c in re.findall(r"```python\n(.*?)```", text, re.S) if f"class {name}" in c)


# --- tokenizers with the families' real chat templates (tests/data/templates)
TEMPLATES = os.path.join(os.path.dirname(__file__), "data", "templates")
QWEN = dict(specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos="<|im_end|>", bos=None)
FAMILIES = {
    "qwen2.5-instruct": QWEN,
    "qwen3": QWEN,
    "smollm2-instruct": QWEN,  # ChatML; a template that renders no tools
    "llama-3.1-instruct": dict(specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                         "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
                               eos="<|eot_id|>", bos="<|begin_of_text|>"),
    "gemma-2-it": dict(specials=["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], eos="<eos>",
                       bos="<bos>"),
}


def family_tokenizer(name):
    """A byte-level tokenizer (every byte one token, no merges) with the family's special tokens,
    EOS and BOS, and its real chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    f = FAMILIES[name]
    vocab = {t: i for i, t in enumerate(f["specials"])}
    for c in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[c] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens(f["specials"])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    with open(os.path.join(TEMPLATES, f"{name}.jinja")) as fh:
        template = fh.read()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f["eos"], bos_token=f["bos"],
                                   chat_template=template, name_or_path=name)


# --- the math task, LoRA
def recompute(question):
    """The math task's answer, worked out again from its words."""
    sentences = re.findall(r"[^.?]+[.?]", question)
    total = int(re.search(r"has (\d+)", sentences[0]).group(1))
    for s in sentences[1:]:
        n = re.search(r"(\d+)", s)
        if n is None:
            break  # the question
        n = int(n.group(1))
        total = total + n if "more" in s else total * n if "times" in s else total - n
    return total


def lora_model(model_dir, **overrides):
    """The tiny model with adapters (rank 4, every linear layer), lora_B drawn away from 0 so that the
    adapter changes the output; sequence_logprobs bound as parallel.load_model binds it."""
    from transformers import AutoModelForCausalLM

    cfg = Config(model_name_or_path=model_dir, lora_rank=4, lora_alpha=8, beta=0.1, ref_policy_update_freq=1,
                 **overrides)
    torch.manual_seed(0)
    model = adapters.add_adapters(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), cfg)
    with torch.no_grad():
        for _, p in adapters.adapter_parameters(model, adapters.ADAPTER):
            if p.abs().max() == 0:
                p.normal_(0, 0.2)
    model.sequence_logprobs = types.MethodType(sequence_logprobs, model)
    return cfg, model


# --- logprobs of whole sequences, against a server's (VLLMClient.score): the plain forward, one sequence at a time


@torch.no_grad()
def trainer_logprobs(model, sequences, temperature=1.0):
    """Per-token logprobs of each sequence under `model` (same layout as VLLMClient.score)."""
    out = []
    for seq in sequences:
        ids = torch.tensor([seq], device=next(model.parameters()).device)
        logits = model(input_ids=ids).logits[0, :-1].float() / temperature
        out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].cpu().tolist())
    return out


def logprob_diff(trainer_lp, server_lp):
    """(mean, max) of |trainer - server| over all tokens."""
    diffs = torch.tensor([abs(a - b) for t, s in zip(trainer_lp, server_lp) for a, b in zip(t, s)])
    return diffs.mean().item(), diffs.max().item()


def generate(client, prompt_ids, n, max_tokens, temperature=1.0, top_p=1.0, seed=None, stop=()):
    """n completions of each token-id prompt through client.submit, one list per prompt. max_tokens and
    seed are one per prompt, or one for all: then prompt i's request gets seed + i * n, as
    episodes.Completions seeds them, so no two samples of the call share a stream."""
    k = len(prompt_ids)
    budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * k
    seeds = seed if isinstance(seed, list) else [None if seed is None else seed + i * n for i in range(k)]
    futures = [client.submit(ids, n, budget, temperature, top_p, s, stop, server=i)
               for i, (ids, budget, s) in enumerate(zip(prompt_ids, budgets, seeds))]
    return [f.result() for f in futures]


def prompt_logprobs(client, sequences):
    """The server's logprob of every token of each sequence after the first (prompt_logprobs): one list
    of len(seq) - 1 floats per sequence. On a server with LoRA enabled, vLLM 0.32 fails prompt_logprobs
    when two requests share an engine step ("einsum(): subscript b has size 2 ..."; vllm#29955): score
    one sequence a call there. Training never asks this (the sync check reads the sampling logprobs)."""
    from infra.vllm_client import NEUTRAL_SAMPLING

    payloads = [dict(model=client.model, prompt=seq, max_tokens=1, temperature=1.0, top_p=1.0, **NEUTRAL_SAMPLING,
                     prompt_logprobs=0) for seq in sequences]
    out = []
    for seq, resp in zip(sequences, client.map("/v1/completions", payloads)):
        plp = resp["choices"][0]["prompt_logprobs"][1:]
        out.append([entry[str(tok)]["logprob"] for tok, entry in zip(seq[1:], plp)])
    return out
