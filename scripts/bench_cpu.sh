#!/usr/bin/env bash
# Re-measure the CPU result files of benchmarks/results/ at the current commit (issue 12):
#
#   scripts/bench_cpu.sh throughput   offline throughput vs transformers (rounds interleaved, each run
#                                     in a fresh process, the peer's batch sizes swept, one allocator
#                                     setting for both) -> cpu_throughput_bundled{,_bf16}.{json,md}
#   scripts/bench_cpu.sh serve        tokenfab serve vs llama.cpp's server on the same GGUF, concurrency
#                                     1/4/16, in one run -> cpu_serve_bundled.{json,md,png}
#   scripts/bench_cpu.sh all          both
#   scripts/bench_cpu.sh cpu          tokenfab vs llama.cpp's llama-bench / llama-batched-bench and
#                                     transformers on the bundled GGUF, with ISA flags and a measured
#                                     roofline (issue 26) -> cpu_bench_<isa>.{json,md}; needs the tools
#                                     built once: scripts/llama_cpp_server.sh build-tools (else skipped)
#
# Knobs: REPEATS (throughput rounds, default 2), DTYPES (default "float32"; e.g. "float32 bfloat16"),
# SERVE_REQUESTS (requests per level, default 16), OUTDIR (default benchmarks/results), PORT (8123).
# The serve part needs the llama.cpp peer built once: scripts/llama_cpp_server.sh build (~6 min on
# 2 cores; without it, it measures tokenfab alone and says so).
#
# OMP_WAIT_POLICY: `throughput` and `serve` default it to PASSIVE for every process of the run (ours,
# transformers, llama.cpp alike): on shared, loaded cores (load averages of 10 and more) OpenMP
# threads that spin at barriers while their partner is descheduled made llama.cpp 80x slower (32
# tokens: 50 s spinning, 0.6 s passive) and our server 3x slower at concurrency 1. `cpu` leaves it as
# the caller has it (unset: each runtime's default, its best on a quiet machine): on a quiet 2-vCPU
# AMD EPYC, PASSIVE cut llama-bench tg128 from 91.6 to 29.9 tok/s and ours from ~80 to 51.9, which
# measures wake-ups, not kernels. Export a value to measure with it.
passive_unless_set() { export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"; }

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPEATS="${REPEATS:-2}"
DTYPES="${DTYPES:-float32}"
PORT="${PORT:-8123}"
# shellcheck source=scripts/serve_bench_lib.sh
source scripts/serve_bench_lib.sh

throughput() {
    passive_unless_set
    for dtype in $DTYPES; do
        local name=cpu_throughput_bundled
        [ "$dtype" = float32 ] || name="${name}_${dtype/bfloat16/bf16}"
        $PY -m tokenfab bench throughput --dtype "$dtype" --repeats "$REPEATS" \
            --json "$OUTDIR/$name.json" --markdown "$OUTDIR/$name.md"
    done
}

serve() {
    passive_unless_set
    local peer=()
    serve_bg --dtype float32 || return 1
    trap 'kill "$SERVE_PID" 2>/dev/null || true' RETURN
    if [ -x "${LLAMA_CPP_VENV:-.venv-llamacpp}/bin/python" ]; then
        peer=(--llama-cpp)
    else
        echo "no llama.cpp peer built (scripts/llama_cpp_server.sh build): measuring tokenfab alone" >&2
    fi
    bench_serve --settings "weights=the GGUF's Q4_1 dequantized to float32 at load" \
        --settings "launch=tokenfab serve --dtype float32" \
        "${peer[@]}" --json "$OUTDIR/cpu_serve_bundled.json" --markdown "$OUTDIR/cpu_serve_bundled.md" \
        --plot "$OUTDIR/cpu_serve_bundled.png"
}

cpu_bench() {
    local isa
    isa="$($PY -c 'from tokenfab.bench.cpu import cpu_flags, isa_tag; print(isa_tag(cpu_flags()))')"
    $PY -m tokenfab bench cpu --json "$OUTDIR/cpu_bench_$isa.json" --markdown "$OUTDIR/cpu_bench_$isa.md"
}

case "${1:-all}" in
throughput) throughput ;;
cpu) cpu_bench ;;
serve) serve ;;
all) throughput; serve ;;
*) sed -n '2,20p' "$0" >&2; exit 2 ;;
esac
