import concurrent.futures
import dataclasses
import os
import subprocess
import sys

import pytest

from episodes import Completions
from infra.cli import help_text, parse_args
import config
from config import Config
from episodes import max_seed
from packing import batch_plan
from infra.parallel import mesh_shape
from infra import colocation
from infra.colocation import check_compute_modes, check_launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (bad overrides, a message fragment, good overrides that fix it)
RULES = [
    (dict(use_vllm_logprobs=True, truncated_importance_sampling_ratio_cap=2.0), "contradiction",
     dict(use_vllm_logprobs=True, truncated_importance_sampling_ratio_cap=0.0)),
    (dict(loss_denominator="tokens"), "loss_denominator", dict(loss_denominator="1024")),
    (dict(loss_denominator="-5"), "positive", dict(loss_denominator=5)),
    (dict(checkpoint_state_dir="ckpt"), "checkpoint_state_freq", dict(checkpoint_state_dir="ckpt", checkpoint_state_freq=10)),
    (dict(checkpoint_state_freq=10), "checkpoint_state_dir", dict(checkpoint_state_freq=-1)),
    (dict(keep_last_n_checkpoints=0), "keep_last_n_checkpoints", dict(keep_last_n_checkpoints=1)),
    (dict(max_consecutive_skipped_steps=0), "max_consecutive_skipped_steps", dict(max_consecutive_skipped_steps=1)),
    (dict(vllm_max_restarts=-1), "vllm_max_restarts", dict(vllm_max_restarts=0)),
    (dict(save_freq=0), "save_freq", dict(save_freq=5)),
    (dict(async_steps=-1), "async_steps", dict(async_steps=0)),
    (dict(async_steps=1), "staleness goes uncorrected", dict(async_steps=1, use_vllm_logprobs=True)),
    (dict(async_steps=1, truncated_importance_sampling_ratio_cap=2.0, max_sample_staleness=2), "between 0 and",
     dict(async_steps=2, truncated_importance_sampling_ratio_cap=2.0, max_sample_staleness=1)),
    (dict(max_sample_staleness=1), "between 0 and", dict(max_sample_staleness=0)),
    (dict(async_steps=1, loss_fn="ess", truncated_importance_sampling_ratio_cap=2.0), "ess",
     dict(async_steps=1, loss_fn="ess", use_vllm_logprobs=True)),
    (dict(async_steps=1, use_vllm_logprobs=True, single_gpu_mode=True), "sleep",
     dict(async_steps=0, single_gpu_mode=True, vllm_gpu_memory_utilization=0.3)),
    (dict(load_ref_policy=False, beta=0.1), "beta", dict(load_ref_policy=False, beta=0.0)),
    (dict(load_ref_policy=False, ref_policy_update_freq=5), "no reference", dict(ref_policy_update_freq=5, beta=0.1)),
    (dict(ref_policy_update_freq=0, beta=0.1), "ref_policy_update_freq=0 must be >= 1 steps, or None", dict(ref_policy_update_freq=1, beta=0.1)),
    (dict(ref_policy_update_freq=5), "nothing uses the reference", dict(ref_policy_update_freq=5, beta=0.1)),
    (dict(top_p=0.9), "nucleus", dict(top_p=1.0)),
    (dict(truncated_importance_sampling_ratio_cap=0.5), "below 1",
     dict(truncated_importance_sampling_ratio_cap=1.0)),
    (dict(seed=2**31), "seed", dict(seed=2**31 - 1)),
    (dict(learning_rate=float("inf")), "finite", dict(learning_rate=1e30)),
    (dict(vllm_server_urls=["gpu-node:8000"]), "not a URL", dict(vllm_server_urls=["http://gpu-node:8000"])),
    (dict(learning_rate=-1e-3), "learning_rate", dict(learning_rate=0.0)),
    (dict(weight_decay=-0.1), "weight_decay", dict(weight_decay=0.1)),
    (dict(max_grad_norm=-1.0), "max_grad_norm", dict(max_grad_norm=0.0)),
    (dict(warm_up_steps=-1), "warm_up_steps", dict(warm_up_steps=0)),
    (dict(eval_freq=-1), "eval_freq", dict(eval_freq=0)),
    (dict(vllm_logp_tolerance=0.0), "vllm_logp_tolerance", dict(vllm_logp_tolerance=1e-3)),
    (dict(vllm_port=70000), "vllm_port", dict(vllm_port=8000)),
    (dict(max_turns=3), "max_turns act only with environment, agent or agent_cmd set",
     dict(max_turns=3, environment="envs.calculator:calculator")),
    (dict(tool_call_parser="hermes"), "tool_call_parser act only with environment, agent or agent_cmd set",
     dict(tool_call_parser="hermes", agent="examples/calculator_agent.py:solve")),
    (dict(agent_workers=2), "agent_workers act only with agent or agent_cmd set", dict(agent_workers=2, agent_cmd="true")),
    (dict(agent="a.py:f", environment="envs.calculator:calculator"), "set one of them", dict(agent="a.py:f")),
    (dict(agent="a.py:f", agent_cmd="true"), "set one of them", dict(agent_cmd="true")),
    (dict(vllm_importance_sampling_mask="seq"), "vllm_importance_sampling_mask",
     dict(vllm_importance_sampling_mask="sequence")),
    (dict(vllm_importance_sampling_mask="token", vllm_importance_sampling_mask_cap=0.5), "must be > 1",
     dict(vllm_importance_sampling_mask="token", vllm_importance_sampling_mask_cap=1.5)),
    (dict(vllm_importance_sampling_mask="token", use_vllm_logprobs=True), "ratio",
     dict(vllm_importance_sampling_mask="token")),
    (dict(active_sampling=True, filter_zero_std_samples=False), "nothing is dropped", dict(active_sampling=True)),
    (dict(active_sampling=True, active_sampling_max_rounds=0), "active_sampling_max_rounds",
     dict(active_sampling=True, active_sampling_max_rounds=1)),
    (dict(alpha=0.0), "alpha", dict(alpha=1.0)),
    (dict(sequence_parallel_size=0), "sequence_parallel_size=0 must be >= 1", dict(sequence_parallel_size=2)),
    (dict(sequence_parallel_size=2, attn_implementation="sdpa"), "attn_implementation='sdpa' is not supported",
     dict(sequence_parallel_size=1, attn_implementation="sdpa")),
    (dict(sequence_parallel_size=2, loss_fn="gspo"), "loss_fn='gspo'", dict(sequence_parallel_size=2, loss_fn="cispo")),
    (dict(kl_topk=4, beta=0.1), "kl_topk", dict(kl_topk=4, kl_estimator="topk", beta=0.1)),
    (dict(kl_estimator="topk", kl_topk=-1), "kl_topk", dict(kl_estimator="topk", kl_topk=0)),
    (dict(kl_estimator="topk", kl_topk=4), "no effect with beta=0", dict(kl_estimator="topk", kl_topk=4, beta=0.1)),
    (dict(loss_fn="ess", clip_higher=0.5), "does not read clip_higher", dict(loss_fn="ess")),
    (dict(loss_fn="cispo", clip_lower=0.1), "does not read clip_lower", dict(loss_fn="cispo", clip_higher=0.5)),
    (dict(ess_scope="micro_batch"), "only applies", dict(ess_scope="micro_batch", loss_fn="ess")),
    (dict(loss_fn="ess", ess_scope="batch"), "ess_scope", dict(loss_fn="ess", ess_scope="step")),
    (dict(loss_fn="ppo"), "loss_fn", dict(loss_fn="cispo")),
    (dict(kl_estimator="k5"), "kl_estimator", dict(kl_estimator="k4")),
    (dict(advantage_normalization_type="z"), "advantage_normalization_type", dict(advantage_normalization_type="centered")),
    (dict(lr_scheduler_type="step"), "lr_scheduler_type", dict(lr_scheduler_type="cosine")),
    (dict(weight_sync_transport="ipc"), "weight_sync_transport", dict(weight_sync_transport="nccl")),
    (dict(clip_lower=1.0), "clip_lower", dict(clip_lower=0.0)),
    (dict(beta=-1.0), "beta", dict(beta=1.0)),
    (dict(temperature=0.0), "temperature", dict(temperature=0.7)),
    (dict(num_samples_per_prompt_rollout=1), "num_samples_per_prompt_rollout", dict(num_samples_per_prompt_rollout=2)),
    (dict(num_epochs=0), "num_epochs", dict(num_epochs=2)),
    (dict(num_mini_batches=3), "divisible", dict(num_mini_batches=4)),
    (dict(vllm_max_model_len=32), "vllm_max_model_len", dict(vllm_max_model_len=80)),
    (dict(weight_sync_transport="nccl", vllm_server_urls=["http://a:1", "http://b:1"]), "one vLLM server",
     dict(vllm_server_urls=["http://a:1", "http://b:1"])),
    (dict(truncated_importance_sampling_ratio_cap=-1.0), "truncated_importance", dict(truncated_importance_sampling_ratio_cap=2.0)),
    (dict(sequence_parallel_size=4, fsdp_shard_size=2), "must divide fsdp_shard_size=2",
     dict(sequence_parallel_size=2, fsdp_shard_size=4)),
    (dict(sequence_parallel_size=2, vllm_importance_sampling_mask="sequence"), "mask='sequence'",
     dict(sequence_parallel_size=2, vllm_importance_sampling_mask="token")),
    (dict(sequence_parallel_size=2, single_gpu_mode=True, vllm_gpu_memory_utilization=0.3), "needs 2 ranks",
     dict(single_gpu_mode=True, vllm_gpu_memory_utilization=0.3)),
    (dict(weight_sync_dir="/nfs/sync", weight_sync_transport="nccl"), "weight_sync_dir", dict(weight_sync_dir="/nfs/sync")),
    (dict(fsdp_shard_size=-1), "fsdp_shard_size", dict(fsdp_shard_size=8)),
    (dict(offload_ref_policy=True, load_ref_policy=False), "no reference to offload", dict(offload_ref_policy=True)),
    (dict(single_gpu_mode=True, vllm_server_urls=["http://a:1"], vllm_gpu_memory_utilization=0.3),
     "remove vllm_server_urls", dict(single_gpu_mode=True, vllm_gpu_memory_utilization=0.3)),
    (dict(single_gpu_mode=True, weight_sync_transport="nccl", vllm_gpu_memory_utilization=0.3), "filesystem",
     dict(single_gpu_mode=True, weight_sync_transport="filesystem", vllm_gpu_memory_utilization=0.3)),
    (dict(single_gpu_mode=True), "at most 0.5", dict(single_gpu_mode=True, vllm_gpu_memory_utilization=0.5)),
    (dict(vllm_gpu_memory_utilization=1.5), "vllm_gpu_memory_utilization", dict(vllm_gpu_memory_utilization=1.0)),
    (dict(weight_sync_timeout=0.0), "weight_sync_timeout", dict(weight_sync_timeout=5.0)),
    (dict(vllm_request_timeout=-1.0), "vllm_request_timeout", dict(vllm_request_timeout=1.0)),
    (dict(backend_timeout=0), "backend_timeout", dict(backend_timeout=60)),
    (dict(weight_sync_timeout=3600.0), "raise backend_timeout", dict(weight_sync_timeout=3600.0, backend_timeout=61)),
]


