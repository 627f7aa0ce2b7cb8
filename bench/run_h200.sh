#!/usr/bin/env bash
# run_h200.sh: everything measured on the GPU host in one go (the device tool's machine):
# doctor, the GPU tests, the drafter step against SpecForge's (flex_attention), and the whole
# pipeline at Qwen3.5-27B shapes. Expects the offline bundle (deploy/bundle.sh build
# --with-tests) in dist/ and the specforge wheel in .whl/. Prints a table at the end; full logs
# go to $OUT when set. Phases: step (default), tests (every GPU test), gdn, decode, generate, ops, moe, fp8,
# e2e 27b|27b-fp8|27b-fp8-recipe|27b-long|27b-long-fp8|27b-98k|27b-128k-fp8|8b|35b-a3b|35b-a3b-fp8|80b-a3b-fp8
# (bench/pipeline_MODEL.yaml).
set -uo pipefail
out="${OUT:-/tmp/dflashd-bench}"; mkdir -p "$out"
B="${B:-$(ls -d dist/dflashd-*/ | head -1)}"
T=$(python3 -c 'import os,torch;print(os.path.dirname(torch.__file__))')
export LD_LIBRARY_PATH="$B/lib:$T/lib:$T/../nvidia/cu13/lib:$T/../nvidia/nccl/lib"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# As deploy/systemd/dflashd@.service runs the daemon (the allocator setting included).
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}" 
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
phase="${1:-step}"
# Every test that needs a GPU, in every test binary of the bundle: the selection of
# tests/gpu_test_names_check.py (the tests named *Gpu* and the GatedDeltaNet kernel and NCCL
# suites, all of which skip without CUDA, so CI never runs them; CI checks that every GPU test is
# inside it), after transformers' FP8 checkpoint is written for
# Fp8.GpuTappedStatesMatchTransformersFp8.
gpu_tests() {
  timeout 200 python3 tests/reference/make_fp8_reference.py /tmp/fp8-ref > "$out/fp8_reference.txt" 2>&1
  local filter; filter=$(python3 tests/gpu_test_names_check.py --gtest-filter)
  for t in "$B"/tests/*_test; do
    DFLASHD_FP8_REFERENCE_DIR=/tmp/fp8-ref DFLASHD_BINARY="$B/bin/dflashd" timeout 300 "$t" \
      --gtest_filter="$filter" 2>&1 |
      grep -E "^\[ +(OK|FAILED|SKIPPED) |Failure|Expected|Which" > "$out/$(basename "$t")_gpu.txt"
  done
  echo "==== GPU tests"
  cat "$out"/*_gpu.txt | grep -cE "^\[ +OK" | sed 's/^/passed: /'
  cat "$out"/*_gpu.txt | grep -E "FAILED|SKIPPED" || true
}
if [ "$phase" = tests ]; then
  gpu_tests
elif [ "$phase" = ops ]; then
  # Operations (issue 20): the GPU tests, then what a 27B drafter checkpoint costs the drafter's
  # thread before and after the writer thread.
  gpu_tests
  DFLASHD_EXEC=checkpoint_bench "$B/bin/dflashd" /tmp/dflashd-checkpoint-bench 2>&1 | tee "$out/checkpoint_bench.txt"
  rm -rf /tmp/dflashd-checkpoint-bench
  tail -5 "$out/checkpoint_bench.txt"
elif [ "$phase" = fp8 ]; then
  # FP8 targets (issue 24): transformers' FP8 checkpoint and forward (the reference), the FP8 GPU
  # tests against it and against the CPU emulation, the 27B target forward in bf16 and FP8 (and
  # how far FP8's tapped states are), then the pipeline with an FP8 target.
  timeout 200 python3 tests/reference/make_fp8_reference.py /tmp/fp8-ref 2>&1 | grep -v -i "warn\|Loading weights" | tail -6 | tee "$out/fp8_reference.txt"
  DFLASHD_FP8_REFERENCE_DIR=/tmp/fp8-ref "$B/tests/target_test" --gtest_filter='Fp8.*:TargetRandom.*:TargetStages.*' > "$out/fp8_tests_full.txt" 2>&1
  grep -E "^\[ +(OK|FAILED|SKIPPED) |^layer " "$out/fp8_tests_full.txt" > "$out/fp8_tests.txt"
  grep -A4 "Failure" "$out/fp8_tests_full.txt" | grep -v "^2026" | head -40
  # The projection GEMMs alone: bf16, ATen's block-scaled _scaled_mm and every cuBLASLt algorithm
  # for the same product (gemm_bench), at a forward's 3072 rows and a decode step's 128.
  timeout 300 env DFLASHD_EXEC=gemm_bench "$B/bin/dflashd" ${GEMM_ROWS:-3072 128} 2>&1 | tee "$out/gemm_bench.txt"
  for cfg in ${FP8_CONFIGS:-qwen3_5-27b}; do
    timeout 300 env DFLASHD_EXEC=target_bench "$B/bin/dflashd" "bench/configs/$cfg" 2>&1 | tee "$out/target_bench_$cfg.txt"
  done
  [ -z "${SKIP_E2E:-}" ] && MEASURE_SECONDS="${MEASURE_SECONDS:-60}" SKIP_PYTHON=1 bash "$0" e2e 27b-fp8
  echo "==== fp8 summary"
  grep -cE "^\[ +OK" "$out/fp8_tests.txt" | sed 's/^/GPU tests passed: /'
  grep -E "FAILED|^layer " "$out/fp8_tests.txt" || true
  grep -hE "^target forward|FP8 vs bf16|^  (floor|grouped)" "$out"/target_bench_*.txt
  grep -hE "^\||fastest" "$out/gemm_bench.txt"
elif [ "$phase" = moe ]; then
  # MoE targets (issue 21): the MoE GPU tests, then the target forward of Qwen3.5-35B-A3B and one
  # MoE block of 35B-A3B, Qwen3-Next-80B-A3B and Qwen3.5-397B-A17B (whose weights do not fit one
  # GPU: the block only) against its floor. `run_h200.sh e2e 35b-a3b` puts dflashd beside Python.
  "$B/tests/moe_test" 2>&1 | grep -E "^\[ +(OK|FAILED|SKIPPED) |Failure|Expected|Which" | tee "$out/moe_tests.txt"
  "$B/tests/target_test" --gtest_filter='TargetRandom.*:GatedDeltaNetKernels.WholeTargetMatchesTheReferencePath' 2>&1 | grep -E "^\[ +(OK|FAILED|SKIPPED) |Failure|Expected|Which" | tee -a "$out/moe_tests.txt"
  for c in qwen3_5-35b-a3b:auto qwen3-next-80b-a3b:-1 qwen3_5-397b-a17b:-1; do
    cfg="${c%%:*}" last="${c##*:}"
    [ "$last" = auto ] && last=""
    DFLASHD_EXEC=target_bench "$B/bin/dflashd" "bench/configs/$cfg" $last 2>&1 | tee "$out/target_bench_$cfg.txt"
  done
  echo "==== moe summary"
  grep -cE "^\[ +OK" "$out/moe_tests.txt" | sed 's/^/GPU tests passed: /'
  grep -E "FAILED" "$out/moe_tests.txt" || true
  grep -hE "^target forward|^one MoE|grouped|reference|floor" "$out"/target_bench_*.txt
elif [ "$phase" = decode ]; then
  # Speculative decoding (issue 23): a verify step, a plain decode step, the drafter's block, and
  # plain against speculative decoding end to end, at 27B (and 35B-A3B) shapes, random weights
  # (DECODE_STATE_DTYPE=bfloat16: the GatedDeltaNet states bf16 between steps).
  # First one step's GatedDeltaNet state update alone against a copy of its bytes (gdn_bench decode).
  timeout 120 env DFLASHD_EXEC=gdn_bench "$B/bin/dflashd" bench/configs/qwen3_5-27b decode 2>&1 | tee "$out/gdn_decode.txt"
  for cfg in ${DECODE_CONFIGS:-qwen3_5-27b}; do
    timeout 400 env DFLASHD_EXEC=decode_bench "$B/bin/dflashd" "bench/configs/$cfg" ${DECODE_ARGS:-4 64 512} 2>&1 | tee "$out/decode_bench_$cfg.txt"
  done
  echo "==== decode summary"
  grep -hE "^decode step" "$out/gdn_decode.txt"
  grep -hE "step|drafter block|tok/s|64 prompts|choosing" "$out"/decode_bench_*.txt
elif [ "$phase" = generate ]; then
  # Regenerating responses (issue 26): dflashd generate at 27B shapes (random weights) with 64 and
  # 128 sequences at once (GENERATE_DTYPE=float8: the target's projections FP8;
  # GENERATE_STATE_DTYPE=bfloat16: its GatedDeltaNet states bf16 between steps; GENERATE_ARGS: more
  # options, e.g. "--temperature 0.7 --top-p 0.95" for sampled decoding), then
  # transformers' batched generate on the same prompts (SKIP_PYTHON=1: not). Goal: >= 50 %
  # of the weight-read floor (about 54 GB of bf16 weights per step at 4.8 TB/s: 11.6K tok/s at 128).
  cfg="bench/configs/${GENERATE_CONFIG:-qwen3_5-27b}"
  new="${GENERATE_NEW_TOKENS:-256}"
  python3 -c "import json,random; random.seed(1); [print(json.dumps({'input_ids': [random.randrange(1000, 100000) for _ in range(512)]})) for _ in range(256)]" > /tmp/prompts.jsonl
  for batch in ${GENERATE_BATCHES:-64 128}; do
    rm -rf "/tmp/generate-$batch"
    /usr/bin/time -f "wall %e s" timeout 300 "$B/bin/dflashd" generate --target "$cfg" --random-weights --prompts /tmp/prompts.jsonl \
      --out "/tmp/generate-$batch" --max-new-tokens "$new" --max-batch "$batch" --truncated keep --log-every 10 ${GENERATE_DTYPE:+--dtype "$GENERATE_DTYPE"} \
      ${GENERATE_STATE_DTYPE:+--state-dtype "$GENERATE_STATE_DTYPE"} ${GENERATE_ARGS:-} \
      > "$out/generate_$batch.log" 2>&1
    grep -E "generate: .*(tok|finished|stopped)|wall|error" "$out/generate_$batch.log" | tail -3
  done
  [ -z "${SKIP_PYTHON:-}" ] && timeout 300 python3 bench/python/hf_generate.py "$cfg" /tmp/prompts.jsonl "$new" ${GENERATE_BATCHES:-64 128} 2>&1 \
    | grep -E "^python|Error" | tee "$out/python_generate.txt"
  echo "==== generate summary"
  grep -hE "finished this run|new tokens/s" "$out"/generate_*.log | tail -4
  cat "$out/python_generate.txt" 2>/dev/null
elif [ "$phase" = step ]; then
  "$B/bin/dflashd" doctor | tee "$out/doctor.txt"
  "$B/tests/drafter_test" --gtest_filter='BlockAttention.*' 2>&1 | grep -E "OK|FAILED|Failure|Expected|Which|rel|grad" | tee "$out/gpu_tests.txt"
  timeout 200 env DFLASHD_EXEC=drafter_step_bench "$B/bin/dflashd" 5 2>&1 | tee "$out/drafter_step.txt"
  timeout 240 python3 bench/python/specforge_step.py 5 2>&1 | grep -v Warning | tail -3 | tee "$out/specforge_step.txt"
  timeout 240 python3 bench/python/flex_block_attention.py 2>&1 | grep -v Warning | tail -2 | tee "$out/flex_attention.txt"
  echo "==== summary"
  grep -E "forward\+|AdamW|peak|block attention" "$out/drafter_step.txt"
  tail -1 "$out/specforge_step.txt"
  tail -1 "$out/flex_attention.txt"
elif [ "$phase" = gdn ]; then
  # GatedDeltaNet kernels: GPU correctness tests, then ours and the Python peers on the same GPU.
  "$B/tests/target_test" --gtest_filter='GatedDeltaNetKernels.*:TargetRandom.*' 2>&1 | grep -E "OK|FAILED|Failure|error|Expected|Which|rel" | tee "$out/gpu_tests.txt"
  timeout 300 env DFLASHD_EXEC=gdn_bench "$B/bin/dflashd" bench/configs/qwen3_5-27b 2>&1 | tee "$out/gdn_bench.txt"
  timeout 240 python3 bench/python/gdn_peers.py 2>&1 | grep -v -i warn | tee "$out/gdn_peers.txt"
elif [ "$phase" = e2e ]; then
  # End to end (issue 8): dflashd's pipeline, then the Python reference pipeline (transformers
  # target + SpecForge DFlash step) with FLA's kernels and, for GatedDeltaNet targets, without
  # them; same GPU, one after the other. Usage: run_h200.sh e2e 27b|27b-concurrent|8b; SKIP_PYTHON=1
  # measures dflashd alone, SKIP_NOFLA=1 skips the run without FLA.
  model="${2:-27b}"
  cfg="bench/pipeline_$model.yaml"
  config_dir="$(grep -o 'path: [^,}]*' "$cfg" | head -1 | cut -d' ' -f2)"
  log="$out/pipeline_$model.log"
  "$B/bin/dflashd" run -c "$cfg" > "$log" 2>&1 &
  # START_SECONDS: how long the first step may take (loading, random weights drawn): 180 s.
  for i in $(seq $(( ${START_SECONDS:-180} / 2 ))); do sleep 2; grep -qE "step [1-9][0-9]*/" "$log" 2>/dev/null && break; done
  sleep "${MEASURE_SECONDS:-100}"
  curl -s localhost:9400/metrics | grep -E '^dflashd_(tokens_per_second|mfu_ratio|optimizer_steps_total|gpu_memory_bytes|gpu_allocator_retries_total|queue_depth|bottleneck|stage_seconds_total)' > "$out/metrics_$model.txt"
  grep -E "ms per sequence" "$log" | tail -1 > "$out/stages_$model.txt"
  pkill -KILL -f "libexec/dflashd run" ; wait
  grep -E "error|refus|plan:" "$log" | head -5
  if [ -n "${SKIP_PYTHON:-}" ]; then grep -E "tokens_per_second|mfu_ratio|gpu_memory_bytes" "$out/metrics_$model.txt"; cat "$out/stages_$model.txt"; exit 0; fi
  mkdir -p /tmp/site_nofla
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site_nofla .whl/specforge-*.whl
  PYTHONPATH=/tmp/site timeout 240 python3 bench/python/reference_pipeline.py "$config_dir" with-fla 5 2>&1 | grep -E "^python|Error|error" | tee "$out/python_$model.txt"
  if [ "$model" = 27b ] && [ -z "${SKIP_NOFLA:-}" ]; then
    PYTHONPATH=/tmp/site_nofla timeout 240 python3 bench/python/reference_pipeline.py "$config_dir" without-fla 5 2>&1 | grep -E "^python|Error|error" | tee -a "$out/python_$model.txt"
  fi
  echo "==== $model summary"
  grep -E "tokens_per_second|mfu_ratio|optimizer_steps|gpu_memory_bytes.*allocated" "$out/metrics_$model.txt"
  cat "$out/stages_$model.txt" "$out/python_$model.txt"
else
  (timeout 400 "$B/bin/dflashd" run -c bench/pipeline_27b.yaml > "$out/pipeline.log" 2>&1; echo "exit $?" >> "$out/pipeline.log") &
  for i in $(seq 60); do sleep 5; grep -qE "step [1-9][0-9]*/" "$out/pipeline.log" 2>/dev/null && break; done
  sleep 100
  curl -s localhost:9400/metrics | grep -E '^dflashd_(tokens_per_second|mfu_ratio|optimizer_steps_total|loss|expected_acceptance|gpu_memory_bytes|queue_depth|queue_consumer|queue_producer|bottleneck|suggested|eta)' | tee "$out/pipeline_metrics.txt"
  wait
  grep -E "step |plan:|exit|error|refus|checkpoint|resum|data:" "$out/pipeline.log" | tail -12
fi
