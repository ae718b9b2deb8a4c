# shellcheck shell=bash
# Shared by scripts/bench_cpu.sh and scripts/bench_cpu_packed.sh, sourced from the repository root with
# PORT set: the common settings (PY, OUTDIR, SERVE_REQUESTS; OUTDIR created), a tokenfab server in the
# background and `tokenfab bench serve` against it.
PY=.venv/bin/python
OUTDIR="${OUTDIR:-benchmarks/results}"
SERVE_REQUESTS="${SERVE_REQUESTS:-16}"
mkdir -p "$OUTDIR"

# serve_bg ARGS...: `tokenfab serve ARGS` on $PORT in the background (pid in SERVE_PID, log in SERVE_LOG),
# returning once /health answers (or after 2 minutes); 1, with the log on stderr, if the server died first.
# The caller kills it: trap 'kill "$SERVE_PID" 2>/dev/null || true' RETURN
serve_bg() {
    SERVE_LOG="$(mktemp /tmp/tokenfab_serve.XXXXXX.log)"
    $PY -m tokenfab serve "$@" --port "$PORT" --no-access-log >"$SERVE_LOG" 2>&1 &
    SERVE_PID=$!
    for _ in $(seq 1 240); do
        curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && return 0
        kill -0 "$SERVE_PID" 2>/dev/null || { cat "$SERVE_LOG" >&2; return 1; }
        sleep 0.5
    done
}

# bench_serve ARGS...: the CPU serving benchmark (concurrency 1/4/16, 128 tokens in, 64 out, float32, the
# thread count noted) against the server on $PORT; ARGS: more --settings, the peer and the outputs.
bench_serve() {
    $PY -m tokenfab bench serve --base-url "http://127.0.0.1:$PORT" --concurrency 1,4,16 \
        --num-requests "$SERVE_REQUESTS" --input-len 128 --output-len 64 --warmup 2 \
        --settings dtype=float32 --settings "threads=$($PY -c 'import torch; print(torch.get_num_threads())')" "$@"
}
