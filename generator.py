"""The trainer's side of vLLM: the server, the weights in it, and each step's batch on every rank.

    gen = Generator(cfg, policy, tokenizer, sampler, pool, rank, device, player, memory_plan)
    samples, m = gen.batch(step, policy)   # every rank; rank 0 asks vLLM, scores, broadcasts
    gen.sync(policy)                       # every rank: the policy's weights into the server
    gen.close()

The server is ours (launched on an untied copy of the policy, stopped on close) or the
user's (vllm_server_urls, given our weights first). A server we launched that dies is
restarted, up to vllm_max_restarts times, given the current weights, and asked for the
same step's prompts again; any other failure raises VLLMError on every rank.
"""

import os

import torch
import torch.distributed as dist
from tqdm import tqdm

import memory
import vllm_client
import vllm_server
from faults import Refused, VLLMError
from model_files import stop_token_ids
from rollout import Rollouts, drop_stale, evaluate, rollout_batch
from tracking import claim_output_dir
from weight_sync import make_weight_sync, raise_on_every_rank, write_serving_dir


def make_sync(cfg, client, rank, device):
    """The weight sync the config asks for (weight_sync.py); with LoRA the adapter's, or the merged
    weights' (lora/sync.py, LoRA's door: imported only then)."""
    if cfg.lora_rank:
        from lora import sync as lora_sync  # noqa: PLC0415 - the optional concept's door
        return lora_sync.make_weight_sync(cfg, client, rank)
    return make_weight_sync(cfg, client, rank, device, vllm_server.server_dtype(cfg))


