"""The memory plan (memory.py): its activation count against what the forward really keeps, its
items by hand, its refusals, and the launched server's KV cache."""

import dataclasses
import json
import os
import types
import unittest.mock

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from transformers import AutoModelForCausalLM, Qwen2Config

from infra import colocation, memory, weight_sync
from config import Config
from infra.policy import sequence_logprobs
from tests.helpers import train
from infra.vllm_server import server_command

# (hidden, MLP width, heads, key/value heads, head_dim): query width equal to, above and below hidden
SHAPES = [(128, 256, 2, 1, 64), (192, 384, 4, 1, 64), (256, 512, 8, 2, 32)]


def model_config(h, i, heads, kv_heads, head_dim, layers=2, vocab=100):
    return Qwen2Config(hidden_size=h, intermediate_size=i, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=head_dim, vocab_size=vocab, num_hidden_layers=layers,
                       layer_types=["full_attention"] * layers)


def saved_values(mc, checkpointing=False, tokens=64):
    """Values the forward of policy.sequence_logprobs keeps for backward, a token, parameters left out
    (each storage once): what autograd's saved-tensor hooks see."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(mc, attn_implementation="sdpa").float()
    if checkpointing:
        for k in range(len(model.model.layers)):
            model.model.layers[k] = checkpoint_wrapper(model.model.layers[k])
    model.sequence_logprobs = types.MethodType(sequence_logprobs, model)
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, mc.vocab_size, (1, tokens))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.sequence_logprobs(ids, torch.ones(1, tokens - 1, dtype=torch.bool), 1.0,
                                position_ids=torch.arange(tokens)[None])
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in params) / tokens / 4


@pytest.mark.parametrize("shape", SHAPES)
def test_activations_per_layer_are_what_the_forward_keeps(shape):
    """A decoder layer's count is exact (two layers minus one); the model's whole within 3%, with and
    without activation checkpointing (where the forward keeps each layer's input only)."""
    one, two = saved_values(model_config(*shape, layers=1)), saved_values(model_config(*shape, layers=2))
    planned = memory.activation_values(model_config(*shape, layers=2), False)
    assert two - one == planned - memory.activation_values(model_config(*shape, layers=1), False)
    assert abs(two - planned) <= 0.03 * two
    kept = saved_values(model_config(*shape, layers=2), checkpointing=True)
    layer = planned - memory.activation_values(model_config(*shape, layers=1), False)
    # the plan's checkpointed figure adds the one layer recomputed in backward at a time
    assert abs(kept - (memory.activation_values(model_config(*shape, layers=2), True) - layer)) <= 0.03 * kept


def meta_model(mc):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(mc)


def test_trainer_items_by_hand():
    """h 128, i 256, 2 layers, vocab 100, untied: 2 x 2 ranks of float32 on a CPU."""
    mc = model_config(128, 256, 2, 1, 64, vocab=100)
    layer = 3 * 128 * 256 + (128 * 128 + 128) + 2 * (128 * 64 + 64) + 128 * 128 + 2 * 128  # MLP, q, k, v, o, norms
    total = 2 * layer + 2 * 100 * 128 + 128
    cfg = Config(num_unique_prompts_rollout=4, num_samples_per_prompt_rollout=4, max_prompt_length=32,
                 response_length=16, max_tokens_per_micro_batch=4096, beta=0.1, load_ref_policy=True)
    plan = memory.trainer_plan(cfg, mc, meta_model(mc), 2, cuda=False)
    assert plan["parameters"] == 4 * total // 2 and plan["optimizer"] == 8 * total // 2
    assert plan["gradients"] == 4 * total // 2 and plan["reference"] == 4 * total // 2
    assert 2 * 100 * 128 + 128 < layer  # the root's unit (embeddings, head, final norm) is smaller than a layer
    assert plan["gathered"] == 3 * 4 * layer
    # 8 samples a rank, 2 groups: the prompt twice (shared prompts) and every response
    assert plan["activations"] == (2 * 32 + 8 * 16) * memory.activation_values(mc, False) * 4
    assert plan["lm_head"] == 2 * 256 * 100 * 4 and plan["weight_sync"] == 4 * total  # untied: no head copy
    assert memory.at_tokens(plan, 10) == memory.rank_total(plan) - plan["activations"] + 10 * plan["per_token"]
    # several micro-batches: gradients whole until the one reduce-scatter
    several = dataclasses.replace(cfg, max_tokens_per_micro_batch=48, shared_prefix=False)
    plan = memory.trainer_plan(several, mc, meta_model(mc), 2, cuda=False)
    assert plan["gradients"] == 4 * total and plan["activations"] == 48 * plan["per_token"]
    # the weight sync holds one part of the serving copy and the next tensor (the largest: an MLP matrix)
    with unittest.mock.patch.object(weight_sync, "PART_BYTES", 1000):  # a part is one tensor past the budget
        assert memory.trainer_plan(cfg, mc, meta_model(mc), 2, cuda=False)["weight_sync"] == 2 * 4 * 128 * 256
    with unittest.mock.patch.object(weight_sync, "PART_BYTES", 300_000):
        assert memory.trainer_plan(cfg, mc, meta_model(mc), 2, cuda=False)["weight_sync"] == 300_000 + 4 * 128 * 256
    lora = dataclasses.replace(cfg, lora_rank=8, lora_weight_sync="merged")  # LoRA's merge: the whole state dict
    assert memory.sync_part(lora, mc, meta_model(mc)) == 2 * 4 * total
    assert memory.sync_part(dataclasses.replace(lora, lora_weight_sync="adapter"), mc, meta_model(mc)) == 0


def test_the_plan_counts_the_server_processes_its_placement_starts(monkeypatch):
    """A CPU server on every core runs its model in the engine's process: two processes' runtime; one on
    half the cores (async), one whose cores the user bound, or with vLLM's variable set to 1: three."""
    from infra import vllm_server

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU"):
        monkeypatch.delenv(name, raising=False)
    mc = model_config(128, 256, 2, 1, 64)
    sync, ahead = Config(), Config(async_steps=1, use_vllm_logprobs=True)
    cases = [(sync, {}, "0"), (ahead, {}, "1"), (sync, {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}, "1"),
             (sync, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, "1"), (ahead, {"VLLM_ENABLE_V1_MULTIPROCESSING": "00"}, "00"),
             (sync, {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}, "0")]  # no binding of its own: the list is ours
    for cfg, env, launched in cases:
        with unittest.mock.patch.dict(os.environ, env):
            assert vllm_server.cpu_placement(cfg, os.environ)["VLLM_ENABLE_V1_MULTIPROCESSING"] == launched, env
            runtime = memory.model_server(cfg, mc, meta_model(mc), cuda=False)["runtime"]
        assert runtime == (memory.CPU_SERVER_RUNTIME_TWO_PROCESSES if int(launched) == 0 else memory.CPU_SERVER_RUNTIME)


def test_kv_cache_by_hand():
    """2 x 4 sequences of 32 + 40 tokens in blocks of 32 (CPU): 3 blocks each, and the block vLLM keeps
    back; K and V of 2 layers, 64 wide. An evaluation of more prompts, or beside generation ahead, more."""
    mc = model_config(128, 256, 2, 1, 64)
    cfg = Config(num_unique_prompts_rollout=2, num_samples_per_prompt_rollout=4, max_prompt_length=32,
                 response_length=40, eval_freq=0)
    assert memory.kv_cache_bytes(cfg, mc, cuda=False) == (8 * 3 + 1) * 32 * 2 * 2 * 64 * 4
    assert memory.kv_cache_bytes(cfg, mc, cuda=True) == (8 * 5 + 1) * 16 * 2 * 2 * 64 * 2
    long = dataclasses.replace(cfg, vllm_max_model_len=2048)  # one sequence of the server's context at least
    assert memory.kv_cache_bytes(long, mc, cuda=False) == (64 + 1) * 32 * 2 * 2 * 64 * 4
    evals = dataclasses.replace(cfg, eval_freq=10, num_eval_prompts=20)
    assert memory.server_sequences(evals) == 20 and memory.server_sequences(cfg) == 8
    assert memory.server_sequences(dataclasses.replace(evals, async_steps=1, use_vllm_logprobs=True)) == 28
    assert memory.server_plan(Config(vllm_server_urls=["http://x:8000"]), mc, meta_model(mc), False) == {}


def test_launched_server_gets_the_plans_kv_cache(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = Config(model_name_or_path=tiny_model_dir)
    cmd, env = server_command(tiny_model_dir, cfg, uds="/tmp/x.sock")
    planned = memory.kv_cache_bytes(cfg, Qwen2Config.from_pretrained(tiny_model_dir), cuda=False)
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(planned) and "VLLM_CPU_KVCACHE_SPACE" not in env
    assert cmd[cmd.index("--max-num-seqs") + 1] == str(memory.server_sequences(cfg))
    cmd, _ = server_command(tiny_model_dir, Config(model_name_or_path=tiny_model_dir, vllm_kv_cache_space_gb=0.5),
                            uds="/tmp/x.sock")
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == "500000000"


@pytest.mark.parametrize("overrides, knob", [
    (dict(), "set activation_checkpointing=True"),
    (dict(activation_checkpointing=True), "lower max_tokens_per_micro_batch"),
    (dict(max_tokens_per_micro_batch=128, response_length=64, num_samples_per_prompt_rollout=64),
     "lower num_samples_per_prompt_rollout"),
])
def test_refusal_names_the_knob_of_the_largest_item(overrides, knob):
    mc = model_config(256, 512, 8, 2, 32, layers=4, vocab=1000)
    cfg = Config(**{**dict(max_tokens_per_micro_batch=65536, response_length=4096, max_prompt_length=64), **overrides})
    trainer = memory.trainer_plan(cfg, mc, meta_model(mc), 2, cuda=False)
    server = memory.server_plan(cfg, mc, meta_model(mc), False)
    headroom, host = memory.node_plan(cfg, mc, meta_model(mc), 2, cuda=False, colocated=False)
    assert headroom == {} and host["sleep_copies"] == host["state_dict"] == 0  # on a CPU: the sync's /dev/shm alone
    sync = trainer["weight_sync"]  # rank 0's alone
    need = 2 * (memory.rank_total(trainer) - sync) + sync + sum(server.values()) + host["sync_dir"]
    room = dict(host_bytes=(1e15, "this machine's"), sync_free=1e15)
    memory.check(cfg, trainer, server, headroom, host, 2, cuda=False, device_bytes=need, **room)  # exactly enough
    with pytest.raises(ValueError, match=f"^memory plan: 2 trainer rank.*{knob}") as e:
        memory.check(cfg, trainer, server, headroom, host, 2, cuda=False, device_bytes=need - 1, **room)
    assert "\n" not in str(e.value)
    gpu = memory.trainer_plan(cfg, mc, meta_model(mc), 2, cuda=True)
    with pytest.raises(ValueError, match=r"^memory plan: a trainer rank needs [0-9.]+ GB of its GPU's 0.0 GB; "):
        memory.check(cfg, gpu, {}, {}, host, 2, cuda=True, device_bytes=1, **room)


def test_a_colocated_server_gets_what_a_rank_holds_between_steps_and_the_headroom_leave():
    """80 GB GPUs, 8 of them: a rank holds 10 GB between steps (shards, AdamW, reference, runtime; not its
    activations, which come while the server sleeps) and 4 GB stay free beside it (vLLM's context, NCCL,
    the sync's cache): the server gets (80 - 10 - 4) / 80 = 0.825 of each GPU, at most
    vllm_gpu_memory_utilization; refused when that cannot hold 1.2 x its weights per tensor-parallel group
    and its share of the KV cache."""
    trainer = dict(parameters=2e9, optimizer=4e9, reference=2e9, runtime=2e9, activations=30e9, gradients=2e9,
                   gathered=1e9, lm_head=1e8, weight_sync=0, per_token=1)
    server = dict(weights=14e9, kv_cache=8e9, runtime=0)
    headroom, host = dict(vllm_context=0.5e9, nccl_buffers=1.6e9, sync_cache=1.9e9), dict(sleep_copies=1e12)
    cfg = Config(vllm_gpu_memory_utilization=0.9)
    assert colocation.fraction(cfg, trainer, server, headroom, host, 8, 80e9) == pytest.approx(0.825)
    assert colocation.fraction(dataclasses.replace(cfg, vllm_gpu_memory_utilization=0.5), trainer, server, headroom,
                               host, 8, 80e9) == 0.5
    with pytest.raises(ValueError, match=r"^memory plan: a trainer rank holds 10.0 GB of a 24.0 GB GPU between "
                                         r"steps and 4.0 GB stay free beside it .*, leaving the colocated vLLM server "
                                         r"less than 1.2 x its 15.0 GB; .*scripts/launch_8gpu.sh\)$"):
        colocation.fraction(cfg, trainer, server, headroom, host, 8, 24e9)  # 10 GB left < 1.2 x (14 + 1)
    assert colocation.fraction(dataclasses.replace(cfg, vllm_tensor_parallel_size=2), trainer, server, headroom, host,
                               8, 24e9) == pytest.approx((24 - 10 - 4) / 24)  # 1.2 x (7 + 1) GB a GPU fits


@pytest.mark.subprocess
def test_train_refuses_a_plan_the_machine_cannot_hold(tiny_model_dir, tmp_path):
    """Before any process group, model or server: exit 2, one line naming the knob. 4,096 x 64 sequences
    of 2,048 tokens: the server's KV cache alone is 550 GB."""
    out = train(["--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path / "out"),
                 "--max_prompt_length", "1024", "--response_length", "1024", "--num_unique_prompts_rollout", "4096",
                 "--num_samples_per_prompt_rollout", "64", "--max_tokens_per_micro_batch", "2048"], timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("error: memory plan: 1 trainer rank(s) and the vLLM server need") and \
        "lower num_samples_per_prompt_rollout" in line
    assert not os.path.exists(tmp_path / "out" / "metrics.jsonl")


@pytest.mark.slow
def test_plan_against_the_measured_peak_of_two_ranks(tmp_path):
    """2 CPU ranks training a 24 M-parameter model (random weights; a reward on the text's length, so
    every group trains): each step's plan at its own largest micro-batch within 25% of rank 0's
    measured peak (resident set)."""
    import subprocess
    import sys

    from tests.helpers import ROOT
    model = tmp_path / "24m"
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_tiny_model.py"), "--out", str(model),
                    "--shape", "24m"], check=True, capture_output=True)
    (tmp_path / "r.py").write_text("def reward(prompt, completion, example):\n    return len(completion) % 7 / 7\n")
    out = train(["--model_name_or_path", str(model), "--output_dir", str(tmp_path / "out"), "--num_training_steps",
                 "2", "--eval_freq", "0", "--reward_fn", f"{tmp_path}/r.py:reward", "--max_prompt_length", "128",
                 "--response_length", "256",
                 "--num_unique_prompts_rollout", "2", "--num_samples_per_prompt_rollout", "8", "--temperature", "1.5"],
                nproc=2)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "memory plan: trainer rank" in out.stdout
    rows = [json.loads(line) for line in open(tmp_path / "out" / "metrics.jsonl")]
    trained = [r for r in rows if "memory_plan_gb" in r]
    assert trained
    for r in trained:
        assert abs(r["memory_plan_gb"] - r["peak_memory_gb"]) <= 0.25 * r["peak_memory_gb"], r
    plan = json.load(open(tmp_path / "out" / "run_info.json"))["memory_plan"]
    assert plan[0]["activations"] > plan[0]["runtime"] / 2  # activations weigh here, not the libraries alone


# Published config.json values of the base models (huggingface.co/Qwen/Qwen2.5-{0.5B,1.5B,7B}): hidden,
# layers, heads, key/value heads, MLP width, vocabulary, tied head, context
QWEN = {"0.5B": (896, 24, 14, 2, 4864, 151936, True, 32768),
        "1.5B": (1536, 28, 12, 2, 8960, 151936, True, 131072),
        "7B": (3584, 28, 28, 4, 18944, 152064, False, 131072)}


def qwen_config(h, layers, heads, kv_heads, i, vocab, tie, context):
    return Qwen2Config(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       intermediate_size=i, vocab_size=vocab, tie_word_embeddings=tie, max_position_embeddings=context,
                       layer_types=["full_attention"] * layers)


def colocated_plan(mc, cfg, gpus=8, gpu=80e9):
    """The plan of train.py's load_inputs for one node of `gpus` GPUs with the server colocated, and the share."""
    model = meta_model(mc)
    plan = (memory.trainer_plan(cfg, mc, model, gpus, cuda=True), memory.server_plan(cfg, mc, model, cuda=True),
            *memory.node_plan(cfg, mc, model, gpus, cuda=True, colocated=True))
    return plan, colocation.fraction(cfg, *plan, gpus, gpu)


@pytest.mark.parametrize("name", list(QWEN))
def test_qwen_colocated_on_8_h100_by_hand(name, monkeypatch, capsys):
    """Qwen2.5 at 0.5B, 1.5B and 7B colocated on 8 GPUs of 80 GB in bf16, the default config otherwise: the
    plan's lines (docs/running.md's table: `pytest -s tests/test_memory.py -k qwen`) and each item the table
    shows by hand from the published shapes."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    h, layers, heads, kv_heads, i, vocab, tie, _ = QWEN[name]
    kv = kv_heads * h // heads
    layer = 3 * h * i + (h * h + h) + 2 * (h * kv + kv) + h * h + 2 * h  # MLP, q (bias), k, v (bias), o, norms
    total = layers * layer + vocab * h * (1 if tie else 2) + h  # embeddings (and an untied head), final norm
    serving = total + vocab * h * tie  # the served copy's head untied
    cfg = Config()
    (trainer, server, headroom, host), share = colocated_plan(qwen_config(*QWEN[name]), cfg)
    with capsys.disabled():
        print(f"\nQwen2.5-{name}, 8 x 80 GB: {memory.describe(trainer, server, headroom, host)}; "
              f"server share {share:.3f} x 80 GB = {share * 80:.1f} GB")
    held = 4 * total // 8 + 8 * total // 8 + memory.CUDA_CONTEXT  # parameters, AdamW, runtime (no reference: beta 0)
    assert headroom == dict(vllm_context=0.5e9, nccl_buffers=1.6e9, sync_cache=vocab * h * (4 + 2))  # the embedding
    assert share == pytest.approx(min(0.9, (80e9 - held - 0.5e9 - 1.6e9 - 6 * vocab * h) / 80e9))
    assert server["weights"] == 2 * serving
    assert host == dict(sleep_copies=8 * 2 * serving, sync_dir=2 * serving + 2 * vocab * h, state_dict=4 * serving)
    if name == "7B":  # the figures of the table, rounded as it shows them
        assert (round(memory.rank_total(trainer) / 1e9, 1), round(share, 3)) == (24.1, 0.784)
        assert [round(v / 1e9, 1) for v in host.values()] == [121.8, 16.3, 30.5]


def test_a_container_limit_is_read_from_the_process_cgroup(tmp_path):
    """The kernel's files in a tree of their own: cgroup v2 (the lowest memory.max on the process's path), v1
    (memory.limit_in_bytes, its "unlimited" near 2**63), a v1 memory controller beside a v2 hierarchy (this
    machine's layout), none; machine_bytes takes the limit where it is below the RAM."""
    def tree(root, cgroup, files):
        (root / "proc/self").mkdir(parents=True)
        (root / "proc/self/cgroup").write_text(cgroup)
        for path, value in files.items():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(value + "\n")
        return str(root)

    v2 = tree(tmp_path / "v2", "0::/kubepods/pod1\n", {"sys/fs/cgroup/kubepods/memory.max": "8589934592",
                                                     "sys/fs/cgroup/kubepods/pod1/memory.max": "17179869184"})
    assert memory.container_bytes(v2) == 8589934592  # the parent's 8 GiB holds its child
    ns = tree(tmp_path / "ns", "0::/\n", {"sys/fs/cgroup/memory.max": "1000000000"})  # a container's own namespace
    assert memory.container_bytes(ns) == 1_000_000_000
    v1 = tree(tmp_path / "v1", "4:memory:/docker/abc\n3:cpu:/docker/abc\n",
              {"sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712",
               "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes": "2147483648"})
    assert memory.container_bytes(v1) == 2147483648
    hybrid = tree(tmp_path / "hybrid", "4:memory:/process_api/x\n0::/\n",
                  {"sys/fs/cgroup/memory/process_api/x/memory.limit_in_bytes": "9223372036854771712"})
    assert memory.container_bytes(hybrid) is None  # unlimited
    assert memory.container_bytes(str(tmp_path / "none")) is None  # no /proc
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert memory.machine_bytes(ns) == (1_000_000_000, "its container's")
    assert memory.machine_bytes(hybrid) == (physical, "this machine's")
    assert memory.machine_bytes()[0] <= physical  # this machine's own files


def test_a_container_limit_refuses_the_host_plan(tmp_path):
    """A GPU node's host items against a container's 100 GB: refused in one line naming the container's
    limit and the setting that frees the largest item (the sleep copies: one a replica)."""
    mc = qwen_config(*QWEN["7B"])
    cfg = Config(output_dir=str(tmp_path))
    (trainer, server, headroom, host), _ = colocated_plan(mc, cfg)
    need = host["sleep_copies"] + host["sync_dir"] + host["state_dict"]
    room = dict(device_bytes=80e9, sync_free=1e15)
    memory.check(cfg, trainer, server, headroom, host, 8, cuda=True, host_bytes=(need, "its container's"), **room)
    with pytest.raises(ValueError, match=r"^memory plan: this node's host memory needs 168.6 GB \(sleep_copies 121.8, "
                                         r"sync_dir 16.3, state_dict 30.5\) of its container's 100.0 GB; raise "
                                         r"vllm_tensor_parallel_size .*, or raise the container's memory limit "
                                         r"\(docker run --memory\)$"):
        memory.check(cfg, trainer, server, headroom, host, 8, cuda=True, host_bytes=(100e9, "its container's"), **room)
    on_disk = dataclasses.replace(cfg, weight_sync_dir=str(tmp_path / "sync"))  # not the host's memory then
    memory.check(on_disk, trainer, server, headroom, host, 8, cuda=True,
                 host_bytes=(need - host["sync_dir"], "its container's"), **room)


def test_a_small_dev_shm_refuses_the_sync(tmp_path):
    """A container's 64 MB /dev/shm cannot hold the sync's copy: one line naming weight_sync_dir and docker's
    --shm-size; a weight_sync_dir without room names it alone. The real /dev/shm is measured where there is one."""
    cfg = Config(output_dir=str(tmp_path))
    base = weight_sync.sync_base(None, str(tmp_path))
    need = memory.sync_dir_bytes(cfg, qwen_config(*QWEN["0.5B"]), meta_model(qwen_config(*QWEN["0.5B"])), cuda=True)
    assert base == "/dev/shm" and need == 2 * (494_032_768 + 151936 * 896) + 2 * 151936 * 896  # untied: +1 head
    memory.check_sync_dir(cfg, need, free=need)
    with pytest.raises(ValueError, match=r"^memory plan: the weight sync keeps 1.53 GB in /dev/shm \(.*\), which has "
                                         r"0.07 GB free; set weight_sync_dir to a directory on a disk, or give the "
                                         r"container a larger /dev/shm \(docker run --shm-size\)$"):
        memory.check_sync_dir(cfg, need, free=64 * 2**20)
    with pytest.raises(ValueError, match=r"in .*/sync .*; set weight_sync_dir to a directory with room$"):
        memory.check_sync_dir(dataclasses.replace(cfg, weight_sync_dir=str(tmp_path / "sync")), need, free=0)
    import shutil
    assert weight_sync.free_bytes(str(tmp_path / "sync" / "later")) == shutil.disk_usage(tmp_path).free
    memory.check_sync_dir(cfg, 1)  # measured: this machine's /dev/shm has a byte free
    with pytest.raises(ValueError, match="which has"):
        memory.check_sync_dir(cfg, weight_sync.free_bytes("/dev/shm") + 2**30)


def test_parts_are_written_in_the_served_dtype(tmp_path, monkeypatch):
    """bfloat16 parts where the server is bfloat16 (half the bytes in /dev/shm), float32 on a CPU bit for bit
    as the trainer holds them; make_weight_sync asks vllm_server.server_dtype."""
    from safetensors.torch import load_file

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    mc = model_config(128, 256, 2, 1, 64, vocab=100)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(mc).float()
    assert weight_sync.make_weight_sync(Config(output_dir=str(tmp_path)), None, 1, None).dtype == torch.float32
    for dtype in ("auto", "float32", "bfloat16"):  # the dtype the server we launch is told
        cmd, _ = server_command("m", Config(vllm_dtype=dtype), uds="/tmp/x.sock")
        told = getattr(torch, cmd[cmd.index("--dtype") + 1])
        assert weight_sync.served_dtype(Config(vllm_dtype=dtype), cuda=False) == told
    assert weight_sync.make_weight_sync(Config(output_dir=str(tmp_path), vllm_dtype="bfloat16"), None, 1,
                                        None).dtype == torch.bfloat16
    full = weight_sync.write_weights(weight_sync.serving_parts(model, 0, dtype=torch.float32), str(tmp_path / "f32"))
    half = weight_sync.write_weights(weight_sync.serving_parts(model, 0, dtype=torch.bfloat16), str(tmp_path / "bf16"))
    assert half * 2 == full == 4 * memory.serving_values(mc, meta_model(mc))
    f32, bf16 = (load_file(str(tmp_path / d / "model-00001.safetensors")) for d in ("f32", "bf16"))
    for name, p in model.state_dict().items():
        assert torch.equal(f32[name], p) and bf16[name].dtype == torch.bfloat16
        assert torch.equal(bf16[name], p.to(torch.bfloat16))
