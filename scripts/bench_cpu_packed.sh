#!/usr/bin/env bash
# Issue 14 part 4: the bundled model served with its GGUF weights packed (the CPU default) vs llama.cpp's
# server on the same GGUF, in one `tokenfab bench serve --llama-cpp` run (concurrency 1/4/16), and the
# offline single-stream TPOT of the same engine (python -m tokenfab.bench.packed offline).
#
#   scripts/bench_cpu_packed.sh [serve|offline|drift|all]   -> benchmarks/results/cpu_packed_*.{json,md,png}
#
# Knobs as scripts/bench_cpu.sh: SERVE_REQUESTS (16), OUTDIR, PORT (8124), QUANT (gguf; gguf-q8act, none),
# OMP_WAIT_POLICY (PASSIVE for every process of the run: the 2 cores are shared).
set -euo pipefail
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PORT="${PORT:-8124}"
QUANT="${QUANT:-gguf}"
# shellcheck source=scripts/serve_bench_lib.sh
source scripts/serve_bench_lib.sh

serve() {
    serve_bg --quantization "$QUANT" || return 1
    trap 'kill "$SERVE_PID" 2>/dev/null || true' RETURN
    grep -h "memory:" "$SERVE_LOG" || true
    bench_serve --settings "weights=the GGUF's Q4_1 / Q8_0 blocks kept packed (--quantization $QUANT)" \
        --settings "launch=tokenfab serve --quantization $QUANT" \
        --llama-cpp --json "$OUTDIR/cpu_packed_serve_$QUANT.json" --markdown "$OUTDIR/cpu_packed_serve_$QUANT.md" \
        --plot "$OUTDIR/cpu_packed_serve_$QUANT.png"
}

offline() {
    $PY -m tokenfab.bench.packed offline --json "$OUTDIR/cpu_packed_offline.json" --markdown "$OUTDIR/cpu_packed_offline.md"
}

drift() {
    $PY -m tokenfab.bench.packed drift --json "$OUTDIR/cpu_packed_q8act_drift.json" --markdown "$OUTDIR/cpu_packed_q8act_drift.md"
}

case "${1:-all}" in
serve) serve ;;
offline) offline ;;
drift) drift ;;
all) offline; drift; serve ;;
*) sed -n '2,8p' "$0" >&2; exit 2 ;;
esac
