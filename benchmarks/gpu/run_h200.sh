#!/usr/bin/env bash
# Issue 7's device run: the Triton kernel / CUDA runner tests at full shapes, then timings of a
# dummy-weight Llama-3-8B-shaped model in bf16 on the lent H200. ONE command, from the repo root:
#
#     bash benchmarks/gpu/run_h200.sh          (benchmarks/gpu/README.md has the exact `run` call)
#
# Steps (each with its own `timeout`, capped by what is left of H200_BUDGET_S, default 540 s):
#   setup      carried wheels (.whl/, msgspec) -> /tmp/site; import check; nvidia-smi; model config
#   limits     GPU copy bandwidth + bf16 GEMM rate (CUDA events), the floors' yardstick
#   pytest_kernels  tests/layers/test_triton_attention.py (full shapes on CUDA; xdist -n 4)
#   pytest_worker   tests/worker (staging, CUDA graphs vs eager, memory planning)
#   latency    prefill 2048, decode batch 1/32/128, CUDA graphs on
#   throughput 1000 random requests (prompt 128-1024, output 128-512), one LLM.generate
#   hf         HF generate bf16 on the first K of the same requests (padded batches, batch 1)
#   eager      decode batch 1/32/128 again with enforce_eager (graphs vs eager)
#   pytest_quant  tests/layers/test_triton_quant_gemm.py (int8 / int4 dequant-GEMMs, Llama-sized on CUDA)
#   quant_gemm    benchmarks/gpu/quant_gemm.py: those kernels vs torch dequantize+matmul (and bf16),
#                 Llama-3-8B linear shapes, M 1..2048 (+ the tile sweep); $OUT/quant_gemm.json
#   summary    compact table (also $OUT/summary.md)
# H200_STEPS="latency throughput" runs only those steps (a rerun on the still-warm machine);
# H200_STEPS="limits pytest_quant quant_gemm" is the quantized-GEMM check alone (~3-5 min);
# H200_BUDGET_S changes the whole-script budget.
# Outputs under $OUT (5 files, the device tool returns at most 8): run.log (everything),
# pytest.log, results.jsonl (one line per step: rc, wall time, the bench's JSON report, key log
# lines), summary.md (a section ready for docs/benchmarks.md), quant_gemm.json.
set -euo pipefail

OUT="${OUT:-$PWD/h200-out}"
mkdir -p "$OUT"
: >"$OUT/run.log"

