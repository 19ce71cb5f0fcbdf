#!/usr/bin/env bash
# HTTP serving overhead: the same workload at concurrency 16, once through the in-process engine
# (`llmopt bench --model`) and once through `llmopt serve` on loopback (`llmopt bench --url`), in
# interleaved rounds so both see the same moments of a shared machine. Prints `llmopt bench --compare`.
#
# Run: bash benchmarks/http_vs_offline.sh [ROUNDS] [OUTDIR]
set -euo pipefail
ROUNDS=${ROUNDS:-${1:-2}}
OUT=${2:-/tmp/http_vs_offline}
PORT=${PORT:-8765}
PY=${PY:-.venv/bin/python}
MODEL=${MODEL:-smollm2-135m}
DTYPE=${DTYPE:-bfloat16}
WORKLOAD=(--concurrency 16 --num-prompts 64 --input-len 64:256 --output-len 32:128 --warmup 2 --no-progress)
mkdir -p "$OUT"
"$PY" -m llmopt serve "$MODEL" --port "$PORT" --dtype "$DTYPE" >"$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  sleep 1
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { echo "server did not come up; see $OUT/serve.log"; exit 2; }
reports=()
# a new seed each round: the server's prefix cache outlives a round, the in-process engine does not
for r in $(seq "$ROUNDS"); do
  "$PY" -m llmopt bench --model "$MODEL" --dtype "$DTYPE" "${WORKLOAD[@]}" --seed "$r" --json "$OUT/offline_$r.json"
  "$PY" -m llmopt bench --url "http://127.0.0.1:$PORT" "${WORKLOAD[@]}" --seed "$r" --json "$OUT/http_$r.json"
  reports+=("$OUT/offline_$r.json" "$OUT/http_$r.json")
done
"$PY" -m llmopt bench --compare "${reports[@]}"
"$PY" - "$OUT" "$ROUNDS" <<'PY'
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def tput(path):
    return json.load(open(path))["runs"][0]["output_throughput"]
for r in range(1, rounds + 1):
    off, http = tput(f"{out}/offline_{r}.json"), tput(f"{out}/http_{r}.json")
    print(f"round {r}: offline {off:.1f} tok/s, HTTP {http:.1f} tok/s, HTTP/offline {http / off:.3f}")
PY
