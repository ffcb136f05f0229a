"""A model directory whose generation_config.json sets sampling defaults (top_k, min_p, penalties,
as Qwen2.5-Instruct's top_k=20 and repetition_penalty=1.05 do) must not change what the trainer
learns from: every request pins neutral values, the server we launch ignores the file
(--generation-config vllm), and the model's extra end-of-sequence ids still end a completion.
Real vLLM CPU servers on the tiny model; the reference is the trainer's full softmax."""

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from infra import vllm_client
from infra import vllm_server
from infra import weight_sync
from episodes import completion_text
from infra.model_files import stop_token_ids
from helpers import VLLM_CFG, generate, trainer_logprobs

# Far from neutral, each of them: every one left to the server moves the sampling logprobs.
DEFAULTS = dict(top_k=3, min_p=0.1, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.5)
PROMPTS = [[7, 8, 9], [20, 21], [30, 31, 32, 33]]


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    """The untied serving copy of the tiny model, with a generation_config.json of DEFAULTS."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    out = str(tmp_path_factory.mktemp("genconfig") / "serving")
    weight_sync.write_serving_dir(weight_sync.full_state_dict(model), model.config, tokenizer, out)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump(dict(DEFAULTS, eos_token_id=2), f)
    return model, tokenizer, out


@pytest.fixture(scope="module")
def users_server(served, tmp_path_factory):
    """Started as a user would, without --generation-config vllm: the file's defaults apply."""
    model, tokenizer, out = served
    log = str(tmp_path_factory.mktemp("users") / "vllm.log")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", out, "--host", "127.0.0.1",
           "--port", "8026", "--dtype", "float32", "--max-model-len", "64", "--logprobs-mode", "processed_logprobs",
           "--enforce-eager"]  # as every server of the tests: no torch.compile warm-up (helpers.EAGER)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = "http://127.0.0.1:8026"
    deadline = time.monotonic() + 400
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, vllm_client.log_tail(log)
        try:
            urllib.request.urlopen(url + "/health", timeout=5)
            break
        except OSError:
            time.sleep(1)
    yield model, vllm_client.VLLMClient([url], out, timeout=60, max_retries=1, stop_token_ids=[2])
    vllm_server.stop_server(proc)


@pytest.fixture(scope="module")
def our_server(served, tmp_path_factory):
    model, tokenizer, out = served
    log = str(tmp_path_factory.mktemp("ours") / "vllm.log")
    proc, url = vllm_server.launch_server(out, VLLM_CFG, log, port=8027)
    yield model, tokenizer, url, proc
    vllm_server.stop_server(proc)


def assert_full_softmax(model, prompts, groups, temperature):
    """Each sampled token's logprob is the trainer's full-softmax logprob at that temperature."""
    for p, group in zip(prompts, groups):
        for s in group:
            lp = trainer_logprobs(model, [p + s["token_ids"]], temperature)[0][len(p) - 1:]
            assert max(abs(a - b) for a, b in zip(lp, s["logprobs"])) < 1e-4, (lp, s["logprobs"])


def greedy(model, prompt, n):
    """The trainer's argmax continuation of n tokens (no penalty, no stop)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.slow
def test_requests_pin_neutral_sampling_on_a_users_server(users_server):
    model, client = users_server
    for temperature in (1.0, 0.7):
        groups = generate(client, PROMPTS, n=4, max_tokens=12, temperature=temperature, seed=3)
        assert_full_softmax(model, PROMPTS, groups, temperature)
    # greedy evaluation: no repetition or presence penalty bends the argmax
    for p, group in zip(PROMPTS, generate(client, PROMPTS, n=1, max_tokens=12, temperature=0.0)):
        ids = group[0]["token_ids"]
        assert ids == greedy(model, p, len(ids)), p


def post(url, payload):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


@pytest.mark.slow
def test_our_server_ignores_the_models_sampling_defaults(our_server, served):
    """A request that names only the temperature gets vLLM's neutral defaults, not the file's."""
    model, _, url, _ = our_server
    resp = post(url, dict(model=served[2], prompt=PROMPTS[0], n=4, max_tokens=12, temperature=1.0, seed=3,
                          logprobs=0, return_token_ids=True))
    group = [dict(token_ids=c["token_ids"], logprobs=c["logprobs"]["token_logprobs"]) for c in resp["choices"]]
    assert_full_softmax(model, PROMPTS[:1], [group], 1.0)


@pytest.mark.slow
def test_extra_end_of_sequence_ids_stop_and_are_stripped(our_server, served, tmp_path):
    """The policy's generation_config lists a second EOS (Qwen's <|endoftext|> beside <|im_end|>),
    which the serving copy does not know: the trainer passes it as a stop token, the completion ends
    on it, and the reward's text leaves it out."""
    model, tokenizer, url, _ = our_server
    prompt = next(p for p in ([7 + i, 8, 9] for i in range(20)) if greedy(model, p, 1)[0] not in (0, 2))
    extra = greedy(model, prompt, 1)[0]  # the token greedy decoding writes first
    plain = vllm_client.VLLMClient([url], served[2], timeout=60, max_retries=1)
    alone = generate(plain, [prompt], n=1, max_tokens=4, temperature=0.0)[0][0]
    assert alone["token_ids"][0] == extra and len(alone["token_ids"]) > 1  # the server alone does not stop there
    GenerationConfig(eos_token_id=[2, extra]).save_pretrained(tmp_path)  # the policy's directory lists both
    stop_ids = stop_token_ids(tokenizer, str(tmp_path))
    assert stop_ids == sorted({2, extra})
    client = vllm_client.VLLMClient([url], served[2], timeout=60, max_retries=1, stop_token_ids=stop_ids)
    s = generate(client, [prompt], n=1, max_tokens=4, temperature=0.0)[0][0]
    assert s["token_ids"] == [extra] and s["finish_reason"] == "stop" and s["eos"]
    assert completion_text(tokenizer, s) == ""
    assert completion_text(tokenizer, dict(s, token_ids=[5, extra])) == tokenizer.decode([5])
