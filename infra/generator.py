"""The trainer's side of vLLM: the server, the weights in it, and each step's batch on every rank.

    gen = Generator(cfg, policy, tokenizer, rank, device, make_batch, make_sync, sampler, player, memory_plan)
    samples, m = gen.batch(step, policy)   # every rank; rank 0 has make_batch(client, step) ask vLLM and score
    gen.sync(policy)                       # every rank: the policy's weights into the server
    gen.close()

The loop hands it what a batch is (make_batch: rollout.rollout_batch, which plays, scores and
groups) and how weights move (make_sync: weight_sync.py's, or LoRA's); the generator owns when
batches are made (in step, or async_steps ahead on a thread: Rollouts), which are too stale to
train on (drop_stale), and the server. The server is ours (launched on an untied copy of the
policy, stopped on close) or the user's (vllm_server_urls, given our weights first). A server we
launched that dies is restarted, up to vllm_max_restarts times, given the current weights, and
asked for the same step's prompts again; any other failure raises VLLMError on every rank.
"""

import functools
import os
import threading

import torch
from tqdm import tqdm

from infra import colocation, ranks, vllm_client, vllm_server
from infra.faults import Refused, VLLMError
from infra.model_files import stop_token_ids
from infra.weight_sync import write_serving_dir


class Generator:
    def __init__(self, cfg, policy, tokenizer, rank, device, make_batch, make_sync, sampler, player, memory_plan=None):
        self.cfg, self.tokenizer, self.rank, self.device = cfg, tokenizer, rank, device
        # make_batch(client, step) -> (samples, metrics), rank 0; make_sync(client, rank, device) -> a weight sync
        self.make_batch, self.make_sync, self.sampler = make_batch, make_sync, sampler
        self.player = player  # what plays the episodes (episodes.Player), chosen at start-up
        # an environment's calls, an agent's programs: in worker processes; one that cannot run here (a sandbox
        # without bwrap) ends every rank in one line, before training
        ranks.from_rank0(lambda: start_player(player))
        self.client = self.server = self.weight_sync = self.rollouts = None
        self.restarts, self.position = 0, sampler.position  # the sampler's position after the last batch taken
        self.max_staleness = cfg.async_steps if cfg.max_sample_staleness is None else cfg.max_sample_staleness
        self.log_path = os.path.join(cfg.output_dir, "vllm.log")
        self.colocated = colocation.colocated(cfg, device.type == "cuda")  # asleep while the policy trains
        self.memory_plan = memory_plan
        self.served = os.path.join(cfg.output_dir, "vllm_model")
        try:
            # the model's every end-of-sequence id, sent with each request: the server we launch
            # ignores generation_config.json (--generation-config vllm), and its serving copy has none
            stop_ids = stop_token_ids(tokenizer, cfg.model_name_or_path)  # (output_dir is rank 0's: train.load_inputs)
            if rank == 0 and cfg.vllm_server_urls:
                # the key from the environment, not the config: the config is saved in run_info.json and
                # every checkpoint, and a flag is visible to every local user in ps
                self.client = vllm_client.VLLMClient(cfg.vllm_server_urls, None, cfg.vllm_request_timeout,
                                                 cfg.vllm_max_retries, stop_token_ids=stop_ids,
                                                 api_key=os.environ.get("VLLM_API_KEY"))
            self.weight_sync = make_sync(self.client, rank, device)  # it says what our server starts from
            full = self.weight_sync.launch_state_dict(policy)  # a collective: every rank takes part
            if not cfg.vllm_server_urls:  # rank 0 starts our server; the others wait on the CPU (infra/ranks.py)
                ranks.from_rank0(functools.partial(self.start_server, full, policy, stop_ids))
            del full
            if cfg.vllm_server_urls or self.weight_sync.sync_at_start:
                self.weight_sync.sync(policy)  # the user's server starts from our weights; requests name our adapter
        except BaseException:
            self.close()
            raise

    def start_server(self, full, policy, stop_ids):
        """Rank 0: our server on the serving copy `full`, and its client."""
        write_serving_dir(full, policy.config, self.tokenizer, self.served)
        self.server, url = vllm_server.launch_server(self.served, self.cfg, self.log_path, extra_args=self.server_flags())
        self.client = vllm_client.VLLMClient([url], self.served, self.cfg.vllm_request_timeout,
                                             self.cfg.vllm_max_retries, proc=self.server, log_path=self.log_path,
                                             stop_token_ids=stop_ids)
        self.weight_sync.client = self.client

    def batch(self, step, policy):
        """(samples, metrics) of `step` on every rank: rank 0 takes them from vLLM (generated ahead
        with async_steps), drops stale samples and broadcasts them. Restarts a dead server of ours."""
        while True:
            got = ranks.from_rank0(lambda: self.take(step))  # the other ranks wait on the CPU meanwhile
            if got != "restart":
                samples, m = got
                self.position = m["prompts_seen"]  # what a checkpoint of this step records
                return samples, m
            self.restart(step, policy)

    def take(self, step):
        """Rank 0: `step`'s (samples, metrics), or "restart" when our server died and may be restarted.
        Another VLLMError, or Refused (episodes nobody could score), ends the run on every rank."""
        try:
            if self.rollouts is None:  # from the first step asked for (again, after a restart)
                self.rollouts = Rollouts(lambda j: self.make_batch(self.client, j), step,
                                         self.cfg.num_training_steps, self.cfg.async_steps)
            samples, m = self.rollouts.get(step)
        except VLLMError:
            if self.server is not None and self.server.poll() is not None and self.restarts < self.cfg.vllm_max_restarts:
                return "restart"
            raise
        samples, stale = drop_stale(samples, self.client.version, self.max_staleness,
                                    self.cfg.num_samples_per_prompt_rollout)
        return samples, dict(m, **stale, vllm_restarts=self.restarts)

    def restart(self, step, policy):
        """Relaunch our dead server, give it the current weights, and ask for `step`'s prompts again."""
        self.restarts += 1
        if self.colocated and self.device.type == "cuda":
            torch.cuda.empty_cache()  # a colocated server's start-up wants its share of the GPU free
        ranks.from_rank0(lambda: self.relaunch(step))  # one that does not start ends every rank, in one line
        self.weight_sync.close()
        self.weight_sync = self.make_sync(self.client, self.rank, self.device)
        self.weight_sync.sync(policy)

    def relaunch(self, step):
        """Rank 0: a new server in place of the dead one, for `step`'s prompts again."""
        tqdm.write(f"step {step}: the vLLM server died; restart {self.restarts} of {self.cfg.vllm_max_restarts}")
        self.rollouts.close()
        self.rollouts = None
        self.sampler.position = self.position  # this step's prompts again
        vllm_server.stop_server(self.server)
        self.server, url = vllm_server.launch_server(self.served, self.cfg, self.log_path, extra_args=self.server_flags())
        self.client.proc, self.client.urls = self.server, [url]  # a new socket

    def server_flags(self):
        """The flags of the server we launch: the weight sync's, and a colocated server's (colocation.py)."""
        if not self.colocated:
            return tuple(self.weight_sync.server_flags)
        gpu = torch.cuda.get_device_properties(self.device).total_memory if self.device.type == "cuda" else 0
        gpus = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        fraction = (colocation.fraction(self.cfg, *self.memory_plan, gpus, gpu) if gpu and self.memory_plan
                    else self.cfg.vllm_gpu_memory_utilization)  # memory_plan: train.py's (memory.py)
        return tuple(self.weight_sync.server_flags) + tuple(colocation.flags(self.cfg, fraction))

    def sleep(self):
        """A colocated server frees the GPUs for training."""
        if self.colocated:
            self.ask_server(lambda: self.client.sleep())

    def sync(self, policy, trained=True):
        """The policy's weights into every server (every rank takes part), when the step trained; VLLMError if
        that fails. A colocated server wakes its weights first (the reload writes into them, and a wake
        after it would bring back the old ones), then its KV cache, for the evaluation and the next
        batch; the trainers first hand back the GPU memory their allocator keeps cached."""
        if self.colocated:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            ranks.barrier()  # every rank's cache handed back before the server takes memory again
            self.ask_server(lambda: self.client.wake_up("weights"))
        if trained:
            self.weight_sync.sync(policy)
        if self.colocated:
            self.ask_server(lambda: self.client.wake_up("kv_cache"))

    def ask_server(self, call):
        """Rank 0 makes `call` to the colocated server while the other ranks wait on the CPU; every rank
        learns how it went (so no rank trains before the server slept, and a failure stops every rank
        alike, each able to save its checkpoint). A server of ours that died is no failure here: the next
        batch restarts it."""
        def checked():
            try:
                call()
            except VLLMError:
                if self.server is None or self.server.poll() is None:
                    raise
        ranks.from_rank0(checked)

    def close(self):
        if self.rollouts:
            self.rollouts.close()
        if self.weight_sync:
            self.weight_sync.close()
        if self.rank == 0:
            self.player.close()
            vllm_server.stop_server(self.server)


