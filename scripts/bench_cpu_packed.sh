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
PY=.venv/bin/python
OUTDIR="${OUTDIR:-benchmarks/results}"
SERVE_REQUESTS="${SERVE_REQUESTS:-16}"
PORT="${PORT:-8124}"
QUANT="${QUANT:-gguf}"
mkdir -p "$OUTDIR"

serve() {
    local log server_pid
    log="$(mktemp /tmp/tokenfab_serve.XXXXXX.log)"
    $PY -m tokenfab serve --quantization "$QUANT" --port "$PORT" --no-access-log >"$log" 2>&1 &
    server_pid=$!
    trap 'kill "$server_pid" 2>/dev/null || true' RETURN
    for _ in $(seq 1 240); do
        curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
        kill -0 "$server_pid" 2>/dev/null || { cat "$log" >&2; return 1; }
        sleep 0.5
    done
    grep -h "memory:" "$log" || true
    $PY -m tokenfab bench serve --base-url "http://127.0.0.1:$PORT" --concurrency 1,4,16 \
        --num-requests "$SERVE_REQUESTS" --input-len 128 --output-len 64 --warmup 2 \
        --settings dtype=float32 --settings "threads=$($PY -c 'import torch; print(torch.get_num_threads())')" \
        --settings "weights=the GGUF's Q4_1 / Q8_0 blocks kept packed (--quantization $QUANT)" \
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
