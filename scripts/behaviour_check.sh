#!/usr/bin/env bash
# The same short runs on a checkout, for comparing two versions of the code run for run (a
# refactor must leave every metric and tensor as it was):
#   git worktree add /tmp/old REV && bash scripts/behaviour_check.sh /tmp/old /tmp/runs-old
#   bash scripts/behaviour_check.sh . /tmp/runs-new
#   .venv/bin/python scripts/compare_runs.py /tmp/runs-old /tmp/runs-new   # exits 1 on a difference
# Each run: the tiny model, 2 ranks unless said, the vLLM server train.py starts, 3 steps, a
# resumable checkpoint and an export at step 3; together they pass every optional concept's doors.
# ONLY="ema lora" runs some; MASTER_PORT for two at once; about 10 min on 2 cores.
set -euo pipefail
repo=$(cd "$1" && pwd); out=$(mkdir -p "$2" && cd "$2" && pwd)
py=${PYTHON:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}
cd "$repo"
[ -f models/tiny/config.json ] || "$py" scripts/make_tiny_model.py --out models/tiny
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
# A reward the tiny model earns half the time (the parity of its answer's length): groups train.
printf 'def reward(prompt, completion, example):\n    return float(len(completion) %% 2)\n' > "$out/parity.py"
common=(--model_name_or_path models/tiny --num_training_steps 3 --eval_freq 0 --seed 5
        --num_unique_prompts_rollout 2 --num_samples_per_prompt_rollout 4 --response_length 16
        --max_prompt_length 256 --checkpoint_state_freq 3 --learning_rate 1e-3
        --reward_fn "$out/parity.py:reward" --filter_zero_std_samples false)
one() {  # name nproc flags...; a run whose checkpoint exists is kept
    local name=$1 nproc=$2; shift 2
    [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]] && return
    [ -d "$out/$name/ckpt/step_00000003" ] && return
    rm -rf "$out/$name"
    echo "== $name"
    "$py" -m torch.distributed.run --nproc_per_node "$nproc" --master_port "${MASTER_PORT:-29733}" train.py "${common[@]}" \
        --output_dir "$out/$name/out" --checkpoint_state_dir "$out/$name/ckpt" "$@" > "$out/$name.log" 2>&1 \
        || { tail -n 20 "$out/$name.log"; exit 1; }
}
one ema 2 --beta 0.1 --load_ref_policy true --ref_policy_update_freq 1 --alpha 0.6
one tools 2 --dataset calc --environment envs.calculator:calculator --max_turns 2 --response_length 24 --max_prompt_length 512 --beta 0.1 \
    --load_ref_policy true --kl_estimator topk --kl_topk 4
one lora 2 --lora_rank 4 --beta 0.1 --load_ref_policy true --ref_policy_update_freq 1 --learning_rate 1e-2
one ulysses 2 --sequence_parallel_size 2 --beta 0.1 --load_ref_policy true --ref_policy_update_freq 1
one unshared 2 --shared_prefix false --beta 0.1 --load_ref_policy true
one agent 1 --dataset calc --agent examples/calculator_agent.py:solve --tool_call_parser hermes \
    --max_prompt_length 512 --response_length 32 --max_turns 2 --agent_workers 2
echo "runs in $out"
