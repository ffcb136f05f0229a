"""One flat config for the whole trainer: every field has a default and a line of help (its
metadata, options.option; `python train.py --help` prints it, cli.py reads the command line and TOML file).
A step is one rollout batch; an update is one optimizer step (num_mini_batches x num_epochs a step). The field name, the
flag and the metric key are the same string; names follow open-instruct's grpo_fast where it has
one. `Config.__post_init__` refuses every contradiction before any process group, model or server starts.
Importing config.py needs no torch; checking a Config imports loss.py (loss.OBJECTIVES), and torch with it.
"""

import importlib.util
import math
from dataclasses import dataclass
from typing import Literal, Optional

from infra.options import check_fields, default, option
from infra.user_code import reward_specs
from episodes import max_seed


def flash_attention_available() -> bool:
    import torch  # here, not above: importing config.py needs no torch
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


TOPK_ESTIMATORS = ("topk", "topk_forward")  # the kl_estimators that read a top-k head (loss.TOPK_KL)


@dataclass
class Config:
    # --- model and data
    model_name_or_path: str = option("models/tiny", "HF hub name or local dir (build a tiny one: python "
                                                    "scripts/make_tiny_model.py --out models/tiny)")
    attn_implementation: Literal["packed_sdpa", "sdpa", "eager", "flex_attention", "flash_attention_2"] = option(
        "packed_sdpa", "packed_sdpa (sdpa on each sequence of a packed row), transformers' sdpa / eager (one mask over the whole "
        "row), flex_attention (a block mask), flash_attention_2 (variable-length kernels; needs a GPU and "
        "flash-attn, untested here)")
    shared_prefix: bool = option(True, "training forwards a group's prompt once, its samples after it, each seeing the "
                                       "prompt and itself (packing.collate); applies under packed_sdpa, the others "
                                       "leave it off and say so", resumable=True)
    dataset: str = option("copy", "a built-in task (copy, add, math, calc), a hub dataset name, or a local "
                                  ".jsonl/.json/.parquet/.csv file")
    math_digits: int = option(1, "math and calc tasks: numbers of up to (calc: exactly) this many digits",
                              low=1, high=9)
    math_operations: str = option("+-", "math and calc tasks: operations a problem draws from, any of + - *")
    math_steps: int = option(1, "math and calc tasks: operations per problem after the first number", low=1)
    dataset_split: str = option("train", "split to read from a hub dataset")
    dataset_prompt_column: str = option("prompt", "column holding the prompt: a string, or a list of {role, content} "
                                                  "chat messages")
    dataset_answer_column: str = option("answer", "column the reward function reads as example[\"answer\"] (may be "
                                                  "absent if the reward needs none)")
    reward_fn: Optional[str] = option(None, "\"module:function\" or \"path/to/file.py:function\", or several "
                                            "separated by commas (TRL's reward_funcs: their weighted sum); None = "
                                            "the built-in task's reward, else exact_match")
    reward_weights: list[float] = option([], "a weight for each reward_fn function (TRL's reward_weights); "
                                             "empty = 1 each", only_with="reward_fn")
    reward_workers: int = option(2, "processes that score rewards (worker_pool.py); 0 = in the trainer, no timeout "
                                    "(breakpoint() works)", low=0)
    reward_timeout: float = option(10.0, "seconds one sample's reward may take in a worker; past it the sample "
                                         "is unscored: its group leaves the batch", above=0)
    unscored_stop: float = option(0.5, "stop the run when more than this fraction of a step's groups left the batch "
                                       "because an episode of theirs could not be scored (a failure of ours: "
                                       "faults.py); 0 = at the first such group, 1 = only when every group "
                                       "left, above 1 = never stop",
                                  low=0, resumable=True)
    environment: Optional[str] = option(None, "multi-turn episodes: \"module:name\" or \"file.py:name\" "
                                              "(envs/environment.py; built-in: envs.calculator:calculator); None = one "
                                              "completion per prompt")
    max_turns: int = option(4, "with an environment or an agent: assistant turns (model calls) per episode at most",
                            low=1, only_with="multi_turn")
    tool_workers: int = option(2, "with an environment: processes that run its step (tool calls)",
                               low=0, only_with="environment")
    tool_timeout: float = option(10.0, "seconds one step (tool call) may take; past it the episode is unscored "
                                       "(faults.py)",
                                 above=0, only_with="environment")
    tool_output_max_tokens: int = option(256, "an environment message longer than this is cut",
                                         low=1, only_with="environment")
    tool_call_parser: Optional[str] = option(None, "with an environment or an agent: read the policy's tool calls in the "
                                                   "model's own format with this vLLM tool parser (hermes for "
                                                   "Qwen2.5/Qwen3, llama3_json for Llama-3.1, mistral, ...; the "
                                                   "names of vllm serve --tool-call-parser); None = the "
                                                   "environment reads its text", only_with="multi_turn")
    reasoning_parser: Optional[str] = option(None, "with an environment or an agent: split the policy's turn into reasoning and "
                                                   "answer with this vLLM reasoning parser (qwen3, deepseek_r1, ...; "
                                                   "the names of vllm serve --reasoning-parser): the reasoning is not "
                                                   "read for tool calls; None = the whole turn is",
                                             only_with="multi_turn")
    agent: Optional[str] = option(None, "an agent program, \"file.py:fn\" or \"module:fn\": fn(row, base_url, api_key) "
                                        "plays one episode through an OpenAI-compatible endpoint and returns its "
                                        "reward or None (agent_programs/runner.py)")
    agent_cmd: Optional[str] = option(None, "an agent as a shell command: OPENAI_BASE_URL and OPENAI_API_KEY in its "
                                            "environment, the row as JSON on stdin, its reward the last line it prints "
                                            "(agent_programs/runner.py)")
    agent_workers: int = option(8, "processes that run agent programs at once", low=1, only_with="agent_program")
    agent_timeout: float = option(300.0, "seconds one agent run (one episode) may take; past it the episode is "
                                         "unscored", above=0, only_with="agent_program")
    format_reward: float = option(0.0, "added to the training reward (not to evaluation) of a completion that marks "
                                       "an answer with \\boxed{} or ####")
    apply_chat_template: bool = option(False, "wrap string prompts as one user message and apply the tokenizer's "
                                              "chat template")
    max_prompt_length: int = option(64, "prompt tokens; longer prompts are skipped and counted, or refused (see "
                                        "skip_long_prompts)", low=1)
    skip_long_prompts: bool = option(True, "True: skip and count prompts over max_prompt_length; False: stop with an "
                                           "error")
    num_eval_prompts: int = option(64, "held-out prompts for greedy evaluation (never trained on)", low=0)
    eval_freq: int = option(10, "evaluate every this many steps; 0 disables", low=0, resumable=True)
    # --- rollouts (vLLM)
    response_length: int = option(8, "max tokens after the prompt: one completion's, or with an environment the "
                                     "whole episode's (every turn and every answer of the environment)", low=1)
    temperature: float = option(1.0, "sampling temperature for training rollouts",
                                above=0, note=" for training rollouts (greedy is used for evaluation)")
    top_p: float = option(1.0, "must stay 1: vLLM renormalises its logprobs over the nucleus, the trainer's ratios "
                               "cannot follow")
    vllm_server_urls: list[str] = option([], "servers you run yourself (comma separated); empty = launch one",
                                         resumable=True)
    vllm_port: int = option(8011, "port of a server `python scripts/serve.py --serve` starts (scripts/launch_8gpu.sh); "
                                  "the one train.py launches takes none (a private Unix socket)",
                            low=1, high=65535, resumable=True)
    vllm_dtype: Literal["auto", "float32", "float", "bfloat16", "float16", "half"] = option(
        "auto", "dtype of the server we launch (vLLM's --dtype); auto = the trainer's (float32 on CPU, bfloat16 on GPU)")
    vllm_enforce_eager: bool = option(False, "start the server we launch with --enforce-eager: no torch.compile "
                                             "(on a CPU its warm-up is 1 to 2 minutes of every start)", resumable=True)
    vllm_max_model_len: Optional[int] = option(None, "context of the server we launch; None = max_prompt_length + "
                                                     "response_length")
    vllm_kv_cache_space_gb: Optional[float] = option(None, "KV cache of the server we launch, GB (1e9 bytes); None = "
                                                            "on a CPU what the run's sequences need at full length "
                                                            "(memory.py), on a GPU vllm_gpu_memory_utilization's share",
                                                     low=0.001, high=10000, resumable=True)
    vllm_cpu_threads: Optional[int] = option(None, "cores a CPU server we launch computes on; None = all with "
                                                   "async_steps=0, half otherwise", low=1)
    vllm_gpu_memory_utilization: float = option(0.9, "memory fraction of a GPU server we launch (colocated: at most "
                                                     "this, less if the memory plan leaves less)",
                                                above=0, high=1, resumable=True)
    vllm_startup_timeout: float = option(600.0, "seconds to wait for a launched server to answer as ours "
                                                "(/v1/models serves our model)",
                                         above=0, resumable=True)
    vllm_request_timeout: float = option(120.0, "seconds for one HTTP request to a server", above=0, resumable=True)
    vllm_max_retries: int = option(3, "retries (with backoff) of a failed request before the run stops",
                                   low=0, resumable=True)
    async_steps: int = option(0, "generate the batches of the next N steps while training on this one; 0 = "
                                 "synchronous (exact)", low=0, note=" (0: generate each batch after the last sync)")
    max_sample_staleness: Optional[int] = option(None, "drop samples whose weights are more than this many updates "
                                                       "old; None = async_steps")
    vllm_max_restarts: int = option(3, "times a server we launched is restarted after it dies; a server you run is "
                                       "never restarted", low=0, note=" (0: never restart the server)", resumable=True)
    vllm_any_version: bool = option(False, "start with a vLLM other than the one pinned (infra/vllm_server.py "
                                           "VLLM_VERSION): installed here, or a server you run's /version; at your "
                                           "own risk", resumable=True)
    weight_sync_transport: Literal["filesystem", "nccl"] = option("filesystem",
        "filesystem (safetensors + reload_weights, CPU and GPU) or nccl (GPU servers)")
    weight_sync_master_address: str = option("127.0.0.1", "nccl: address of trainer rank 0 as the vLLM server sees it",
                                             resumable=True)
    weight_sync_master_port: int = option(29555, "nccl: port of the weight-transfer rendezvous on trainer rank 0",
                                          low=1, high=65535, resumable=True)
    weight_sync_dir: Optional[str] = option(None, "filesystem: where rank 0 writes weights for every server to read; "
                                                  "None = /dev/shm (servers on its node)", resumable=True)
    vllm_logp_tolerance: Optional[float] = option(None, "max mean |trainer - vLLM| logprob after a sync before it "
                                                        "counts as failed; None = by dtype: 1e-2 in float32 (CPU), "
                                                        "0.07 with bfloat16 on either side (update.sync_tolerance)",
                                                  above=0, note=" (None: by dtype)", resumable=True)
    # --- batch
    num_unique_prompts_rollout: int = option(16, "prompts per step", low=1)
    num_samples_per_prompt_rollout: int = option(8, "completions per prompt (the GRPO group)",
                                                 low=2, note=": GRPO's advantage compares samples of one prompt")
    max_tokens_per_micro_batch: int = option(4096, "tokens (prompt + completion) packed into one forward/backward on "
                                                   "one rank; at least max_prompt_length + response_length")
    num_mini_batches: int = option(1, "optimizer steps per rollout batch (per epoch)", low=1)
    num_epochs: int = option(1, "passes over each rollout batch", low=1)
    num_training_steps: int = option(100, "rollout batches to train on", low=1, resumable=True)
    # --- optimizer
    learning_rate: float = option(1e-3, "peak learning rate of AdamW", low=0)
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = option("constant",
        "constant, linear or cosine (after warm-up)")
    warm_up_steps: int = option(0, "linear warm-up, in optimizer steps", low=0)
    weight_decay: float = option(0.0, "AdamW weight decay", low=0)
    max_grad_norm: float = option(1.0, "gradient clipping; 0 disables", low=0)
    # --- objective
    loss_fn: str = option("dapo", "an objective of loss.OBJECTIVES: dapo (asymmetric clip), cispo (capped weight x "
                                  "logp), ess (batch-adaptive, \"Trust the Batch\" by Fakoor et al.; no clip "
                                  "constants) or gspo (clipped sequence ratio, GSPO by Zheng et al.; the paper clips "
                                  "at 3e-4 / 4e-4); or file.py:name / module:name, a loss.Objective of your own")
    clip_lower: float = option(0.2, "dapo, gspo: ratio (gspo: the sequence ratio) clipped below at 1 - clip_lower",
                               low=0, below=1)
    clip_higher: float = option(0.28, "dapo, gspo: ratio clipped above at 1 + clip_higher; cispo: weight capped at 1 "
                                      "+ clip_higher", low=0)
    beta: float = option(0.0, "KL coefficient toward the reference; 0 = no KL term", low=0)
    kl_estimator: Literal["k1", "k2", "k3", "k4", "topk", "topk_forward", "advantage"] = option("k3",
        "k1, k2, k3, k4, topk or topk_forward (a loss term), or advantage (the sampled k1 taken from each token's "
        "advantage); the KL each one's gradient follows: docs/algorithm.md (a teacher refuses k1 and k3)")
    kl_topk: int = option(0, "topk, topk_forward: tokens of the sampling policy (a teacher's) summed exactly per "
                             "position (0 = sampled: topk is then k4)", low=0)
    teacher_model_name_or_path: Optional[str] = option(None, "on-policy distillation (distill/): a teacher with the "
        "student's tokenizer, served by a vLLM server train.py launches, is the reference the KL term reads")
    teacher_context_file: Optional[str] = option(None, "context distillation: a JSON list (or JSONL) of chat "
        "messages (a system prompt, worked examples) the teacher sees before each prompt's first non-system turn, "
        "the student not (distill/context.py)")
    reward_advantage: bool = option(True, "the reward's group advantage in the policy term; False: the KL term "
                                          "alone trains (distillation from a teacher)")
    ess_scope: Literal["step", "micro_batch"] = option("step",
        "ess: ESS over the optimizer step's tokens (one extra forward) or per micro_batch")
    loss_denominator: str = option("token", "\"token\" (valid tokens of the whole optimizer step) or a positive "
                                            "number (Dr GRPO)")
    advantage_normalization_type: Literal["standard", "centered"] = option("standard",
        "standard (r - mean)/(std + eps) or centered (r - mean)")
    filter_zero_std_samples: bool = option(True, "drop groups whose rewards all agree (no learning signal)")
    active_sampling: bool = option(False, "DAPO's dynamic sampling: refill filtered groups with new prompts until "
                                          "the batch is full")
    active_sampling_max_rounds: int = option(4, "active_sampling: extra generation rounds per step at most; then "
                                                "train on what is kept", low=1)
    use_vllm_logprobs: bool = option(False, "take vLLM's sampling logprobs as old_logp instead of recomputing them")
    truncated_importance_sampling_ratio_cap: float = option(0.0,
        "cap of exp(old_logp - vllm_logp) on the policy term; 0 disables", low=0, note=" (0 disables it)")
    vllm_importance_sampling_mask: Literal["none", "token", "sequence"] = option("none",
        "none, token (IcePop: drop tokens whose ratio pi_old/pi_vllm leaves the band) or sequence (drop sequences by "
        "geometric-mean ratio)")
    vllm_importance_sampling_mask_cap: float = option(2.0,
        "the mask's band is [1/cap, cap]; the sequence mask wants a tighter one (1.1 say)",
        above=1, note=": the band is [1/cap, cap] (2 is IcePop's range)")
    # --- reference policy
    load_ref_policy: bool = option(True, "allow a reference policy; it is built only when beta > 0 (its only use)")
    ref_policy_update_freq: Optional[int] = option(None,
        "Polyak-update the reference every N steps; None = fixed reference", low=1, note=" steps, or None")
    alpha: float = option(0.6, "Polyak weight: ref = alpha * policy + (1 - alpha) * ref", above=0, high=1)
    # --- LoRA (lora/: PEFT adapters on a frozen base; the reference is an adapter, not a model)
    lora_rank: int = option(0, "rank of the LoRA adapters trained instead of the model's weights; 0 = train every "
                               "weight", low=0, note=" (0: no LoRA)")
    lora_alpha: float = option(32.0, "the adapters' scale is lora_alpha / lora_rank", above=0, only_with="lora_rank")
    lora_dropout: float = option(0.0, "dropout on the adapters' input in the forward that takes a gradient (old "
                                      "logprobs then get a forward of their own)", low=0, below=1,
                                 only_with="lora_rank")
    lora_target_modules: list[str] = option(["all-linear"],
        "the decoder layers' linear modules by PEFT's names (q_proj,v_proj,...) or all-linear (all of them); "
        "the LM head and the embeddings take none", only_with="lora_rank")
    lora_weight_sync: Literal["adapter", "merged"] = option("adapter",
        "adapter: the servers load each new adapter (vLLM --enable-lora); merged: full weights with the adapter "
        "folded in (servers without LoRA)", only_with="lora_rank", resumable=True)
    # --- distributed (parallel.py; the README maps open-instruct's DeepSpeed knobs to these)
    fsdp_shard_size: int = option(0, "ranks one weight copy is sharded over; 0 = all (FSDP), a divisor of the world "
                                     "= hybrid (HSDP)", low=0, note=" (0: shard over all ranks)", resumable=True)
    reshard_after_forward: bool = option(True, "free a layer's gathered weights after forward (ZeRO-3); False keeps "
                                               "them until backward (fewer gathers)", resumable=True)
    activation_checkpointing: bool = option(False, "recompute each decoder layer's activations in backward instead "
                                                   "of storing them", resumable=True)
    offload_params: bool = option(False, "policy's parameter shards, gradients and AdamW state in CPU memory (FSDP2 "
                                         "CPUOffloadPolicy: all three)", resumable=True)
    offload_ref_policy: bool = option(False, "the reference's parameter shards in CPU memory (copied to the GPU "
                                             "layer by layer for its forward)", resumable=True)
    vllm_colocate: Optional[bool] = option(None, "our vLLM server on the training GPUs, asleep while the policy "
                                                 "trains (each step: wake its weights, sync, wake its KV cache, "
                                                 "generate, sleep); None = on with GPUs and no vllm_server_urls. On a "
                                                 "CPU the same calls run (the server pauses; nothing is freed)",
                                           resumable=True)
    vllm_tensor_parallel_size: int = option(1, "GPUs each replica of a colocated server spans; the node's GPUs / "
                                               "this = its data-parallel replicas", low=1, resumable=True)
    single_gpu_mode: bool = option(False, "vllm_colocate on one GPU, at vllm_gpu_memory_utilization (untested here)")
    sequence_parallel_size: int = option(1, "ranks that split each packed row (DeepSpeed-Ulysses: all-to-all around "
                                            "attention, sequence_parallel.py); 1 = off",
                                            low=1, note=" (1: every rank holds whole sequences)")
    backend_timeout: int = option(30, "minutes before a stuck collective fails the process group",
                                  above=0, resumable=True)
    weight_sync_timeout: float = option(600.0, "seconds one weight sync into vLLM may take (the reload request, or "
                                               "the NCCL transfer)", above=0, resumable=True)
    # --- checkpoints, output, logging
    output_dir: str = option("output", "metrics.jsonl, exported models and plots go here", resumable=True)
    checkpoint_state_dir: Optional[str] = option(None, "resumable sharded checkpoints (needs checkpoint_state_freq > "
                                                       "0)", resumable=True)
    checkpoint_state_freq: int = option(-1, "steps between resumable checkpoints; -1 = none (also written at the end "
                                            "and on SIGTERM)", resumable=True)
    keep_last_n_checkpoints: int = option(3, "complete checkpoints kept; older ones are removed once a newer one is "
                                             "complete", low=1, resumable=True)
    save_freq: int = option(-1, "steps between Hugging Face model exports (output_dir/step_N); -1 = only the final "
                                "one (output_dir/final)", resumable=True)
    max_consecutive_skipped_steps: int = option(3, "stop when this many steps in a row skip an update for a "
                                                   "non-finite loss or gradient norm", low=1, resumable=True)
    with_tracking: bool = option(False, "also log to Weights & Biases or TensorBoard (offline modes work)",
                                 resumable=True)
    log_samples_freq: int = option(10, "every N steps print a few (prompt, completion, reward) and append them to "
                                       "output_dir/samples.jsonl; 0 = never", low=0)
    seed: int = option(1, "seeds data order, sampling and initialisation; 0 to episodes.max_seed (vLLM takes 64-bit "
                          "seeds)")

    def __post_init__(self):
        """Refuse a contradiction before any process group, model or server starts: first each field alone
        (options.check_fields), then each section's check, which returns a message or None."""
        self.loss_denominator = str(self.loss_denominator)
        check_fields(self, {"multi_turn": "environment, agent or agent_cmd", "agent_program": "agent or agent_cmd"})
        if problem := (self._check_data() or self._check_rollouts() or self._check_batch() or self._check_objective()
                       or self._check_reference() or self._check_lora() or self._check_distributed()
                       or self._check_output()):
            raise ValueError(problem)

    def _check_data(self):
        if not self.math_operations or set(self.math_operations) - set("+-*"):
            return f"math_operations={self.math_operations!r} must be made of + - * (for example '+-' or '+-*')"
        if self.attn_implementation == "flash_attention_2" and not flash_attention_available():
            return ("attn_implementation='flash_attention_2' needs a CUDA GPU and the flash-attn package; install it "
                    "there, or use packed_sdpa")
        functions = len(reward_specs(self.reward_fn)) if self.reward_fn is not None else 0
        if self.reward_fn is not None and not functions:
            return f"reward_fn={self.reward_fn!r} names no function; give module:function or file.py:function"
        if self.reward_weights and len(self.reward_weights) != functions:
            return (f"reward_weights has {len(self.reward_weights)} weights for the {functions} reward_fn function(s); "
                    "give one weight a function, or none (1 each)")
        if not all(map(math.isfinite, self.reward_weights)):
            return f"reward_weights={self.reward_weights} must be finite numbers"

    def _check_rollouts(self):
        if sum(map(bool, (self.environment, self.agent, self.agent_cmd))) > 1:
            return ("environment, agent and agent_cmd each play the episodes: set one of them (an agent program calls "
                    "its own tools)")
        if self.top_p != 1.0:
            return (f"top_p={self.top_p} is not supported: vLLM reports logprobs renormalised over the nucleus while "
                    "the trainer's cover the whole vocabulary, so every ratio and TIS weight would be biased; set top_p=1")
        if self.vllm_max_model_len is not None and self.vllm_max_model_len < self.max_prompt_length + self.response_length:
            return (f"vllm_max_model_len={self.vllm_max_model_len} is below max_prompt_length + response_length = "
                    f"{self.max_prompt_length + self.response_length}; raise it or leave it None")
        if self.max_sample_staleness is not None and not 0 <= self.max_sample_staleness <= self.async_steps:
            return (f"max_sample_staleness={self.max_sample_staleness} must be between 0 and async_steps="
                    f"{self.async_steps} (samples are never older than async_steps); leave it None")
        if self.async_steps and not self.use_vllm_logprobs and self.truncated_importance_sampling_ratio_cap <= 0:
            return (f"async_steps={self.async_steps} trains on samples from older weights: set use_vllm_logprobs=True "
                    "(ratios against the weights that sampled) or truncated_importance_sampling_ratio_cap > 0 "
                    "(a truncated correction exp(old_logp - vllm_logp)); otherwise the staleness goes uncorrected")
        if self.async_steps and (self.single_gpu_mode or self.vllm_colocate):
            return ("async_steps > 0 generates while the trainer trains; a colocated server (vllm_colocate, "
                    "single_gpu_mode) sleeps while training: set async_steps=0, or give the server GPUs of its own")
        if self.async_steps and self.objective and self.objective.ess and not self.use_vllm_logprobs:
            return (f"loss_fn={self.loss_fn!r} with async_steps > 0 needs use_vllm_logprobs=True: the ESS must measure the "
                    "ratios against the weights that sampled the batch")
        if bad := [u for u in self.vllm_server_urls if not u.startswith(("http://", "https://"))]:
            return f"vllm_server_urls: {bad[0]!r} is not a URL; write it as http://host:port"
        if not 0 <= self.seed <= max_seed(self):
            return (f"seed={self.seed} must be in 0..{max_seed(self)}: rollout requests are seeded from it "
                    "(episodes.round_seed), and vLLM takes 64-bit seeds")
        if self.weight_sync_dir is not None and self.weight_sync_transport != "filesystem":
            return ("weight_sync_dir is where the filesystem transport writes; with weight_sync_transport="
                    f"{self.weight_sync_transport!r} nothing is written there: unset one of them")
        if self.weight_sync_transport == "nccl" and len(self.vllm_server_urls) > 1:
            return ("weight_sync_transport='nccl' supports one vLLM server; give one vllm_server_urls entry "
                    "or use weight_sync_transport='filesystem'")

    def _check_objective(self):
        from loss import OBJECTIVES  # noqa: PLC0415 - here: loss.py imports torch
        if self.objective is None:
            return (f"loss_fn={self.loss_fn!r} is not one of {', '.join(OBJECTIVES)} (loss.OBJECTIVES), nor "
                    "file.py:name or module:name naming a loss.Objective of your own")
        try:
            ok = self.loss_denominator == "token" or 0 < float(self.loss_denominator) < math.inf
        except ValueError:
            ok = False
        if not ok:
            return (f"loss_denominator={self.loss_denominator!r} must be 'token' or a finite positive number "
                    "such as 1024")
        if (idle := [f for f in ("clip_lower", "clip_higher") if f not in self.objective.clip
                     and getattr(self, f) != default(self, f)]):
            return (f"loss_fn={self.loss_fn!r} does not read {' or '.join(idle)} (its loss.Objective row lists the "
                    f"clip fields it reads: {', '.join(self.objective.clip) or 'none'}); leave it at its default")
        if not self.objective.ess and self.ess_scope != default(self, "ess_scope"):
            return (f"ess_scope={self.ess_scope!r} only applies to an objective that reads the batch's ESS "
                    f"(loss_fn={', '.join(repr(n) for n, o in OBJECTIVES.items() if o.ess)})")
        if self.kl_topk != 0 and self.kl_estimator not in TOPK_ESTIMATORS:
            return (f"kl_topk={self.kl_topk} only applies to kl_estimator='topk' or 'topk_forward' (got "
                    f"{self.kl_estimator!r})")
        if self.kl_topk > 0 and self.beta == 0:
            return f"kl_topk={self.kl_topk} has no effect with beta=0 (no KL term); set beta > 0 or kl_topk=0"
        if 0 < self.truncated_importance_sampling_ratio_cap < 1:  # min(w, cap) would shrink weights below 1 too
            return (f"truncated_importance_sampling_ratio_cap={self.truncated_importance_sampling_ratio_cap} is "
                    "below 1: it would scale down every token, not truncate the large weights; use a cap >= 1 "
                    "(2 is common) or 0 to disable it")
        if self.use_vllm_logprobs and self.truncated_importance_sampling_ratio_cap > 0:
            return ("use_vllm_logprobs=True with truncated_importance_sampling_ratio_cap > 0 is a contradiction: "
                    "with vLLM's logprobs as old_logp the ratio is 1; set one of them off")
        if self.use_vllm_logprobs and self.vllm_importance_sampling_mask != "none":
            return ("use_vllm_logprobs=True makes old_logp vLLM's own, so the ratio the vllm_importance_sampling_mask "
                    "tests is 1; set vllm_importance_sampling_mask='none' or use_vllm_logprobs=False")
        if self.active_sampling and not self.filter_zero_std_samples:
            return ("active_sampling=True refills groups that filter_zero_std_samples drops; with "
                    "filter_zero_std_samples=False nothing is dropped: set it True or active_sampling=False")

    def _check_reference(self):
        if not self.load_ref_policy and self.beta != 0:
            return f"load_ref_policy=False needs beta=0 (got beta={self.beta}): the KL term needs a reference"
        if not self.load_ref_policy and self.ref_policy_update_freq is not None:
            return "ref_policy_update_freq is set but load_ref_policy=False: there is no reference to update"
        if self.ref_policy_update_freq is not None and self.beta == 0:
            return (f"ref_policy_update_freq={self.ref_policy_update_freq} has no effect with beta=0: nothing uses "
                    "the reference (it is not built); set beta > 0 or leave ref_policy_update_freq None")
        if self.offload_ref_policy and not self.load_ref_policy:
            return "offload_ref_policy=True but load_ref_policy=False: there is no reference to offload"
        if not self.reward_advantage and not (self.teacher_model_name_or_path and self.beta > 0):
            return ("reward_advantage=False trains on the KL term alone, which only a teacher makes a goal: set "
                    "teacher_model_name_or_path and beta > 0, or reward_advantage=True")
        if not self.reward_advantage and self.active_sampling:
            return "active_sampling=True refills groups without reward signal; with reward_advantage=False none is read"
        if self.teacher_context_file and not self.teacher_model_name_or_path:
            return "teacher_context_file is what a teacher sees beyond the prompt: set teacher_model_name_or_path too"
        return self._check_teacher() if self.teacher_model_name_or_path else None

    def _check_teacher(self):
        if not self.uses_reference:
            return "teacher_model_name_or_path needs beta > 0 (and load_ref_policy=True): the KL to it is its one use"
        why = {"k1": "k1's gradient is zero in expectation: the teacher would pull nothing",
               "k3": "k3's gradient is the forward KL(teacher || student) while its value estimates the reverse "
                     "KL(student || teacher)"}  # what each estimator's gradient follows: docs/algorithm.md
        if self.kl_estimator in why:
            return (f"teacher_model_name_or_path with kl_estimator={self.kl_estimator!r}: {why[self.kl_estimator]}; "
                    "pick advantage (the usual start), topk, k2 or k4 (the reverse KL), or topk_forward (the forward)")
        if self.temperature != 1.0:
            return (f"teacher_model_name_or_path with temperature={self.temperature}: vLLM scores the student's tokens "
                    "at temperature 1 (prompt logprobs skip its sampler); sample at temperature=1.0")
        if self.ref_policy_update_freq is not None or self.offload_ref_policy:
            return "a teacher neither moves nor offloads: leave ref_policy_update_freq None and offload_ref_policy off"
        if self.teacher_context_file and not (self.apply_chat_template or self.environment or self.agent):
            return ("teacher_context_file puts chat messages before a chat prompt's first turn, and string prompts "
                    "without a chat template have none: set apply_chat_template=True")

    def _check_lora(self):
        if not self.lora_rank:
            return None
        if self.lora_rank > 512 and self.lora_weight_sync == "adapter":
            return (f"lora_rank={self.lora_rank} is above vLLM's largest max_lora_rank (512); pick a rank up to 512 "
                    "or lora_weight_sync='merged'")
        if self.lora_dropout and self.use_vllm_logprobs:
            return ("lora_dropout > 0 with use_vllm_logprobs=True: the sync check then has no dropout-free trainer "
                    "logprobs to compare with vLLM's; set lora_dropout=0 or use_vllm_logprobs=False")
        if not self.lora_target_modules:
            return "lora_target_modules is empty; name the modules (q_proj,v_proj,...) or write all-linear"
        if self.weight_sync_transport == "nccl":
            return ("lora_rank > 0 syncs through the filesystem (an adapter directory, or merged weights); "
                    "set weight_sync_transport='filesystem'")
        if self.offload_ref_policy:
            return ("offload_ref_policy=True with lora_rank > 0: the reference is an adapter of the policy, there is "
                    "no separate model to offload; set offload_ref_policy=False")

    def _check_batch(self):
        """Config's rules on the batch: a micro-batch holds a whole sequence, a mini-batch whole groups."""
        if self.max_tokens_per_micro_batch < self.max_prompt_length + self.response_length:
            return (f"max_tokens_per_micro_batch={self.max_tokens_per_micro_batch} cannot hold one sequence of "
                    f"max_prompt_length + response_length = {self.max_prompt_length + self.response_length} tokens; "
                    f"raise it to at least {self.max_prompt_length + self.response_length}")
        if self.num_unique_prompts_rollout % self.num_mini_batches:
            return (f"num_unique_prompts_rollout={self.num_unique_prompts_rollout} must be divisible by "
                    f"num_mini_batches={self.num_mini_batches} (each mini-batch takes whole groups)")

    def _check_distributed(self):
        """Config's rules on the ranks and GPUs: sequence parallelism, single_gpu_mode, the collectives' timeout."""
        if problem := self._check_sequence_parallel():
            return problem
        colocate = ("single_gpu_mode=True" if self.single_gpu_mode else
                    "vllm_colocate=True" if self.vllm_colocate else "")
        if colocate and self.vllm_server_urls:
            return (f"{colocate} shares the training GPUs with a server we launch (in sleep mode); "
                    f"remove vllm_server_urls or set {colocate.replace('True', 'False')}")
        if colocate and self.weight_sync_transport == "nccl":
            return (f"{colocate} cannot use weight_sync_transport='nccl' (NCCL cannot link two processes "
                    "on one GPU); use weight_sync_transport='filesystem'")
        if self.single_gpu_mode and self.vllm_gpu_memory_utilization > 0.5:
            return (f"single_gpu_mode=True with vllm_gpu_memory_utilization={self.vllm_gpu_memory_utilization} "
                    "leaves too little of the GPU for the trainer's weights and AdamW state, which stay on it "
                    "while vLLM generates; set it to at most 0.5 (0.3 is a start)")
        if self.weight_sync_timeout >= 60 * self.backend_timeout:
            return (f"weight_sync_timeout={self.weight_sync_timeout}s must be below backend_timeout="
                    f"{self.backend_timeout} min: the other ranks wait for rank 0's sync in a collective that "
                    "backend_timeout ends first; lower weight_sync_timeout or raise backend_timeout")

    def _check_sequence_parallel(self):
        sp = self.sequence_parallel_size
        if sp > 1 and self.fsdp_shard_size and self.fsdp_shard_size % sp:
            return (f"sequence_parallel_size={sp} must divide fsdp_shard_size={self.fsdp_shard_size}: a sequence's "
                    "ranks sit in one shard group (one node), where the all-to-alls run on the fast links")
        if sp > 1 and self.attn_implementation != "packed_sdpa":
            return (f"sequence_parallel_size={sp} runs packed_sdpa on whole rows between its all-to-alls; "
                    f"attn_implementation={self.attn_implementation!r} is not supported with it: set packed_sdpa")
        if sp > 1 and self.objective and self.objective.sequences:
            return (f"loss_fn={self.loss_fn!r} with sequence_parallel_size={sp}: the sequence ratio needs all of a sequence's "
                    "tokens, which may sit on two ranks; pick another loss_fn or sequence_parallel_size=1")
        if sp > 1 and self.vllm_importance_sampling_mask == "sequence":
            return (f"vllm_importance_sampling_mask='sequence' with sequence_parallel_size={sp}: a sequence's tokens "
                    "may sit on two ranks; use the token mask or sequence_parallel_size=1")
        if sp > 1 and self.single_gpu_mode:
            return f"single_gpu_mode=True runs one trainer process; sequence_parallel_size={sp} needs {sp} ranks"

    def _check_output(self):
        if (self.checkpoint_state_dir is None) != (self.checkpoint_state_freq <= 0):
            return ("checkpoint_state_dir and checkpoint_state_freq go together: set both "
                    "(a directory and a frequency > 0) or neither")
        if self.save_freq == 0 or self.save_freq < -1:
            return f"save_freq={self.save_freq} must be a positive number of steps, or -1 for only the final export"

    @property
    def objective(self):
        """loss_fn's row (its function and what it needs): a name of loss.OBJECTIVES, or a row of your own,
        "file.py:name" or "module:name" (loaded once, checked by loss.check_objective); None for an
        unknown name."""
        from loss import OBJECTIVES, check_objective  # noqa: PLC0415 - loss.py imports torch
        if ":" not in self.loss_fn:
            return OBJECTIVES.get(self.loss_fn)
        from infra.user_code import load_once  # noqa: PLC0415
        return check_objective(load_once(self.loss_fn, "loss_fn", "Objective"), self.loss_fn)

    @property
    def episode_turns(self) -> int:
        """Assistant turns an episode may take: max_turns with an environment or an agent, else 1."""
        return self.max_turns if self.multi_turn else 1

    @property
    def multi_turn(self) -> bool:
        """Episodes of several turns: an environment's, or an agent program's."""
        return bool(self.environment or self.agent_program)

    @property
    def agent_program(self) -> bool:
        return bool(self.agent or self.agent_cmd)

    @property
    def uses_reference(self) -> bool:
        """Whether the run builds, updates and checkpoints a reference: only the KL term reads it."""
        return self.load_ref_policy and self.beta > 0

    @property
    def topk_kl(self) -> bool:
        """Whether the KL term is a top-k one: the step then freezes each token's head (update.frozen_logprobs)."""
        return self.kl_estimator in TOPK_ESTIMATORS and self.beta > 0