@pytest.mark.parametrize("bad,fragment,good", RULES, ids=[f"{i}-{r[1]}" for i, r in enumerate(RULES)])
def test_rule_rejects_bad_accepts_good(bad, fragment, good):
    with pytest.raises(ValueError, match=fragment):
        Config(**bad)
    Config(**good)


def test_the_reference_is_built_only_when_the_kl_reads_it():
    assert not Config().uses_reference and Config(beta=0.1).uses_reference
    assert not Config(load_ref_policy=False).uses_reference


def test_defaults_are_open_instructs_polyak_reference_and_daposs_token_loss():
    c = Config()
    assert (c.alpha, c.ref_policy_update_freq, c.loss_denominator, c.clip_lower) == (0.6, None, "token", 0.2)


def test_batch_plan_names_the_numbers():
    c = Config(num_unique_prompts_rollout=16, num_samples_per_prompt_rollout=8, num_mini_batches=2,
               max_prompt_length=64, response_length=8, max_tokens_per_micro_batch=1000)
    plan = batch_plan(c, world_size=2)  # 32 sequences of up to 72 tokens per rank: 2304 tokens, 3 micro-batches
    assert plan == dict(sequences=128, mini_batches=2, per_mini_batch=64, per_rank=32, micro_batches_at_full_length=3,
                        optimizer_steps=2)
    assert batch_plan(c, world_size=3)["per_rank"] == 22  # ranks are balanced by tokens: no need to divide evenly
    with pytest.raises(ValueError, match="raise it to at least 72"):
        Config(max_prompt_length=64, response_length=8, max_tokens_per_micro_batch=71)


