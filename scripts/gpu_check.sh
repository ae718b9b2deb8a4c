#!/usr/bin/env bash
# The one prepared GPU check (ARCHITECTURE.md, "The GPU check"). Run it through the device tool
# as a single call, e.g.  run(command="bash scripts/gpu_check.sh", timeout_s=480)
#
# Sections, in this order, each under its own time limit (`timeout`), each appending its result to
# $OUT/gpu_report.json and $OUT/gpu_report.md as soon as it ends (scripts/gpu_report.py), so a run
# killed halfway still reports every section it finished:
#   warmup             a few small kernel tests: compiles the common Triton kernels into the
#                      TRITON_CACHE_DIR that every later section shares
#   engine_correctness tiny random Llama and Qwen3-MoE, greedy: CUDA graphs vs eager vs
#                      transformers on the GPU, bf16 and fp32 (scripts/gpu_engine_check.py);
#                      before any speed is measured
#   kernel_tests       tests/kernels on CUDA (compiled Triton kernels vs the references)
#   kernel_benchmarks  `tokenfab bench kernels` (fractions of the roofline, goals)
#   mla_benchmarks     MLA / DSA kernels at DeepSeek-V3 / V3.2 sizes
#   end_to_end         `tokenfab bench engine` (random Qwen3-0.6B shape; graphs vs eager vs transformers)
#   overlap            `tokenfab bench overlap`: device time between decode steps, --async-scheduling off/on
#   c_kernels          the native CPU kernels' tests; skipped, with the reason, without a C compiler;
#                      optional (CI runs them on CPU): neither a failure nor a lack of time fails the verdict
# then a verdict (pass / fail) and $OUT/gpu_check.log. The whole stays inside GPU_CHECK_BUDGET_S
# (default 465 s, under the 8 minutes of ARCHITECTURE.md): a section never gets more than the
# budget has left, and one with under 15 s left is recorded as skipped.
# float16 is not checked: the engine refuses --dtype float16 on CUDA (engine/llm_engine.py).
# Nothing is installed and nothing is fetched: the device image has torch, triton, pytest
# (with pytest-xdist and pytest-timeout), transformers and safetensors.
#
# Knobs, e.g. for a dry run on a CPU machine (kernels then run in Triton's interpreter):
#   GPU_CHECK_SECTIONS="engine_correctness c_kernels" OUT=/tmp/x bash scripts/gpu_check.sh
#   KERNEL_TESTS="tests/kernels/test_norm.py" XDIST_N=0 ...
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-$PWD/gpu_out}"
WORK="$(mktemp -d /tmp/gpu_check.XXXXXX)"  # intermediate files: only 8 files come back from $OUT
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$WORK/triton_cache}"  # shared by every section
mkdir -p "$TRITON_CACHE_DIR"
unset TOKENFAB_KERNELS
PY="${PYTHON:-python3}"
KERNEL_TESTS="${KERNEL_TESTS:-tests/kernels}"
WARMUP_TESTS="${WARMUP_TESTS:-tests/kernels/test_norm.py tests/kernels/test_rope.py tests/kernels/test_activation.py}"
C_KERNEL_TESTS="tests/kernels/test_cpu_native.py tests/kernels/test_cpu_native_checks.py"
XDIST_N="${XDIST_N:-8}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-465}"
SECTIONS="${GPU_CHECK_SECTIONS:-warmup engine_correctness kernel_tests kernel_benchmarks mla_benchmarks end_to_end overlap c_kernels}"
OPTIONAL_SECTIONS="c_kernels"  # reported, but outside the verdict
if $PY -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    export TRITON_INTERPRET=0  # compiled kernels
    ON_GPU=1
else
    ON_GPU=0
fi
LOG="$OUT/gpu_check.log"
: >"$LOG"
START=$(date +%s)
REPORT=("$PY" scripts/gpu_report.py)

say() { echo "[gpu_check $(($(date +%s) - START))s] $*" | tee -a "$LOG"; }
wanted() { [[ " $SECTIONS " == *" $1 "* ]]; }
optional() { [[ " $OPTIONAL_SECTIONS " == *" $1 "* ]] && echo --optional; }

# record_skip NAME REASON [--no-time]: a section that did not run, and why (--no-time: the budget
# was spent, which leaves the check incomplete and fails the verdict; a skip for a reason does not)
record_skip() {
    "${REPORT[@]}" add --out "$OUT" --section "$1" --skipped "$2" ${3:+"$3"} $(optional "$1")
    say "section $1 skipped: $2"
}

# run_section NAME LIMIT_S COMMAND...: run under min(LIMIT_S, what the budget has left), then add
# the section's files ($WORK/NAME.{json,md,xml,log}, those the command wrote) to the report.
run_section() {
    local name=$1 limit=$2
    shift 2
    wanted "$name" || return 0
    local left=$((BUDGET_S - ($(date +%s) - START) - 15))  # 15: the kill grace and the report
    if [ "$left" -lt 15 ]; then
        record_skip "$name" "no time left in the ${BUDGET_S} s budget" --no-time
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    say "section $name (limit ${limit} s): $*"
    local t0 rc
    t0=$(date +%s)
    # SIGINT at the limit: pytest then stops and still writes its junit report; SIGKILL 10 s later
    timeout -s INT -k 10 "$limit" "$@" >"$WORK/$name.log" 2>&1
    rc=$?
    tail -n 25 "$WORK/$name.log" | tee -a "$LOG"
    "${REPORT[@]}" add --out "$OUT" --section "$name" --rc "$rc" --seconds $(($(date +%s) - t0)) --limit "$limit" $(optional "$name") \
        --json "$WORK/$name.json" --markdown "$WORK/$name.md" --junit "$WORK/$name.xml" --log "$WORK/$name.log"
    say "section $name rc=$rc$([ "$rc" = 124 ] && echo ' (time limit)')"
}