def start_player(player):
    """Rank 0: the player's workers; a player that cannot run here is a one-line error on every rank."""
    try:
        player.start()
    except ValueError as e:
        raise Refused(str(e)) from None


def drop_stale(samples, version, max_staleness, n):
    """Label each sample with its staleness (weight updates since the weights that sampled its
    first turn; 0 in the synchronous loop) and drop the groups (n samples in a row, as
    rollout_batch returns them) whose oldest sample is older than max_staleness: a group is kept
    or dropped whole, though a weight update may fall between the first turns of its episodes."""
    for s in samples:
        s.staleness = version - s.version
    groups = [samples[i:i + n] for i in range(0, len(samples), n)]
    kept = [s for g in groups if max(s.staleness for s in g) <= max_staleness for s in g]
    return kept, dict(staleness_mean=sum(s.staleness for s in samples) / max(len(samples), 1),
                      stale_dropped=len(samples) - len(kept))


class Rollouts:
    """Batches for steps first..last from make(step). With ahead=k > 0 a thread makes
    batch j as soon as the trainer has taken batch j - k, so the batches of the next k steps
    are generated while the current one trains; with ahead=0, get(step) makes it in place.
    An exception in make() is raised by get() for that step, and the thread stops there."""

    def __init__(self, make, first, last, ahead):
        self.make, self.ahead, self.last, self.taken, self.ready = make, ahead, last, first - 1, {}
        self.cond, self.closed, self.thread = threading.Condition(), False, None
        if ahead:
            self.thread = threading.Thread(target=self.produce, args=(first,), daemon=True)
            self.thread.start()

    def produce(self, j):
        while j <= self.last:
            with self.cond:
                self.cond.wait_for(lambda: self.closed or j <= self.taken + self.ahead)
                if self.closed:
                    return
            try:
                out = self.make(j)
            except Exception as e:  # noqa: BLE001 - handed to the trainer, which decides
                out = e
            with self.cond:
                self.ready[j] = out
                self.cond.notify_all()
            if isinstance(out, Exception):
                return
            j += 1

    def get(self, step):
        """The batch for `step` (steps are taken in order); waits for it if it is not made yet."""
        if not self.ahead:
            self.taken = step
            return self.make(step)
        with self.cond:
            self.cond.wait_for(lambda: step in self.ready)
            out = self.ready.pop(step)
            self.taken = step
            self.cond.notify_all()
        if isinstance(out, Exception):
            raise out
        return out

    def close(self):
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if self.thread:  # a request in flight may take up to vllm_request_timeout; the thread is a daemon
            self.thread.join(timeout=10)
