#!/usr/bin/env bash
# One device session on the H200: GPU tests, memcheck sample, tuning and a benchmark, logs to $OUT.
# Expects the built libraries in .native/ (NATIVE_DIR names another folder, e.g. a baseline build for an A/B)
# and the needed fixtures in .fixtures/ (carried). Carry .native in
# every call that runs our code: on 2026-12-06 a call that carried only .peer parts found no .native, and
# the engine silently fell back to XLA's paths (a warning in the log, a benchmark 10x slower).
#   bash bench/gpu_session.sh [ckpt-bg CKPT_DIR] [tests] [memcheck] [sanitize] [tune ARGS...] [bench ARGS...] [wc-tests]
#                             [tp-tests] [attach CKPT_DIR] [tp-bench CKPT_DIR] [attn-tests] [attn-bench] [attn-splits]
#                             [prefill-tests] [attn-prefill] [grouped-tests] [grouped-bench ARGS...]
#                             [accuracy] [dispatch [--shapes S] [--ms M]]
#                             [serve CKPT_DIR WORKLOADS [fp8] [static] [profile] [staged] [noprefill] [nofusedwrite]
#                                    [noprefix] [nocascade] [noprecompile] [host] [engine [W:]K=V[,K=V]]...]
#                             [peer CKPT_DIR WORKLOADS [noprefix] [fp8]]
#                             [serve-http CKPT_DIR [ARGS...]] [peer-parts I...] [peer-finish]
#                             [serve-peer ours|ours-thread|vllm CKPT_DIR random|prefix]
# attach / tp-bench / serve / serve-http write a synthetic FP8 checkpoint (bench/serve.py preset $PRESET, default
#   llama3-8b; llama3-8b-kv adds ModelOpt's FP8 KV scales, as NVIDIA's exports have, so both engines keep FP8
#   pages under kv_cache_dtype=auto -- give peer the same PRESET and a CKPT_DIR of its own) into CKPT_DIR first
#   if absent (name one under /dev/shm, a 128 GB tmpfs on the device machines: on 2026-12-07 the 7.5 GB MoE preset
#   took 22 s there and the 8B under 40 s, against 3-4 minutes in /tmp on its disk).
#   ckpt-bg CKPT_DIR starts that write in the background (3-4 minutes on the H200 machine's CPUs in /tmp)
#   so GPU steps after it run meanwhile; the next serve / serve-http step waits for it.
# peer CKPT_DIR WORKLOADS [noprefix] [fp8]: vLLM 0.26.0 (unpacked into /tmp/vsite by tools/peer's
#   device_unpack.sh) on serve's workloads (bench/peer_vllm_workloads.py; noprefix: its prefix caching off;
#   fp8: FP8 KV cache), into $OUT/vllm_<workloads>[_noprefix][_fp8].json. A serve step after it in the same
#   session prints ours/vLLM per workload from that JSON (PEER_JSON=PATH names another one instead). It runs
#   without the project on PYTHONPATH, so the repository root's packages (models/, tests/) shadow nothing
#   vLLM imports.
# serve ... profile: the CUPTI kernel tables of the workloads in PROFILE_WORKLOADS (default a; b256: 256 rows
#   of 700 tokens, (b)'s steady state). serve ... host: after the workloads, the host's milliseconds per step
#   by part for HOST_WORKLOADS (default c1024; bench/host_loop.py), run in the same process.
# grouped-tests / grouped-bench: the grouped FP8 GEMM's tests (GPU and CPU ones, on the GPU);
#   bench/grouped_gemm.py with ARGS (ours, XLA's paths and torch in the same run).
# accuracy: bench/gemm_accuracy.py (each GEMM configuration's fast-accumulation error against float64) and
#   the GPU test bounding it. dispatch: bench/tune_dispatch.py (ours vs XLA's FP8 dot per shape and M;
#   the table it would write is in $OUT/dispatch.json; --write is left to a deliberate run).
# attn-splits: the decode kernel's GPU time by CTAs per (token, kv head), beside kernel_splits' choice.
# prefill-tests / attn-prefill: the prefill kernel's tests; its GPU time on the engine's prompt-step shapes vs XLA.
# peer-parts / peer-finish: vLLM's bundle onto the machine (../shared/tools/peer), back-to-back calls on one warm
#   machine. serve-peer: bench/serve_peer.sh (`vllm bench serve` against one server; ours waits for the bundle
#   too, for the load client), then each server process's CPU over the reported pass and the engine core's step
#   mix. Write one synthetic checkpoint at a time: on 2026-12-07 two writers at once broke one's process pool.
# serve-http: bench/http_load.py (the server under 200 streaming clients, then LLM.generate on the same prompts);
#   ARGS go to it (e.g. --requests 500 --kv-cache-dtype fp8) and take the rest of the line, so it comes last.
# sanitize: compute-sanitizer memcheck over the GPU tests of our kernels and of the weight cache's
#   CUDA IPC store (daemon subprocesses included), one log per process in $OUT/sanitizer.<pid>.log
#   (packed into $OUT/sanitizer_logs.tgz) and the error summaries in $OUT/sanitizer_summary.txt;
#   SANITIZE_TESTS overrides the test list, SANITIZE_TIMEOUT the seconds pytest may run (540).
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MODELOPT_JAX_NATIVE_DIR=${NATIVE_DIR:-$PWD/.native} MODELOPT_JAX_FIXTURES=$PWD/.fixtures
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.7}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw --format=csv | tee "$OUT/gpu.txt"
python3 -c "import jax; print(jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
step=${1:-}
# A step's own arguments run up to the next step name (so "grouped-bench ARGS... tune ARGS..." works).
STEPS=" peer-parts peer-finish serve-peer tests memcheck sanitize tune bench grouped-tests grouped-bench accuracy dispatch wc-tests tp-tests attach tp-bench cascade-tests attn-tests attn-bench attn-prefill prefill-tests attn-splits ckpt-bg serve peer serve-http "
is_step() { [[ "$STEPS" == *" $1 "* ]]; }
while [ $# -gt 0 ]; do
  case "$1" in
    tests) shift
      python3 -m pytest -q -p no:cacheprovider tests/test_gpu_gemm.py tests/test_ffi_gemm.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    memcheck) shift
      timeout 300 compute-sanitizer --tool memcheck --print-limit 20 python3 -c "
