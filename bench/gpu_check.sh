#!/usr/bin/env bash
# The GPU check: the CUDA path and the Triton kernels on the Qwen2.5-0.5B shape, greedy against CPU float32,
# decode tok/s at batch 1/16/64, LoRA throughput, and vLLM on the same GPU when it is installed there.
#
#   bash bench/gpu_check.sh prepare     here, with a package index: wheels the GPU image lacks -> bench/.gpu_wheels
#   bash bench/gpu_check.sh             on the GPU machine (carry bench/.gpu_wheels); about 5 minutes on an H200
#   bash bench/gpu_check.sh --dry-run   on CPU: the same steps on a 2-layer cut of the shape, a few tokens
#
# Each step has its own time limit and the script goes on after a failure; the summary lists what failed.
# Output goes to stdout and to $OUT/gpu_check.log when $OUT is set (the device tool brings $OUT back).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
WHEELS=bench/.gpu_wheels
LOG=${OUT:+$OUT/gpu_check.log}
exec > >(tee ${LOG:+"$LOG"}) 2>&1

if [[ "${1:-}" == "prepare" ]]; then
  # the GPU image (KINDS.md: Python 3.12, torch, triton, transformers) lacks these engine dependencies
  mkdir -p "$WHEELS"
  "$PY" -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_31_x86_64 -d "$WHEELS" msgspec "llguidance>=1.9,<2"
  ls -la "$WHEELS"
  exit
fi

DRY=0; [[ "${1:-}" == "--dry-run" ]] && DRY=1
WORK=${WORK:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
FAILED=()
step() {  # step NAME SECONDS CMD...: run with a time limit, note a failure, go on
  local name=$1 limit=$2; shift 2
  echo; echo "=== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@"; local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
  [[ $rc == 0 ]] || FAILED+=("$name (exit $rc)")
}

echo "=== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
"$PY" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
"$PY" -c "import triton; print('triton', triton.__version__)" || echo "no triton"
"$PY" -c "import msgspec, llguidance" 2>/dev/null || {
  echo "=== installing the carried wheels ($WHEELS)"
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" msgspec llguidance || FAILED+=("wheels")
}

DEVICE=cuda; LAYERS=(); TOKENS=32; STEPS=30; BATCHES=(1 16 64)
if [[ $DRY == 1 ]]; then DEVICE=cpu; LAYERS=(--layers 2); TOKENS=4; STEPS=3; BATCHES=(1 4); fi
CKPT=$WORK/qwen2.5-0.5b
step checkpoint 300 "$PY" -m demo.shapes --shape qwen2.5-0.5b "${LAYERS[@]}" --no-tokenizer "$CKPT"

if [[ $DEVICE == cuda ]]; then
  # every kernel compiled by this machine's Triton for sm_90 (the CPU suite does it with the Triton installed there)
  step kernels-compile 240 env -u TRITON_INTERPRET "$PY" -m engine.triton_kernels.compile_check --quick
fi
step greedy 420 "$PY" -m bench.gpu_greedy --model "$CKPT" --device "$DEVICE" --prompts 8 --tokens "$TOKENS"
for b in "${BATCHES[@]}"; do
  step "decode-batch-$b" 240 "$PY" -m bench.profile_step --model "$CKPT" --dtype bfloat16 --device "$DEVICE" \
    --batch "$b" --steps "$STEPS"
done

# LoRA: base / 1 adapter / 4 adapters round-robin through the Triton shrink / expand kernels (bench/lora.py)
step lora 420 "$PY" -m bench.lora --model "$CKPT" --device "$DEVICE" --dtype bfloat16 --new "$TOKENS" --repeats 1

if "$PY" -c "import vllm" 2>/dev/null; then
  step vllm 420 "$PY" - "$CKPT" "${BATCHES[@]}" <<'PYEOF'
import sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=sys.argv[1], dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=False)
params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, detokenize=False)
for b in map(int, sys.argv[2:]):
    prompts = [TokensPrompt(prompt_token_ids=[1000 + 7 * i + j for j in range(128)]) for i in range(b)]
    llm.generate(prompts[:1], params)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    print(f"vllm batch {b}: {sum(len(o.outputs[0].token_ids) for o in outs) / dt:.0f} output tok/s (prefill included)")
PYEOF
else
  echo; echo "=== vllm: not installed here (the GPU machine reaches no package index, and vLLM's wheels are far"
  echo "    over what a run can carry); skipped"
fi

echo; echo "=== summary: ${#FAILED[@]} step(s) failed${FAILED:+: ${FAILED[*]}}"
[[ ${#FAILED[@]} == 0 ]]