class Generator:
    def __init__(self, cfg, policy, tokenizer, sampler, pool, rank, device, player, memory_plan=None):
        self.cfg, self.tokenizer, self.sampler, self.pool, self.rank, self.device = cfg, tokenizer, sampler, pool, rank, device
        self.player = player  # what plays the episodes (episodes.Player), chosen at start-up
        if rank == 0:
            try:
                player.start()  # an environment's calls, an agent's programs: in worker processes
            except ValueError as e:  # it cannot run here (a sandbox without bwrap): one line, before training
                raise SystemExit(f"error: {e}") from None
        self.client = self.server = self.weight_sync = self.rollouts = None
        self.restarts, self.position = 0, sampler.position  # the sampler's position after the last batch taken
        self.max_staleness = cfg.async_steps if cfg.max_sample_staleness is None else cfg.max_sample_staleness
        self.log_path = os.path.join(cfg.output_dir, "vllm.log")
        self.colocated = vllm_server.colocated(cfg, device.type == "cuda")  # asleep while the policy trains
        self.memory_plan = memory_plan
        self.served = os.path.join(cfg.output_dir, "vllm_model")
        try:
            # the model's every end-of-sequence id, sent with each request: the server we launch
            # ignores generation_config.json (--generation-config vllm), and its serving copy has none
            stop_ids = stop_token_ids(tokenizer, cfg.model_name_or_path)
            if rank == 0:  # before the serving copy and the log below are written (train.load_inputs may have claimed it)
                try:
                    claim_output_dir(cfg.output_dir)
                except ValueError as e:
                    raise SystemExit(f"error: {e}") from None
            if rank == 0 and cfg.vllm_server_urls:
                # the key from the environment, not the config: the config is saved in run_info.json and
                # every checkpoint, and a flag is visible to every local user in ps
                self.client = vllm_client.VLLMClient(cfg.vllm_server_urls, None, cfg.vllm_request_timeout,
                                                 cfg.vllm_max_retries, stop_token_ids=stop_ids,
                                                 api_key=os.environ.get("VLLM_API_KEY"))
            self.weight_sync = make_sync(cfg, self.client, rank, device)  # it says what our server starts from
            full = self.weight_sync.launch_state_dict(policy)  # a collective: every rank takes part
            if rank == 0 and not cfg.vllm_server_urls:
                write_serving_dir(full, policy.config, tokenizer, self.served)
                self.server, url = vllm_server.launch_server(self.served, cfg, self.log_path,
                                                             extra_args=self.server_flags())
                self.client = vllm_client.VLLMClient([url], self.served, cfg.vllm_request_timeout, cfg.vllm_max_retries,
                                                 proc=self.server, log_path=self.log_path, stop_token_ids=stop_ids)
                self.weight_sync.client = self.client
            del full
            if cfg.vllm_server_urls or self.weight_sync.sync_at_start:
                self.weight_sync.sync(policy)  # the user's server starts from our weights; requests name our adapter
        except BaseException:
            self.close()
            raise

    def make_batch(self, step):
        return rollout_batch(self.cfg, self.client, self.sampler, step, self.pool, self.tokenizer, self.player)

    def batch(self, step, policy):
        """(samples, metrics) of `step` on every rank: rank 0 takes them from vLLM (generated ahead
        with async_steps), drops stale samples and broadcasts them. Restarts a dead server of ours."""
        while True:
            payload = [None]
            if self.rank == 0:
                try:
                    if self.rollouts is None:  # from the first step asked for (again, after a restart)
                        self.rollouts = Rollouts(self.make_batch, step, self.cfg.num_training_steps,
                                                 self.cfg.async_steps)
                    samples, m = self.rollouts.get(step)
                    samples, stale = drop_stale(samples, self.client.version, self.max_staleness,
                                                self.cfg.num_samples_per_prompt_rollout)
                    payload = [(samples, dict(m, **stale, vllm_restarts=self.restarts))]
                except VLLMError as e:
                    died = self.server is not None and self.server.poll() is not None
                    payload = [dict(error=str(e), restart=died and self.restarts < self.cfg.vllm_max_restarts)]
                except Refused as e:  # episodes nobody could score, an environment's answer the policy cannot see
                    payload = [dict(error=str(e), restart=False, refused=True)]
            dist.broadcast_object_list(payload, src=0)
            if isinstance(payload[0], tuple):
                samples, m = payload[0]
                self.position = m["prompts_seen"]  # what a checkpoint of this step records
                return samples, m
            if payload[0].get("refused"):  # every rank stops (train.py checkpoints, then says why in one line)
                raise Refused(payload[0]["error"])
            if not payload[0]["restart"]:
                raise VLLMError(payload[0]["error"])
            self.restart(step, policy)

    def restart(self, step, policy):
        """Relaunch our dead server, give it the current weights, and ask for `step`'s prompts again."""
        self.restarts += 1
        if self.colocated and self.device.type == "cuda":
            torch.cuda.empty_cache()  # a colocated server's start-up wants its share of the GPU free
        if self.rank == 0:
            tqdm.write(f"step {step}: the vLLM server died; restart {self.restarts} of {self.cfg.vllm_max_restarts}")
            self.rollouts.close()
            self.rollouts = None
            self.sampler.position = self.position  # this step's prompts again
            vllm_server.stop_server(self.server)
            self.server, url = vllm_server.launch_server(self.served, self.cfg, self.log_path,
                                                         extra_args=self.server_flags())
            self.client.proc, self.client.urls = self.server, [url]  # a new socket
        self.weight_sync.close()
        self.weight_sync = make_sync(self.cfg, self.client, self.rank, self.device)
        self.weight_sync.sync(policy)

    def server_flags(self):
        """The flags of the server we launch: the weight sync's, and a colocated server's (vllm_server.py)."""
        if not self.colocated:
            return tuple(self.weight_sync.server_flags)
        gpu = torch.cuda.get_device_properties(self.device).total_memory if self.device.type == "cuda" else 0
        gpus = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        fraction = (memory.colocated_fraction(self.cfg, *self.memory_plan, gpus, gpu) if gpu and self.memory_plan
                    else self.cfg.vllm_gpu_memory_utilization)  # memory_plan: train.py's (memory.py)
        return tuple(self.weight_sync.server_flags) + tuple(vllm_server.colocate_flags(self.cfg, fraction))

    def sleep(self):
        """A colocated server frees the GPUs for training."""
        if self.colocated:
            self.ask_server(self.client.sleep if self.rank == 0 else None)

    def sync(self, policy, trained=True):
        """The policy's weights into every server (every rank takes part), when the step trained; VLLMError if
        that fails. A colocated server wakes its weights first (the reload writes into them, and a wake
        after it would bring back the old ones), then its KV cache, for the evaluation and the next
        batch; the trainers first hand back the GPU memory their allocator keeps cached."""
        if self.colocated:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.ask_server((lambda: self.client.wake_up("weights")) if self.rank == 0 else None)
        if trained:
            self.weight_sync.sync(policy)
        if self.colocated:
            self.ask_server((lambda: self.client.wake_up("kv_cache")) if self.rank == 0 else None)

    def ask_server(self, call):
        """Rank 0 makes `call` to the colocated server; every rank learns how it went (a collective, so no
        rank trains before the server slept, and a failure stops every rank alike, each able to save its
        checkpoint). A server of ours that died is no failure here: the next batch restarts it."""
        error = None
        if call:
            try:
                call()
            except VLLMError as e:
                error = None if self.server is not None and self.server.poll() is not None else str(e)
        raise_on_every_rank(error)

    def evaluate(self, eval_rows):
        """Rank 0: greedy accuracy on the held-out prompts (and with episodes of several turns the
        fraction that called a tool), as metrics."""
        accuracy, tool_calls = evaluate(self.client, eval_rows, self.pool, self.player)
        return dict(eval_accuracy=accuracy, **({"eval_tool_calls": tool_calls} if self.player.multi_turn else {}))

    def close(self):
        if self.rollouts:
            self.rollouts.close()
        if self.weight_sync:
            self.weight_sync.close()
        if self.rank == 0:
            self.player.close()
            vllm_server.stop_server(self.server)