@pytest.mark.parametrize("cfg,world,fragment", [
    (dict(fsdp_shard_size=3), 4, "pick a divisor of 4"),
    (dict(fsdp_shard_size=8), 4, "pick a divisor of 4"),
    (dict(single_gpu_mode=True, vllm_gpu_memory_utilization=0.3), 2, "without torchrun"),
])
def test_world_size_rules_refuse_in_mesh_shape(cfg, world, fragment):
    with pytest.raises(ValueError, match=fragment):
        mesh_shape(Config(num_unique_prompts_rollout=16, **cfg), world)


def test_mesh_shape():
    assert mesh_shape(Config(), 4) == (1, 4)  # shard over all ranks
    assert mesh_shape(Config(fsdp_shard_size=4), 4) == (1, 4)
    assert mesh_shape(Config(fsdp_shard_size=2), 4) == (2, 2)  # hybrid: 2 replicas of a 2-way shard
    assert mesh_shape(Config(fsdp_shard_size=8), 32) == (4, 8)  # 4 nodes of 8 GPUs
    assert mesh_shape(Config(fsdp_shard_size=1), 2) == (2, 1)  # full replication (DDP's memory)
    assert mesh_shape(Config(single_gpu_mode=True, vllm_gpu_memory_utilization=0.3), 1) == (1, 1)


