# What benchmarks/gpu_checks.sh and benchmarks/gpu_colocated.sh share (sourced, not run): the one-line
# refusal, the GPU preflight, and the stage: a command under a time limit, its output in a file,
# its seconds and status in $out/stages.tsv.

fail() {  # one line on stderr, exit 2 (a refusal: nothing was started)
    echo "error: $*" >&2
    exit 2
}

need_gpus() {  # need_gpus N SCRIPT: refuse in one line unless nvidia-smi and torch both see N GPUs
    local n=$1 script=$2 seen
    command -v nvidia-smi >/dev/null 2>&1 || fail "no GPU here (nvidia-smi not found): $script needs $n CUDA GPU(s)"
    seen=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ') || true
    [ "${seen:-0}" -ge "$n" ] || fail "$script needs $n CUDA GPU(s); nvidia-smi lists ${seen:-0}"
    seen=$("$py" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null) \
        || fail "$py cannot import torch; set PYTHON to the Python of a CUDA build of torch"
    [ "$seen" -ge "$n" ] || fail "$script needs $n CUDA GPU(s); torch sees $seen (a CPU build of torch, or CUDA_VISIBLE_DEVICES)"
}

stage() {  # stage NAME SECONDS CMD...: run CMD under `timeout`, output to $out/NAME.txt and the console
    local name=$1 limit=$2 began status left
    shift 2
    echo "== $name (limit ${limit}s): $*"
    began=$(date +%s)
    timeout --kill-after=30 "$limit" "$@" 2>&1 | tee "$out/$name.txt"
    status=${PIPESTATUS[0]}
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$(($(date +%s) - began))" "$limit" >>"$out/stages.tsv"
    [ "$status" -eq 124 ] || [ "$status" -eq 137 ] || return 0
    echo "$name: timed out after ${limit}s"
    # torchrun starts each rank in a session of its own: a rank can outlive its killed launcher
    left=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr '\n' ' ')
    [ -z "${left// /}" ] || fail "stage $name timed out and left processes on the GPUs (pids $left); stop them, then rerun"
}

stages_summary() {  # the stages' seconds, status and limits: what the next run's limits can be sized from
    echo "== stages: name, exit status, seconds, limit ($out/stages.tsv)"
    column -t -s $'\t' "$out/stages.tsv" 2>/dev/null || cat "$out/stages.tsv"
}