import jax, jax.numpy as jnp, numpy as np
from modelopt_jax.ops.ffi_gemm import ffi_fp8_gemm
from modelopt_jax.ops import native
rng = np.random.default_rng(0)
for c in range(native.config_count()):
    for m, n, k in [(1, 256, 128), (37, 264, 512), (300, 1024, 256)]:
        x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32)).astype(jnp.float8_e4m3fn)
        w = jnp.asarray(rng.standard_normal((n, k)).astype(np.float32)).astype(jnp.float8_e4m3fn)
        ffi_fp8_gemm(x, w, x_scale=jnp.ones(m), w_scale=np.ones(n, np.float32), bias=jnp.ones(n), out_dtype=jnp.bfloat16, tile=c).block_until_ready()
        ffi_fp8_gemm(x, w, x_scale=0.5, w_scale=0.5, bias=None, out_dtype=jnp.float16, tile=c).block_until_ready()
print('memcheck sample done')
" 2>&1 | tail -15 | tee "$OUT/memcheck.log" ;;
    sanitize) shift
      # The platform allocator gives every buffer its own cudaMalloc, so an access past a buffer's end
      # is an error memcheck sees (inside XLA's BFC pool it would land in a neighbour). API errors are
      # not reported: XLA probes the driver in ways that fail by design; our handlers check their own.
      # The time limit sits inside the sanitizer, on pytest (SIGINT: pytest stops and reports), so the
      # sanitizer still writes each process's summary; killing the sanitizer instead left its target
      # running and no summary (2026-12-01). Autotuning is off: under memcheck its trial kernels cost
      # minutes. Under memcheck the GEMM tests alone take ~6 minutes: run the files in separate calls.
      t=${SANITIZE_TIMEOUT:-540}
      XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_PYTHON_CLIENT_PREALLOCATE=false \
        XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" timeout -k 10 $((t + 40)) \
        compute-sanitizer --tool memcheck --target-processes all --report-api-errors no --print-limit 50 \
        --log-file "$OUT/sanitizer.%p.log" timeout -s INT -k 15 "$t" python3 -m pytest -q -p no:cacheprovider \
        ${SANITIZE_TESTS:-tests/test_gpu_gemm.py tests/test_paged_attention.py tests/test_weight_cache_gpu.py} \
        > "$OUT/sanitizer_pytest.log" 2>&1
      tail -25 "$OUT/sanitizer_pytest.log"
      grep -h "ERROR SUMMARY" "$OUT"/sanitizer.*.log | sort | uniq -c | tee "$OUT/sanitizer_summary.txt"
      # one file back however many processes ran (the device tool returns at most 8 files)
      tar czf "$OUT/sanitizer_logs.tgz" -C "$OUT" $(cd "$OUT" && ls sanitizer.*.log) && rm -f "$OUT"/sanitizer.*.log ;;
    tune) shift; args=(); while [ $# -gt 0 ] && ! is_step "$1"; do args+=("$1"); shift; done
      python3 bench/tune_gemm.py --json "$OUT/tune.json" "${args[@]}" 2>&1 | tee "$OUT/tune.log" | tail -80 ;;
    bench) shift; args=(); while [ $# -gt 0 ] && ! is_step "$1"; do args+=("$1"); shift; done
      python3 bench/gemm.py --json "$OUT/bench.json" "${args[@]}" 2>&1 | tee "$OUT/bench.log" | tail -120 ;;
    grouped-tests) shift
      python3 -m pytest -q -p no:cacheprovider tests/test_gpu_grouped_gemm.py tests/test_grouped_gemm.py 2>&1 \
        | tee "$OUT/grouped_tests.log" | tail -25 ;;
    grouped-bench) shift; args=(); while [ $# -gt 0 ] && ! is_step "$1"; do args+=("$1"); shift; done
      python3 bench/grouped_gemm.py "${args[@]}" 2>&1 | tee "$OUT/grouped_bench.log" | tail -80 ;;
    accuracy) shift  # each configuration's fast-accumulation error vs float64 (and its GPU test)
      python3 bench/gemm_accuracy.py --json "$OUT/accuracy.json" 2>&1 | tee "$OUT/accuracy.log" | tail -30
      python3 -m pytest -q -p no:cacheprovider tests/test_gpu_gemm.py -k accumulation 2>&1 | tail -3 ;;
    dispatch) shift; args=(); while [ $# -gt 0 ] && [ "${1:0:2}" = -- ]; do args+=("$1" "$2"); shift 2; done
      python3 bench/tune_dispatch.py --json "$OUT/dispatch.json" "${args[@]}" 2>&1 | tee "$OUT/dispatch.log" | tail -60 ;;
    wc-tests) shift
      python3 -m pytest -q -p no:cacheprovider -s tests/test_weight_cache.py tests/test_weight_cache_gpu.py \
        tests/test_dlpack_view.py 2>&1 | tee "$OUT/wc_tests.log" | tail -25 ;;
    tp-tests) shift
      python3 -m pytest -q -p no:cacheprovider -s tests/test_tensor_parallel_gpu.py 2>&1 | tee "$OUT/tp_tests.log" | tail -25 ;;
    attach) ckpt=$2; shift 2
      python3 bench/weight_cache_attach.py --checkpoint "$ckpt" --write-preset llama3-8b --json "$OUT/attach.json" \
        2>&1 | tee "$OUT/attach.log" | tail -20 ;;
    tp-bench) ckpt=$2; shift 2
      [ -f "$ckpt/config.json" ] || python3 -c "import os; from modelopt_jax.synthetic import write_checkpoint as w; w('$ckpt', family='llama', hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_shard_bytes=5 << 30, workers=os.cpu_count() or 1)"
      python3 bench/generate.py --checkpoint "$ckpt" --tensor-parallel 1,2 --batches 1,8,64 --new 64 \
        --prefill 2048 --json "$OUT/tp_bench.json" 2>&1 | tee "$OUT/tp_bench.log" | tail -20 ;;
    cascade-tests) shift
      python3 -m pytest -q -p no:cacheprovider -s tests/test_cascade_attention.py tests/test_engine_gpu.py \
        tests/test_paged_attention.py::test_cuda_handlers_refuse_a_bad_pool_naming_the_op_and_what_is_wrong \
        2>&1 | tee "$OUT/cascade_tests.log" | tail -25 ;;
    attn-tests) shift
      python3 -m pytest -q -p no:cacheprovider tests/test_paged_attention.py tests/test_engine_gpu.py \
        2>&1 | tee "$OUT/attn_tests.log" | tail -25 ;;
    attn-bench) shift
      python3 bench/attention.py --json "$OUT/attention.json" 2>&1 | tee "$OUT/attention.log" | tail -30 ;;
    attn-prefill) shift
      python3 bench/attention.py --prefill --json "$OUT/attention_prefill${TAG:-}.json" 2>&1 \
        | tee "$OUT/attention_prefill${TAG:-}.log" | tail -20 ;;
    prefill-tests) shift
      python3 -m pytest -q -p no:cacheprovider tests/test_paged_attention.py -k "prefill" \
        2>&1 | tee "$OUT/prefill_tests.log" | tail -15 ;;
    attn-splits) shift
      python3 bench/attention.py --splits 1,2,3,4,6,8 --json "$OUT/attention_splits.json" 2>&1 \
        | tee "$OUT/attention_splits.log" | tail -20 ;;
    ckpt-bg) ckpt=$2; shift 2
      (cd bench && python3 -c "from serve import write_preset as w; w('$ckpt', '${PRESET:-llama3-8b}')") > "$OUT/ckpt.log" 2>&1 &
      ckpt_pid=$! ;;
    serve) ckpt=$2; workloads=$3; shift 3; extra=()  # then optionally: fp8 (FP8 pages), static (the dense peer),
      tag=${workloads//,/_}                          # profile (CUPTI kernel table of (a)'s steps), staged
      [ -n "${ckpt_pid:-}" ] && { wait "$ckpt_pid"; cat "$OUT/ckpt.log"; ckpt_pid=; }  # (decode kernel), noprefill
      while [ $# -gt 0 ] && { [ "$1" = fp8 ] || [ "$1" = static ] || [ "$1" = profile ] || [ "$1" = engine ] || [ "$1" = staged ] || [ "$1" = noprefill ] || [ "$1" = nofusedwrite ] || [ "$1" = noprefix ] || [ "$1" = nocascade ] || [ "$1" = noprecompile ] || [ "$1" = host ]; }; do
        if [ "$1" = engine ]; then extra+=(--engine "$2"); shift 2; continue; fi  # engine [W:]K=V[,K=V]: W (b) again
        [ "$1" = fp8 ] && extra+=(--kv-cache-dtype fp8); [ "$1" = static ] && extra+=(--static-peer)
        [ "$1" = profile ] && extra+=(--profile "${PROFILE_WORKLOADS:-a}"); [ "$1" = staged ] && extra+=(--attention decode_variant=staged)
        [ "$1" = noprefill ] && extra+=(--attention prefill=xla); [ "$1" = nofusedwrite ] && extra+=(--attention decode=kernel)
        [ "$1" = noprefix ] && extra+=(--no-prefix-caching)  # LLM(enable_prefix_caching=False)
        [ "$1" = nocascade ] && extra+=(--attention cascade_group=0)  # decode rows read shared prefixes themselves
        [ "$1" = noprecompile ] && extra+=(--no-precompile)  # programs compile when first needed (A/B of one workload)
        [ "$1" = host ] && extra+=(--host-breakdown "${HOST_WORKLOADS:-c1024}")  # host ms per step by part
        tag+="_$1"; shift
      done
      tag+="${TAG:-}"  # TAG: a suffix telling A/B runs of one command apart (e.g. with NATIVE_DIR)
      pj=${PEER_JSON:-${peer_json:-}}; [ -n "$pj" ] && [ -f "$pj" ] && extra+=(--peer-json "$pj")  # ours/vLLM
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 bench/serve.py --checkpoint "$ckpt" --write-preset "${PRESET:-llama3-8b}" \
        --workloads "$workloads" "${extra[@]}" --json "$OUT/serve_$tag.json" 2>&1 | tee "$OUT/serve_$tag.log" | tail -30 ;;
    peer) ckpt=$2; workloads=$3; shift 3; tag=${workloads//,/_}; extra=()
      while [ $# -gt 0 ] && { [ "$1" = noprefix ] || [ "$1" = fp8 ]; }; do  # noprefix: prefix caching off
        [ "$1" = noprefix ] && extra+=(--no-prefix-caching); [ "$1" = fp8 ] && extra+=(--kv-cache-dtype fp8)
        tag+="_$1"; shift
      done
      [ -n "${ckpt_pid:-}" ] && { wait "$ckpt_pid"; cat "$OUT/ckpt.log"; ckpt_pid=; }
      [ -f "$ckpt/config.json" ] || (cd bench && python3 -c "from serve import write_preset as w; w('$ckpt', '${PRESET:-llama3-8b}')")
      peer_json=$OUT/vllm_$tag.json
      env -u PYTHONPATH python3 bench/peer_vllm_workloads.py --checkpoint "$ckpt" --workloads "$workloads" "${extra[@]}" \
        --json "$peer_json" 2>&1 | tee "$OUT/vllm_$tag.log" | tail -30 ;;
    peer-parts) shift  # then part numbers: each call carries .peer/bin and those .peer/pI (two 29 MiB parts fit one call)
      while [ $# -gt 0 ] && [[ "$1" =~ ^[0-9]+$ ]]; do bash .peer/bin/device_unpack.sh part "$1" | tail -1; shift; done ;;
    peer-finish) shift; bash .peer/bin/device_unpack.sh finish 2>&1 | tail -2 ;;  # carries .peer/bin and .peer/wheels
    serve-peer) server=$2; ckpt=$3; workload=$4; shift 4
      [ -n "${ckpt_pid:-}" ] && { wait "$ckpt_pid"; cat "$OUT/ckpt.log"; ckpt_pid=; }
      [ -f "$ckpt/config.json" ] || (cd bench && python3 -c "from serve import write_preset as w; w('$ckpt', '${PRESET:-llama3-8b}')")
      timeout "${SERVE_PEER_TIMEOUT:-560}" bash bench/serve_peer.sh "$server" "$ckpt" "$workload"
      cat "$OUT/cpu_${server}_$workload${TAG_SUFFIX:-}.txt" 2>/dev/null
      grep -E "tokens/s over" "$OUT/server_${server}_$workload${TAG_SUFFIX:-}.log" 2>/dev/null | tail -4 | cut -c1-400 ;;
    serve-http) ckpt=$2; shift 2; args=("$@"); shift $#
      [ -n "${ckpt_pid:-}" ] && { wait "$ckpt_pid"; cat "$OUT/ckpt.log"; ckpt_pid=; }
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 bench/http_load.py --checkpoint "$ckpt" --write-preset "${PRESET:-llama3-8b}" \
        --json "$OUT/serve_http.json" --server-log "$OUT/serve_http_server.log" "${args[@]}" \
        2>&1 | tee "$OUT/serve_http.log" | tail -30 ;;
    *) echo "unknown step $1"; exit 2 ;;
  esac
done