@pytest.mark.subprocess
def test_train_py_refuses_a_mesh_before_starting_anything(tmp_path):
    env = dict(os.environ, WORLD_SIZE="4", RANK="0")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--fsdp_shard_size", "3",
                          "--output_dir", str(tmp_path / "out")], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 2 and "fsdp_shard_size=3" in out.stderr and out.stderr.strip().count("\n") == 0
    assert not (tmp_path / "out").exists()


def test_cli_forms():
    c = parse_args(Config, ["--beta", "0.1", "--clip_higher=0.3", "--with_tracking", "--filter_zero_std_samples=false",
                    "--ref_policy_update_freq", "None", "--vllm_server_urls", "http://a:1,http://b:2",
                    "--loss_denominator", "512", "--seed", "7"])
    assert c.beta == 0.1 and c.clip_higher == 0.3 and c.with_tracking is True
    assert c.filter_zero_std_samples is False and c.ref_policy_update_freq is None
    assert c.vllm_server_urls == ["http://a:1", "http://b:2"] and c.loss_denominator == "512" and c.seed == 7
    assert parse_args(Config, ["--ref_policy_update_freq", "4", "--beta", "0.1"]).ref_policy_update_freq == 4
    # an Optional[bool] field as a bare flag is True, as a bool field is; None stays writable
    assert parse_args(Config, ["--vllm_colocate", "--seed", "7"]).vllm_colocate is True
    assert parse_args(Config, ["--vllm_colocate", "none"]).vllm_colocate is None