if command -v nvidia-smi >/dev/null 2>&1; then
    MACHINE="$(nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader 2>&1 | head -n 1)"
else
    MACHINE="no GPU (nvidia-smi not found)"
fi
VERSIONS="$($PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" 2>&1 | tail -n 1)"
COMMIT="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
"${REPORT[@]}" init --out "$OUT" --title "Machine: ${MACHINE}; ${VERSIONS}; commit ${COMMIT}; $(date -u +%FT%TZ)"
say "machine: $MACHINE"
say "$VERSIONS; commit $COMMIT; sections: $SECTIONS; budget ${BUDGET_S} s"

XDIST=()
if [ "$XDIST_N" != 0 ] && $PY -c "import xdist" 2>/dev/null; then
    XDIST=(-n "$XDIST_N")  # compile the many kernel variants in parallel
fi
HAVE_CC=0
for cc in "${CC:-}" cc gcc clang; do
    if [ -n "$cc" ] && command -v "$cc" >/dev/null 2>&1; then HAVE_CC=1; fi
done
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o junit_family=xunit2)
IGNORE_C=()
for f in $C_KERNEL_TESTS; do IGNORE_C+=(--ignore="$f"); done

# ------------------------------------------------------------------ warm-up (Triton cache)
# shellcheck disable=SC2086
run_section warmup 30 "${PYTEST[@]}" $WARMUP_TESTS ${XDIST[@]+"${XDIST[@]}"} --junitxml="$WORK/warmup.xml"

# ------------------------------------------------------------------ engine correctness (first)
if [ "$ON_GPU" = 1 ]; then
    run_section engine_correctness 110 "$PY" scripts/gpu_engine_check.py --device cuda \
        --dtypes bfloat16 float32 --modes graphs eager async \
        --json "$WORK/engine_correctness.json" --markdown "$WORK/engine_correctness.md"
else  # a dry run on CPU: the part that makes sense there
    run_section engine_correctness 300 "$PY" scripts/gpu_engine_check.py --device cpu --dtypes float32 \
        --modes eager --new-tokens 8 --json "$WORK/engine_correctness.json" --markdown "$WORK/engine_correctness.md"
fi

# ------------------------------------------------------------------ kernel tests
# shellcheck disable=SC2086
run_section kernel_tests 140 "${PYTEST[@]}" $KERNEL_TESTS "${IGNORE_C[@]}" ${XDIST[@]+"${XDIST[@]}"} \
    --junitxml="$WORK/kernel_tests.xml"

# ------------------------------------------------------------------ kernel benchmarks
run_section kernel_benchmarks 70 "$PY" -m tokenfab bench kernels --sweep --budget-s 50 \
    --json "$WORK/kernel_benchmarks.json" --markdown "$WORK/kernel_benchmarks.md"

run_section mla_benchmarks 35 "$PY" -m tokenfab.bench.mla --json "$WORK/mla_benchmarks.json"

# ====== BEGIN end-to-end engine benchmark (reserved for the lead) =============================
# Contract: write "$WORK/end_to_end.json" (any JSON object) and optionally "$WORK/end_to_end.md";
# run_section embeds them in the report. It gets what the budget has left (at most 100 s).
# CUDA graphs vs eager vs transformers generate: batch-1 decode tok/s, and output tok/s for
# 256 requests of 128 in / 128 out (the engine's model is built on the device: no weights travel).
# The peer sweeps batch 64 and all-at-once and warms up like us; --same-process frees each engine
# before the next (fresh memory without paying one CUDA start-up per engine inside 100 s).
run_section end_to_end 100 "$PY" -m tokenfab bench engine --shape qwen3-0.6b --num-requests 256 --input-len 128 \
    --output-len 128 --decode-tokens 256 --hf-batch-sizes 64,all --same-process \
    --json "$WORK/end_to_end.json" --markdown "$WORK/end_to_end.md"
# ====== END end-to-end engine benchmark =======================================================

run_section overlap 90 "$PY" -m tokenfab bench overlap --shape "$([ "$ON_GPU" = 1 ] && echo qwen3-0.6b || echo tiny)" --batch-sizes 1,16 --input-len 32 --output-len 48 --rounds 2 --json "$WORK/overlap.json" --markdown "$WORK/overlap.md"

# ------------------------------------------------------------------ native CPU kernels (C compiler; last: CI covers them on CPU, optional here)
if wanted c_kernels; then
    if [ "$HAVE_CC" = 1 ]; then
        # shellcheck disable=SC2086
        run_section c_kernels 60 "${PYTEST[@]}" $C_KERNEL_TESTS --junitxml="$WORK/c_kernels.xml"
    else
        record_skip c_kernels "no C compiler (cc, gcc or clang) on this machine: the native CPU kernels cannot be built here"
    fi
fi

"${REPORT[@]}" finish --out "$OUT" --elapsed $(($(date +%s) - START)) | tee -a "$LOG"
say "done: $OUT/gpu_report.json, $OUT/gpu_report.md"
rm -rf "$WORK"
