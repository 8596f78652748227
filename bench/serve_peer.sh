#!/usr/bin/env bash
# On the H200: one OpenAI-compatible server on CKPT under vLLM's own load client (`vllm bench serve`, from the
# vLLM 0.26.0 bundle unpacked into /tmp/vsite, see ../shared/tools/peer/README.md), a warm-up pass then the
# reported pass; JSON and logs into $OUT.
#   bash bench/serve_peer.sh SERVER CKPT WORKLOAD
#     SERVER:   ours (python -m modelopt_jax serve: frontend + engine-core processes, every default)
#               ours-thread (the same with --in-process-engine: the engine on a thread of the HTTP process)
#               vllm (vllm serve --quantization modelopt, its defaults but prefix caching as below)
#     WORKLOAD: random (500 requests, at most 200 in flight, input 64-1024 tokens, output 32-512; both servers
#               with prefix caching off: the reported pass repeats the warm-up pass's prompts, and until
#               2026-12-07 ours kept its default (on) here and reused the warm-up pass's pages)
#               prefix (the same plus a 1500-token prefix shared by every request, a long system prompt;
#               both servers with prefix caching on)
# The checkpoint's files are linked into /tmp/ckt with .peer/tok's tokenizer (one word per id, so each
# token is one text delta). N, C, IN, OUTLEN, R, PREFIX override the load; OURS_FLAGS adds options to ours
# (TAG_SUFFIX then keeps its files apart).
set -uo pipefail
server=$1; ckpt=$2; workload=$3
N=${N:-500}; C=${C:-200}; IN=${IN:-544}; OUTLEN=${OUTLEN:-272}; R=${R:-0.88}; OUT=${OUT:-/tmp/out}
if [ "$workload" = prefix ]; then PREFIX=${PREFIX:-1500}; else PREFIX=0; fi
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT" /tmp/ckt && rm -f /tmp/ckt/*
for f in "$ckpt"/*; do ln -sf "$f" /tmp/ckt/; done
rm -f /tmp/ckt/tokenizer.json /tmp/ckt/tokenizer_config.json /tmp/ckt/special_tokens_map.json
cp "$root"/.peer/tok/*.json /tmp/ckt/
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
  PYTHONUNBUFFERED=1
tag=${server}_${workload}${TAG_SUFFIX:-}
case "$server" in
  ours|ours-thread)
    flags=(); [ "$server" = ours-thread ] && flags+=(--in-process-engine)
    [ "$workload" = random ] && flags+=(--no-prefix-caching)  # as vLLM below: the passes repeat their prompts
    read -ra extra <<< "${OURS_FLAGS:-}"; flags+=("${extra[@]}")  # e.g. OURS_FLAGS="--max-num-batched-tokens 768"
    # /tmp/vsite after the project: the bundle's pyzmq, msgspec and prometheus_client serve ours too
    PYTHONPATH=$root:/tmp/vsite XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 MODELOPT_JAX_NATIVE_DIR=$root/.native \
      python3 -m modelopt_jax serve /tmp/ckt --port 8001 --served-model-name m --quiet --disable-log-requests \
      "${flags[@]}" > "$OUT/server_$tag.log" 2>&1 & ;;
  vllm)
    flags=(); [ "$workload" = random ] && flags+=(--no-enable-prefix-caching)
    PYTHONPATH=/tmp/vsite python3 -m vllm.entrypoints.cli.main serve /tmp/ckt --port 8001 --served-model-name m \
      --quantization modelopt --max-model-len 4096 "${flags[@]}" \
      > "$OUT/server_$tag.log" 2>&1 & ;;
  *) echo "unknown server $server"; exit 2 ;;
esac
srv=$!
t0=$(date +%s)
for i in $(seq 1 300); do
  python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8001/health', timeout=2)" 2>/dev/null && break
  kill -0 "$srv" 2>/dev/null || { echo "$server exited"; tail -30 "$OUT/server_$tag.log"; exit 1; }
  sleep 1
done
echo "$tag ready after $(( $(date +%s) - t0 )) s"
# CPU seconds (user + system) of the server's process and of each child (the engine core), from /proc
cpu_of() { for p in "$srv" $(pgrep -P "$srv"); do [ -r /proc/$p/stat ] && printf "%s:%s:%s " "$p" "$(tr -c 'A-Za-z0-9_.\n-' _ < /proc/$p/comm)" \
  "$(sed 's/.*) //' /proc/$p/stat | awk '{printf "%.2f", ($12 + $13) / 100}')"; done; }
for pass in warm run; do
  [ "$pass" = run ] && cpu_before=$(cpu_of) && t_run=$(date +%s.%N)
  PYTHONPATH=/tmp/vsite timeout 400 python3 -m vllm.entrypoints.cli.main bench serve --backend vllm \
    --base-url http://127.0.0.1:8001 --endpoint /v1/completions --model m --tokenizer /tmp/ckt --dataset-name random \
    --random-input-len "$IN" --random-output-len "$OUTLEN" --random-range-ratio "$R" --random-prefix-len "$PREFIX" \
    --num-prompts "$N" --max-concurrency "$C" --ignore-eos --seed 0 --temperature 0 \
    --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --save-result --result-dir "$OUT" \
    --result-filename "bench_${tag}_$pass.json" 2>&1 | tee "$OUT/bench_${tag}_$pass.log" \
    | grep -E "throughput|TTFT|TPOT|ITL|E2EL" | grep -E "Request|Output|Median|P99"
done
cpu_after=$(cpu_of); t_end=$(date +%s.%N)
python3 - "$cpu_before" "$cpu_after" "$t_run" "$t_end" <<'PY' | tee "$OUT/cpu_$tag.txt"
import sys
before, after = ({k: (n, float(c)) for k, n, c in (x.split(":") for x in s.split())} for s in sys.argv[1:3])
wall = float(sys.argv[4]) - float(sys.argv[3])
for pid, (name, c) in after.items():
    busy = c - before.get(pid, (name, 0.0))[1]
    print(f"process {pid} {name}: {busy:.1f} CPU s over the reported pass's {wall:.1f} s ({100 * busy / wall:.0f}% of a core)")
PY
case "$server" in ours*) python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8001/metrics', timeout=5).read().decode())" > "$OUT/metrics_$tag.txt" 2>&1 ;; esac
kill -TERM "$srv" 2>/dev/null; wait "$srv" 2>/dev/null
echo "$tag server exit status $?"
