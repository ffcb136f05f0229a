"""Start-up: what a run reads and checks before it starts anything, and the lines that
describe it. Bad input stops every rank here with one line naming the fix (`error: ...`,
exit 2) before any process group, model or server; train.py calls load_inputs first and
announce once the state is built.

The optional concepts' start-up doors (each imported only when its flag is set):
    load_inputs    envs.environment (--environment), agent_programs (--agent, --agent_cmd)
    check_outside  lora.check (lora_rank), sequence_parallel.check_heads (sequence_parallel_size > 1)
    announce       lora.describe (lora_rank)
"""

import json
import os
import sys
import time
import urllib.error
import urllib.request

import torch

import packing
import tracking
from data import load_prompts
from generator import claim_output_dir
from model_files import load_model_config, load_tokenizer, locate_model
from plan import batch_plan, check_launch
from policy import check_model_config, check_vocabulary


def check_outside(cfg):
    """What the config names outside this process: the model's config.json, the directories
    the run writes and the servers you run. ValueError with one line naming the fix."""
    model_config = load_model_config(cfg)
    check_vocabulary(model_config, cfg.kl_topk)
    meta_model = check_model_config(model_config)  # an LM head or layout the logprobs do not implement
    if cfg.lora_rank:  # LoRA targets the model lacks, or outside its decoder layers
        import lora  # noqa: PLC0415 - the optional concept's door
        lora.check(meta_model, cfg)
    if cfg.sequence_parallel_size > 1:
        from sequence_parallel import check_heads
        check_heads(model_config, cfg.sequence_parallel_size)
    for name in ("output_dir", "checkpoint_state_dir", "weight_sync_dir"):
        path = getattr(cfg, name)
        if path is None:
            continue
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:  # a file of that name, a read-only or virtual file system (/proc)
            raise ValueError(f"{name}={path!r} cannot be made a directory ({e.strerror}); pick a writable "
                             "directory") from None
        if not os.access(path, os.W_OK):
            raise ValueError(f"{name}={path!r} is not writable; pick a writable directory")
    if int(os.environ.get("RANK", 0)) == 0:
        claim_output_dir(cfg.output_dir)  # a second run into it stops here, before it overwrites anything
    for url in cfg.vllm_server_urls if int(os.environ.get("RANK", 0)) == 0 else ():  # only rank 0 talks to them
        try:
            urllib.request.urlopen(url + "/health", timeout=cfg.vllm_request_timeout).close()
        except (urllib.error.URLError, OSError) as e:
            raise ValueError(f"vllm_server_urls: {url} does not answer /health ({getattr(e, 'reason', e)}); "
                             "start the server first or fix the URL") from None


def load_inputs(cfg):
    """Tokenizer, prompts, reward and tracker; bad input exits with one line naming the fix,
    before any process group, model or server."""
    rank0 = int(os.environ.get("RANK", 0)) == 0
    try:
        check_launch(cfg, torch.cuda.is_available())  # where our vLLM server would go, before any model
        batch_plan(cfg, int(os.environ.get("WORLD_SIZE", 1)))
        locate_model(cfg.model_name_or_path)  # in seconds offline, not after the hub's minute of retries
        tokenizer = load_tokenizer(cfg)
        check_outside(cfg)
        env = None
        if cfg.environment:  # episodes of several turns, answered by an environment
            from envs.environment import Environment  # noqa: PLC0415 - the optional concept's one door

            env = Environment(cfg.environment, tokenizer, cfg)
        train_rows, eval_rows, skipped, reward_fn = load_prompts(cfg, tokenizer, env)
        if cfg.agent_program:  # episodes played by a program, through the gateway
            from agent_programs import Agents  # noqa: PLC0415 - the optional concept's one door

            env = Agents(cfg, tokenizer)
        return tokenizer, env, train_rows, eval_rows, skipped, reward_fn, tracking.open_tracker(cfg) if rank0 else None
    except ValueError as e:
        if rank0:
            print(f"error: {e}", file=sys.stderr)
        else:  # torchrun ends every rank when one exits: rank 0 says why first
            time.sleep(5)
        sys.exit(2)


def announce(cfg, plan, world_size, device, data, resumed_from, start, policy):
    """Rank 0, before step 0: what reproduces the run (run_info.json) and the batch arithmetic."""
    train_rows, eval_rows, skipped, reward = data
    info = tracking.run_info(cfg, world_size)
    with open(os.path.join(cfg.output_dir, "run_info.json"), "w") as f:
        json.dump(dict(info, skipped_rows=skipped, resumed_from=resumed_from), f, indent=2)
    print(f"run: {json.dumps(info['versions'])}, git {info['git_sha']}, world size {world_size}, device {device}")
    sp = cfg.sequence_parallel_size
    share = "rank" if sp == 1 else f"group of {sp} ranks (each holds 1/{sp} of every row)"
    print(f"batch: {cfg.num_unique_prompts_rollout} prompts x {cfg.num_samples_per_prompt_rollout} samples = "
          f"{plan['sequences']} sequences -> {plan['mini_batches']} mini-batch(es) of {plan['per_mini_batch']} -> "
          f"about {plan['per_rank']} per {share}, balanced by tokens -> micro-batches of at most "
          f"{cfg.max_tokens_per_micro_batch} tokens ({plan['micro_batches_at_full_length']} if every sequence had "
          f"its full length); {plan['optimizer_steps']} optimizer step(s) per rollout")
    if line := packing.unshared_reason(cfg):
        print(line)
    print(f"data: {len(train_rows)} train / {len(eval_rows)} eval prompts from {cfg.dataset!r}, skipped {skipped}; "
          f"reward {reward}")
    if cfg.lora_rank:
        import lora  # noqa: PLC0415 - the optional concept's door
        print(lora.describe(policy, cfg))
    if resumed_from:
        print(f"resumed from {resumed_from} (step {start})")


def reward_name(cfg, env, reward_fn):
    """What scores: an environment with a reward method scores its episodes (a --reward_fn is added)."""
    if env and env.scores and cfg.agent_program:
        name = getattr(reward_fn, "__name__", str(reward_fn))
        return f"{env.name}'s return" + (f" + {cfg.reward_fn}" if cfg.reward_fn else f" (None: {name})")
    if env and env.scores:
        return f"{cfg.environment}'s own" + (f" + {cfg.reward_fn}" if cfg.reward_fn else "")
    return getattr(reward_fn, "__name__", str(reward_fn))