@pytest.mark.parametrize("argv,fragment", [
    (["--learning_rat", "1e-4"], "did you mean 'learning_rate'"),
    (["--seed", "1.5"], "--seed expects int"),
    (["--beta", "abc"], "--beta expects float"),
    (["--with_tracking", "maybe"], "true or false"),
    (["--beta"], "needs a value"),
    (["beta", "1"], "unexpected argument"),
    (["--config", "/nonexistent.toml"], "does not exist"),
    (["--per_device_train_batch_size", "8"], "set max_tokens_per_micro_batch"),
])
def test_cli_rejects_with_exit_2(argv, fragment, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(Config, argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1


def test_cli_contradiction_raises_value_error():
    with pytest.raises(ValueError, match="beta"):
        parse_args(Config, ["--load_ref_policy=false", "--beta", "0.5"])


def test_file_then_cli_precedence(tmp_path, capsys):
    f = tmp_path / "run.toml"
    f.write_text('beta = 0.2\nseed = 3\nvllm_server_urls = ["http://x:1"]\nwith_tracking = true\n')
    c = parse_args(Config, ["--config", str(f), "--seed", "9"])
    assert (c.beta, c.seed, c.vllm_server_urls, c.with_tracking) == (0.2, 9, ["http://x:1"], True)
    c = parse_args(Config, ["--seed=9", "--config", str(f)])  # order on the line does not matter: flags win
    assert c.seed == 9
    f.write_text("betta = 0.2\n")
    with pytest.raises(SystemExit):
        parse_args(Config, ["--config", str(f)])
    assert "did you mean 'beta'" in capsys.readouterr().err
    f.write_text('seed = "three"\n')
    with pytest.raises(SystemExit):
        parse_args(Config, ["--config", str(f)])
    assert "--seed expects int" in capsys.readouterr().err


def test_help_lists_every_field_with_default_and_help():
    text = help_text(Config)
    for f in dataclasses.fields(Config):
        line = next(line for line in text.splitlines() if line.startswith(f"  --{f.name} (default"))
        help_line = text.split(line + "\n", 1)[1].splitlines()[0].strip()
        assert help_line and help_line in " ".join(f.metadata["help"].split()), f.name


@pytest.mark.subprocess
def test_train_py_help():
    out = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0
    assert "--ref_policy_update_freq (default None)" in out.stdout and "--alpha (default 0.6)" in out.stdout


@pytest.mark.subprocess
def test_train_py_bad_value_is_one_line():
    out = subprocess.run([sys.executable, "train.py", "--loss_fn", "ppo"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "loss_fn='ppo'" in out.stderr


@pytest.mark.skipif(config.flash_attention_available(), reason="flash attention runs here")
def test_flash_attention_without_a_gpu_or_flash_attn_is_one_line():
    with pytest.raises(ValueError, match="needs a CUDA GPU and the flash-attn package"):
        Config(attn_implementation="flash_attention_2")


def test_max_seed_keeps_every_request_seed_in_int64(tiny_model_dir):
    """Enumerate the seeds of the last step's every round (rollout.rollout_batch, every group
    filtered so all rounds run) at seed=max_seed: the largest sample seed fits vLLM's int64,
    and one more seed would not."""
    from transformers import AutoTokenizer

    from data import PromptSampler
    from rollout import rollout_batch
    from infra.worker_pool import RewardPool

    T, R, P, N = 3, 2, 2, 4
    cfg = Config(num_training_steps=T, active_sampling=True, active_sampling_max_rounds=R,
                 num_unique_prompts_rollout=P, num_samples_per_prompt_rollout=N)
    assert max_seed(cfg) == (2**63 - 1 - ((T + 1) * (R + 1) * P * N - 1)) // 2**32 == 2**31 - 1
    cfg = Config(**{**dataclasses.asdict(cfg), "seed": max_seed(cfg)})
    sent = []

    def submit(prompt_ids, n, max_tokens, temperature=1.0, top_p=1.0, seed=None, stop=()):  # vLLM: seed + j
        sent.extend(seed + j for j in range(n))
        future = concurrent.futures.Future()  # one answer per group: zero std, every group filtered
        future.set_result([dict(token_ids=[5], logprobs=[-0.1], finish_reason="length", text="", version=0)] * n)
        return future

    client = type("Client", (), {"submit": staticmethod(submit)})()
    rows = [dict(prompt_ids=[k], prompt_text=str(k), answer="a") for k in range(20)]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rollout_batch(cfg, client, PromptSampler(rows, 0), T, RewardPool(lambda p, c, e: 1.0, workers=0), tok, Completions(cfg, tok))
    assert len(sent) == (R + 1) * P * N and len(set(sent)) == len(sent)
    assert max(sent) == cfg.seed * 2**32 + (T + 1) * (R + 1) * P * N - 1
    assert max(sent) <= 2**63 - 1 < max(sent) + 2**32  # seed + 1 would overflow


@pytest.fixture
def any_compute_mode(monkeypatch):
    """check_launch's rules, not this node's GPUs: on a GPU node check_launch would ask nvidia-smi for
    their compute mode (test_an_exclusive_process_gpu_refuses_a_colocated_server takes its answers)."""
    monkeypatch.setattr(colocation, "query_compute_modes", lambda: None)


def test_a_gpu_run_shares_its_gpus_with_the_server_unless_told_not_to(any_compute_mode):
    """On GPUs without vllm_server_urls the server we launch shares the training GPUs (colocated,
    asleep while training); with vllm_colocate=False it has nowhere to go: refused naming the launcher."""
    with pytest.raises(ValueError, match="bash scripts/launch_8gpu.sh"):
        check_launch(Config(vllm_colocate=False), cuda=True)
    check_launch(Config(), cuda=True)  # the card's command: the server shares the training GPUs
    check_launch(Config(), cuda=False)  # CPU: the server we launch takes the CPU's cores
    check_launch(Config(vllm_server_urls=["http://gpu-node:8000"]), cuda=True)
    check_launch(Config(single_gpu_mode=True, vllm_gpu_memory_utilization=0.3), cuda=True)
    # colocated by default on GPUs: what a sleeping server cannot do is refused there, not on a CPU
    bad = Config(async_steps=1, use_vllm_logprobs=True)
    with pytest.raises(ValueError, match="set async_steps=0 and weight_sync_transport='filesystem'"):
        check_launch(bad, cuda=True)
    check_launch(bad, cuda=False)
    check_launch(dataclasses.replace(bad, vllm_server_urls=["http://gpu-node:8000"]), cuda=True)


def test_a_colocated_server_refuses_several_nodes_and_a_tensor_parallel_size_off_the_node(monkeypatch,
                                                                                        any_compute_mode):
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(ValueError, match="several nodes would share one colocated server"):
        check_launch(Config(), cuda=True)
    check_launch(Config(vllm_server_urls=["http://gpu-node:8000"]), cuda=True)
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(ValueError, match="vllm_tensor_parallel_size=3 does not divide this node's 8 GPUs"):
        check_launch(Config(vllm_tensor_parallel_size=3), cuda=True)
    check_launch(Config(vllm_tensor_parallel_size=4), cuda=True)


# nvidia-smi --query-gpu=index,uuid,compute_mode --format=csv,noheader on a node of 4 GPUs, the third exclusive
SMI = ("0, GPU-a1b2c3d4-0000-0000-0000-000000000000, Default\n"
       "1, GPU-b2c3d4e5-0000-0000-0000-000000000000, Default\n"
       "2, GPU-c3d4e5f6-0000-0000-0000-000000000000, Exclusive_Process\n"
       "3, GPU-d4e5f6a7-0000-0000-0000-000000000000, Default\n")


def test_an_exclusive_process_gpu_refuses_a_colocated_server():
    """A GPU the job uses (the first LOCAL_WORLD_SIZE of CUDA_VISIBLE_DEVICES, by index or UUID) in
    Exclusive_Process mode is refused in one line naming it and the fix; one it does not use is not."""
    with pytest.raises(ValueError, match=r"^GPU 2 is in Exclusive_Process compute mode.*nvidia-smi -i 2 -c DEFAULT"):
        check_compute_modes(SMI, None, 4)
    check_compute_modes(SMI, None, 2)  # GPUs 0 and 1
    with pytest.raises(ValueError, match="GPU 2 is in"):
        check_compute_modes(SMI, "3,2", 2)
    check_compute_modes(SMI, "3,2", 1)
    with pytest.raises(ValueError, match="GPU 2 is in"):
        check_compute_modes(SMI, "GPU-a1b2, GPU-c3d4e5f6", 2)  # UUID prefixes, as CUDA takes them
    check_compute_modes(SMI.replace("Exclusive_Process", "Default"), None, 4)
    check_compute_modes(None, None, 4)  # no nvidia-smi: not asked
    check_compute_modes("", "", 0)


@pytest.mark.parametrize("bad,message", [
    (dict(vllm_port=0), "vllm_port=0 must be in [1, 65535]"),
    (dict(weight_sync_master_port=65536), "weight_sync_master_port=65536 must be in [1, 65535]"),
    (dict(vllm_gpu_memory_utilization=0.0), "vllm_gpu_memory_utilization=0.0 must be in (0, 1]"),
    (dict(clip_lower=1.0), "clip_lower=1.0 must be in [0, 1)"),
    (dict(alpha=1.5), "alpha=1.5 must be in (0, 1]"),
    (dict(kl_topk=-1), "kl_topk=-1 must be >= 0"),
    (dict(vllm_cpu_threads=0), "vllm_cpu_threads=0 must be >= 1"),
    (dict(math_digits=10), "math_digits=10 must be in [1, 9]"),
    (dict(fsdp_shard_size=-2), "fsdp_shard_size=-2 must be >= 0 (0: shard over all ranks)"),
])
def test_a_fields_bounds_are_in_its_metadata_and_its_message(bad, message):
    """Bounds written once, in the field's option(...), refused with the field, its value and the range."""
    with pytest.raises(ValueError) as e:
        Config(**bad)
    assert str(e.value) == message
    name = next(iter(bad))
    meta = Config.__dataclass_fields__[name].metadata
    Config(**{name: meta["low"] if meta["low"] is not None else meta["high"]})  # a closed edge is inside
    Config(vllm_cpu_threads=None)  # None passes every bound