main() {
  local REPO PY W MD RES T0 BUDGET RESERVE FAILED
  REPO="$(pwd)"
  PY="${PYTHON:-python3}"
  W="$(mktemp -d /tmp/h200.XXXXXX)"        # raw per-step JSON/logs (only $OUT comes back)
  MD="$W/llama3-8b-shape"
  RES="$OUT/results.jsonl"
  T0=$SECONDS
  BUDGET="${H200_BUDGET_S:-540}"           # whole script; the device command gets timeout_s=600
  RESERVE=20                               # kept for the summary
  FAILED=0
  : >"$RES"

  export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 TOKENIZERS_PARALLELISM=false
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
  unset TRITON_INTERPRET PAGEDLLM_DEVICE || true   # compiled Triton on the GPU, never the interpreter
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

  echo "=== run_h200.sh $(date -Is) in $REPO; budget ${BUDGET}s; work dir $W"
  git -C "$REPO" log -1 --format='commit %H %s' 2>/dev/null || echo "(no git metadata)"

  # ---------------------------------------------------------------- setup (no network there)
  # torch/triton/transformers/tokenizers/safetensors/numpy come with the device image; nothing is
  # reinstalled. msgspec is not in it: carry its wheel in .whl/ (README). No `pip install -e .`:
  # it would need build isolation (= network); the repo on PYTHONPATH is enough, and the bench
  # CLI is called through h200_tools.py (same `main` as the `pagedllm` script).
  if compgen -G ".whl/*.whl" >/dev/null; then
    timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site" \
      || echo "WARNING: installing the carried wheels failed"
  fi
  if [ "${H200_PIP_INSTALL:-0}" = 1 ]; then   # opt-in: the console script `pagedllm`
    timeout 120 "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . \
      || echo "WARNING: editable install failed; continuing with PYTHONPATH"
  fi
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.mem \
    --format=csv 2>&1 || echo "WARNING: nvidia-smi failed"
  timeout 120 "$PY" - <<'EOF' || echo "WARNING: import check failed (see above); later steps may fail"
import importlib
missing = []
for name in ("torch", "triton", "transformers", "tokenizers", "safetensors", "numpy", "msgspec", "pytest"):
    try:
        mod = importlib.import_module(name)
        print(f"  {name} {getattr(mod, '__version__', '?')}")
    except Exception as exc:
        missing.append(name)
        print(f"  {name} MISSING: {exc}")
import torch
print(f"  cuda available: {torch.cuda.is_available()}; {torch.cuda.get_device_name() if torch.cuda.is_available() else ''}")
if "msgspec" in missing:
    print("  msgspec is needed by the engine (pagedllm/engine/protocol.py): carry .whl/ (benchmarks/gpu/README.md)")
if missing or not torch.cuda.is_available():
    raise SystemExit(1)
EOF
  timeout 120 "$PY" benchmarks/gpu/make_llama3_8b_config.py "$MD" || { echo "FATAL: model config"; return 1; }

  # ---------------------------------------------------------------- step runner
  # step NAME DESIRED_TIMEOUT MIN_TIMEOUT JSON -- CMD...   (JSON: report file or "-")
  step() {
    local name=$1 want=$2 min=$3 json=$4; shift 5
    case " ${H200_STEPS:-all} " in
      *" all "*|*" $name "*) ;;
      *) echo "=== $name not in H200_STEPS='${H200_STEPS:-}'"; return 0 ;;
    esac
    local left=$(( BUDGET - (SECONDS - T0) - RESERVE ))
    local t=$(( want < left ? want : left ))
    if (( t < min )); then
      echo "=== SKIP $name: ${left}s left of the budget, needs at least ${min}s"
      "$PY" benchmarks/gpu/h200_tools.py record --results "$RES" --step "$name" --rc -1 --wall 0 || true
      FAILED=1
      return 0
    fi
    echo "=== $name (timeout ${t}s; $(( SECONDS - T0 ))s elapsed) $(date +%T)"
    local s=$SECONDS rc
    set +e
    timeout -k 10 "$t" "$@" 2>&1 | tee "$W/$name.log"
    rc=${PIPESTATUS[0]}
    set -e
    local wall=$(( SECONDS - s ))
    echo "=== $name: rc=$rc in ${wall}s$( ((rc == 124 || rc == 137)) && echo ' (TIMED OUT)')"
    (( rc == 0 )) || FAILED=1
    local jarg=()
    [ "$json" = "-" ] || jarg=(--json "$json")
    "$PY" benchmarks/gpu/h200_tools.py record --results "$RES" --step "$name" --rc "$rc" --wall "$wall" \
      "${jarg[@]}" --log "$W/$name.log" || true
  }
  local TOOLS=(benchmarks/gpu/h200_tools.py)
  local MODEL=(--model "$MD" --load-format dummy --dtype bfloat16 --device cuda --seed 0)
  local CPU_PROBE=(--limits-copy-mib 64 --limits-gemm-n 512)   # the bench's floors probe the CPU: keep it cheap
  local LAT=(--decode-prompt-len 32 --warmup-steps 5 --decode-steps 32)
  local REQS=(--num-requests 1000 --prompt-len 128 1024 --output-len 128 512)

  # ---------------------------------------------------------------- limits (~15 s)
  step limits 60 20 "$W/limits.json" -- "$PY" "${TOOLS[@]}" limits --json "$W/limits.json"

  # ---------------------------------------------------------------- kernel + runner tests (~60-150 s)
  # The kernel tests are independent and dominated by Triton compiles: 4 xdist workers compile in
  # parallel (16 cores there) where the image's pytest-xdist is present. The runner tests build
  # engines that plan GPU memory, so they run alone.
  local PT=(-o addopts= -q -rs -p no:warnings -p no:cacheprovider) XDIST=()
  "$PY" -c "import pytest_timeout" 2>/dev/null && PT+=(--timeout 150)
  "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 4)
  step pytest_kernels 150 45 - -- "$PY" -m pytest tests/layers/test_triton_attention.py "${PT[@]}" "${XDIST[@]}"
  step pytest_worker 150 45 - -- "$PY" -m pytest tests/worker "${PT[@]}"
  cat "$W/pytest_kernels.log" "$W/pytest_worker.log" >"$OUT/pytest.log" 2>/dev/null || true

  # ---------------------------------------------------------------- latency, CUDA graphs (~45-70 s)
  step latency 150 60 "$W/latency.json" -- "$PY" "${TOOLS[@]}" bench -- latency "${MODEL[@]}" \
    --batch-sizes 1 32 128 "${LAT[@]}" --prefill-len 2048 --prefill-iters 5 "${CPU_PROBE[@]}" \
    --output-json "$W/latency.json"

  # ---------------------------------------------------------------- offline throughput (~70-120 s)
  step throughput 200 90 "$W/throughput.json" -- "$PY" "${TOOLS[@]}" bench -- throughput "${MODEL[@]}" \
    "${REQS[@]}" --max-model-len 2048 --disable-detokenize --output-json "$W/throughput.json"

  # ---------------------------------------------------------------- HF generate, bf16 (~60-110 s)
  # padded batches of 64 on the first 128 requests (2 batches), then 3 requests at batch size 1;
  # the JSON is rewritten after each run, so a timeout keeps what finished.
  step hf 170 60 "$W/hf.json" -- "$PY" "${TOOLS[@]}" hf --model "$MD" --json "$W/hf.json" "${REQS[@]}" \
    --seed 0 --batch-requests 128 --batch-sizes 64 --one-at-a-time 3

  # ---------------------------------------------------------------- graphs vs eager (~30-45 s)
  step latency_eager 90 40 "$W/latency_eager.json" -- "$PY" "${TOOLS[@]}" bench --eager -- latency \
    "${MODEL[@]}" --batch-sizes 1 32 128 "${LAT[@]}" --prefill-len 128 --prefill-iters 1 "${CPU_PROBE[@]}" \
    --output-json "$W/latency_eager.json"

  # ---------------------------------------------------------------- quantized GEMMs (~2-4 min)
  # Last in a full run (the steps above are issue 7's); alone: H200_STEPS="limits pytest_quant quant_gemm".
  step pytest_quant 150 45 - -- "$PY" -m pytest tests/layers/test_triton_quant_gemm.py "${PT[@]}"
  cat "$W/pytest_quant.log" >>"$OUT/pytest.log" 2>/dev/null || true
  step quant_gemm 200 60 "$W/quant_gemm.json" -- "$PY" benchmarks/gpu/quant_gemm.py --json "$W/quant_gemm.json" \
    ${H200_QUANT_SWEEP:+--sweep}
  cp "$W/quant_gemm.json" "$OUT/" 2>/dev/null || true

  # ---------------------------------------------------------------- summary
  echo "=== summary ($(( SECONDS - T0 ))s elapsed)"
  timeout 60 "$PY" "${TOOLS[@]}" summary --results "$RES" --model-dir "$MD" --md "$OUT/summary.md" \
    || echo "WARNING: summary failed; the raw reports are in $RES"
  echo "=== done in $(( SECONDS - T0 ))s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
  return "$FAILED"
}

# run.log is written as the run goes: a command killed at its limit still brings it back.
main 2>&1 | tee -a "$OUT/run.log"
