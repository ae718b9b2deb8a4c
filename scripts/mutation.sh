#!/usr/bin/env bash
# Mutation testing (issue 12, part 7): mutmut over the engine's sampler, scheduler, block
# manager and sampling parameters, and the sampling kernel's reference. Not part of `make test`.
#
#   scripts/mutation.sh [REV]      # default HEAD; `make mutation`
#
# It runs in a scratch copy of the committed revision REV ($MUTATION_DIR, default
# /tmp/tokenfab-mutation-<rev>), never in the working tree: mutmut writes mutants/ next to the
# sources, and a half-edited tree would make the score meaningless. The mutated files and the
# tests it runs are [tool.mutmut] in pyproject.toml (taken from the working tree, so the config can
# be tried on an older revision). Niced; MUTATION_JOBS children (default 1). Prints the score and
# writes the survivors to $MUTATION_DIR/survivors.txt.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
REV=${1:-HEAD}
SHA=$(git -C "$ROOT" rev-parse --short "$REV")
WORK=${MUTATION_DIR:-/tmp/tokenfab-mutation-$SHA}
JOBS=${MUTATION_JOBS:-1}
BIN="$ROOT/.venv/bin"

rm -rf "$WORK"
mkdir -p "$WORK"
git -C "$ROOT" archive "$SHA" | tar -x -C "$WORK"
cp "$ROOT/pyproject.toml" "$WORK/pyproject.toml"
cd "$WORK"
# mutmut runs the whole selection twice inside its own process before forking the mutants: with
# the engine's allocator tuning (keep the peak heap) that process grew to 7 GB and was OOM-killed
export TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1 TOKENFAB_CPU_MALLOC_TUNING=0
nice -n 10 "$BIN/mutmut" run --max-children "$JOBS" >"$WORK/run.log" 2>&1 || {
    tail -40 "$WORK/run.log"; exit 1; }
"$BIN/mutmut" results --all true >"$WORK/results.txt" 2>&1 || true
"$BIN/python" - "$WORK/results.txt" "$SHA" <<'PY'
import collections, sys
rows = [l.strip().rsplit(": ", 1) for l in open(sys.argv[1]) if ": " in l]
status = collections.Counter(s for _, s in rows)
killed = status["killed"] + status["timeout"] + status["segfault"]
survived = status["survived"]
tested = killed + survived
print(f"revision {sys.argv[2]}: {dict(status)}")
print(f"mutation score: {killed}/{tested} killed = {100 * killed / max(tested, 1):.1f}%"
      " (timeouts and crashes count as killed; 'no tests' and skipped mutants are not in the score)")
# the Triton launcher and its launch config only matter on a GPU: the score of the references alone
refs = [(n, s) for n, s in rows if "_sample_triton" not in n and "sample_config" not in n]
k = sum(s in ("killed", "timeout", "segfault") for _, s in refs)
t = k + sum(s == "survived" for _, s in refs)
print(f"without the Triton launcher: {k}/{t} killed = {100 * k / max(t, 1):.1f}%")
with open(sys.argv[1].replace("results.txt", "survivors.txt"), "w") as f:
    f.writelines(n + "\n" for n, s in rows if s in ("survived", "no tests"))
PY
