#!/usr/bin/env bash
# One device call that re-measures everything docs/perf.md reports, each stage under its own time limit.
# Run from the repo root on the GPU machine, with the fixtures copied to .gpu/ (carry it):
#   mkdir -p .gpu && cp -r ../shared/fixtures/hf .gpu/fixtures && cp -r ../shared/models/stories260K .gpu/
#   run(command="bash tools/gpu_session.sh kernels", carry=[".gpu"])   # ~4 min
#   run(command="bash tools/gpu_session.sh bench", carry=[".gpu"])     # ~6 min
# Logs go to $OUT (or ./out).
set -u
out=${OUT:-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install --no-deps --no-build-isolation -e . -q 2>&1 | grep -v WARN | tail -1
# llama3-8b end to end 256 x 512 -> 128 per weight format in QUANT_FORMATS (default "none fp8"; a format ending in
# +kv8 also runs the fp8 KV cache) and per XLA command-buffer update mode in UPDATE_MODES (default: XLA's own, no
# flag); E2E_ARGS adds bench args; E2E_TIMEOUT s per process (default 280; a cold fp8+kv8 compile of the 13 widths
# takes longer). --batch sets max_seqs: it must be 256 (--batch 1 served the 256 requests one at a time). A process
# past its time (rc=124) has its stacks taken (`within`, below), then dumps Python's (SIGABRT, faulthandler; no core).
# XLA_PYTHON_CLIENT_ALLOCATOR and TUNING (pallas_kernels/tuning.py values, tools/with_tuning.py), when set, are named
# in the log's file name.
quant_e2e() {
  local q mode start kv alloc tuned log
  ulimit -c 0
  for q in ${QUANT_FORMATS:-none fp8}; do
    for mode in ${UPDATE_MODES:-default}; do
      [[ $mode == default ]] && mode=
      start=$(date +%s)
      kv=auto; [[ $q == *+kv8 ]] && kv=fp8
      alloc=${XLA_PYTHON_CLIENT_ALLOCATOR:-}
      tuned=${TUNING:-}; tuned=${tuned//[^A-Za-z0-9]/_}
      # no '+' in file names: the device tool drops them
      log=$out/quant_e2e_${q//+/_}${mode:+_$mode}${alloc:+_$alloc}${tuned:+_$tuned}${E2E_TAG:+_$E2E_TAG}
      XLA_FLAGS="${XLA_FLAGS:-}${mode:+ --xla_gpu_command_buffer_update_mode=$mode}" PYTHONFAULTHANDLER=1 \
        python3 tools/with_tuning.py -m glint.runtime.cli bench llama3-8b --quantize ${q%+kv8} \
        --kv-cache-dtype $kv --batch 256 --prompt-len 512 --gen-len 128 --requests 256 --e2e-gen-len 128 \
        --repeats 2 ${E2E_ARGS:-} --json "$log.json" > "$log.log" 2>&1 &
      within ${E2E_TIMEOUT:-280} $! "$log.stall.txt"
      echo "== $q ${mode:-} ${alloc:-} ${TUNING:-} rc=$? $(( $(date +%s) - start )) s"
      grep -E "roofline|KV pages|Error|^Thread|^Current thread|^  File" "$log.log" | head -12; tail -12 "$log.log"
    done
  done
}

# Waits up to $1 s for process $2. One still running then has its threads' native and Python stacks (py-spy, a
# static binary carried in .gpu/bin: python3 -m pip download py-spy==0.4.1 and unzip its wheel), their CPU and the
# GPU's load written to $3, and is aborted (killed 10 s later if SIGABRT did not end it). Returns the process's
# status, 124 when it was stopped. $1 is whole seconds.
within() {
  local t
  [[ $1 =~ ^[0-9]+$ ]] || { echo "within: '$1' is not whole seconds" >&2; kill $2; wait $2; return 2; }
  for ((t = 0; t < $1; t++)); do kill -0 $2 2>/dev/null || break; sleep 1; done
  if kill -0 $2 2>/dev/null; then
    { date; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv; ps -L -o tid,pcpu,stat,wchan:30,comm -p $2
      timeout 60 .gpu/bin/py-spy dump --native --pid $2; nvidia-smi --query-gpu=utilization.gpu --format=csv; } > "$3" 2>&1
    kill -ABRT $2
    for ((t = 0; t < 10; t++)); do kill -0 $2 2>/dev/null || break; sleep 1; done
    kill -KILL $2 2>/dev/null; wait $2; return 124
  fi
  wait $2
}

case "${1:-all}" in
  kernels|all)
    timeout 150 python3 tools/gpu_engine.py .gpu/fixtures .gpu/stories260K > "$out/parity.log" 2>&1
    tail -14 "$out/parity.log"
    # sweep, then glint / cuDNN / jnp timing; SWEEP_ARGS narrows the sweep (e.g. --variants default,mosaic)
    timeout 330 python3 tools/gpu_kernels.py ${SWEEP_ARGS:-} > "$out/kernels.log" 2>&1
    grep -cE "^PASS" "$out/kernels.log"; grep -E "^(FAIL|ERROR)" "$out/kernels.log"
    timeout 60 python3 tools/torch_varlen_peer.py > "$out/torch_varlen.log" 2>&1  # same call as the table
    sed -n '/^DECODE (q_len/,$p' "$out/kernels.log" | grep -v "^PASS"; cat "$out/torch_varlen.log"
    ;;&
  bench|all)
    timeout 200 python3 tools/hf_peer.py --requests 256 --prompt-len 512 --gen-len 128 > "$out/peer.jsonl" \
      2> "$out/peer.err"
    timeout 300 python3 -m glint.runtime.cli bench llama3-8b --batch 1,8,32,64,128,256 --prompt-len 512 \
      --gen-len 256 --requests 256 --e2e-gen-len 128 --repeats 5 --peer-json "$out/peer.jsonl" \
      --json "$out/bench.json" > "$out/bench.log" 2>&1
    tail -45 "$out/bench.log"
    ;;
  export)  # exported artifacts == live engine through the Pallas kernels; llama3-8b cold start (~9 min)
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 220 python3 tools/gpu_export.py .gpu/fixtures .gpu/stories260K > "$out/export_parity.log" 2>&1
    tail -9 "$out/export_parity.log"
    timeout 340 python3 -m glint.runtime.cli bench llama3-8b --cold-start --batch 1,256 --prompt-len 512 \
      --gen-len 256 --workdir /tmp --json "$out/cold_llama3.json" > "$out/cold_llama3.log" 2>&1
    tail -14 "$out/cold_llama3.log"
    ;;
  cold-artifact)  # llama3-8b from its exported artifact only, twice (~4 min: the export compiles everything)
    timeout 500 python3 -m glint.runtime.cli bench llama3-8b --cold-start --ways artifact,artifact-again \
      --batch 1,256 --prompt-len 512 --gen-len 256 --workdir /tmp --json "$out/cold_artifact.json" \
      > "$out/cold_artifact.log" 2>&1
    tail -14 "$out/cold_artifact.log"
    ;;
  quant)  # llama3-8b decode per weight format (QUANT_FORMATS, default "none int8 int4 fp8"), one process each
    for q in ${QUANT_FORMATS:-none int8 int4 fp8}; do  # ~2.5 min each
      start=$(date +%s)
      timeout 250 python3 -m glint.runtime.cli bench llama3-8b --quantize $q --batch 1,8,64 --contexts 512 \
        --requests 0 --max-step-tokens 256 --repeats 5 --json "$out/quant_$q.json" > "$out/quant_$q.log" 2>&1
      echo "== $q: $(( $(date +%s) - start )) s"
      grep -E "roofline|Error" "$out/quant_$q.log" | head -2; sed -n '/decode (one token/,$p' "$out/quant_$q.log"
    done
    ;;
  quant-e2e)  # llama3-8b end to end per weight format (quant_e2e above: QUANT_FORMATS, UPDATE_MODES, E2E_ARGS, ...)
    quant_e2e
    ;;
  launch)  # the host's launch of a step: batch-256 decode, bf16 and fp8 weights + fp8 KV (~3 min; LAUNCH_ARGS adds
           # e.g. "--batch 1 --context 512"; TF_CPP_VMODULE=command_buffer_thunk=3 logs XLA's graph updates)
    for q in "" "--quantize fp8 --kv-cache-dtype fp8"; do
      name=launch_${q:+fp8}; name=${name%_}
      timeout 200 python3 tools/gpu_launch.py $q ${LAUNCH_ARGS:-} --trace "$out/${name}_trace" > "$out/$name.log" 2>&1
      grep -E "^(loop|forward launch)|command_buffer|cuGraphLaunch|GPU kernels|Error" "$out/$name.log" | head -12
    done
    ;;
  launch-thread)  # each step launched from the engine's launch thread (the default) against in step() itself
                  # (--sync-launch), one process each: end to end per format in QUANT_FORMATS (quant_e2e; a cold
                  # compile takes the first arm up to E2E_TIMEOUT), then the batch-256 loop (tools/gpu_launch.py,
                  # bf16 and fp8 + fp8 KV) and batch 1 x 512 (int4, bf16). One call each (~8 min): LAUNCH_PARTS=e2e
                  # QUANT_FORMATS=none; LAUNCH_PARTS=e2e QUANT_FORMATS=fp8; LAUNCH_PARTS=loop256; LAUNCH_PARTS=loop1
    if [[ " ${LAUNCH_PARTS:-e2e} " == *" e2e "* ]]; then
      for arm in async sync; do
        flag=; [ $arm = sync ] && flag=" --sync-launch"
        E2E_TAG=$arm E2E_ARGS="${E2E_ARGS:-}$flag" E2E_TIMEOUT=${E2E_TIMEOUT:-280} quant_e2e
      done
    fi
    cases=()
    [[ " ${LAUNCH_PARTS:-e2e} " == *" loop256 "* ]] && cases+=("" "--quantize fp8 --kv-cache-dtype fp8")
    [[ " ${LAUNCH_PARTS:-e2e} " == *" loop1 "* ]] && cases+=("--quantize int4 --batch 1 --context 512" "--batch 1 --context 512")
    if (( ${#cases[@]} )); then
      for q in "${cases[@]}"; do
        for arm in async sync; do
          name=launch_thread_$(printf %s "${q:-bf16}" | tr -c 'a-z0-9' _ | tr -s _ | sed 's/^_//')_$arm
          flag=; [ $arm = sync ] && flag=--sync-launch
          timeout 120 python3 tools/gpu_launch.py $q $flag > "$out/$name.log" 2>&1
          echo "== $arm ${q:-bf16} rc=$?"; grep -E "^(loop|forward launch)|Error|error:" "$out/$name.log" | head -4
        done
      done
    fi
    ;;
  graph-update)  # what would keep XLA from re-recording a step's graph every call (docs/perf.md, "SKIP_TEMP settled"):
                 # tools/gpu_launch.py, int8 at batch 1 x 512 keys and fp8 + fp8 KV at 256 x 576, under XLA's
                 # default, the temporaries in a colour of their own, the cuda_async allocator (~5 min; GRAPH_ARMS
                 # picks, e.g. "default vmm address")
    so=$(python3 -c "import os, jax_plugins.xla_cuda13 as p; print(os.path.dirname(p.__file__))")/xla_cuda_plugin.so
    echo "VMM allocator with the deferred-free batches (upstream July 2026): $(grep -a -c 'Deferred deallocation batch' "$so")"
    for arm in ${GRAPH_ARMS:-default separate-color cuda-async}; do
      case $arm in
        default) env=() ;;
        separate-color) env=(XLA_FLAGS=--xla_gpu_temp_buffer_use_separate_color=true) ;;
        cuda-async) env=(XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async) ;;
        vmm|address) env=(XLA_PYTHON_CLIENT_ALLOCATOR=$arm) ;;  # jaxlib 0.11.2's other allocators, not yet tried
      esac
      for q in "--quantize int8 --batch 1 --context 512" "--quantize fp8 --kv-cache-dtype fp8"; do
        name=graph_${arm}_$(echo $q | cut -d' ' -f2)
        env "${env[@]}" timeout 150 python3 tools/gpu_launch.py $q > "$out/$name.log" 2>&1
        echo "== $arm $q rc=$?"; grep -E "^(loop|forward launch)|Error|error:" "$out/$name.log" | head -4
      done
    done
    ;;
  while-probe)  # does a fori_loop of decode-sized GEMVs run as one CUDA graph? XLA's default command-buffer types,
                 # then with WHILE and CONDITIONAL added (~1 min)
    for flags in "" "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"; do
      XLA_FLAGS=$flags timeout 200 python3 tools/gpu_while_probe.py > "$out/while_probe_${flags:+while}.log" 2>&1
      echo "== XLA_FLAGS=$flags"; grep -E "^K=|Error" "$out/while_probe_${flags:+while}.log"
    done
    ;;
  allocator)  # XLA's BFC allocator (its default) against cuda_async (cudaMallocAsync): what each reports as memory,
              # then per format in ALLOC_FORMATS (default fp8+kv8) quant-e2e at two widths (cuda_async first;
              # ALLOC_E2E_ARGS adds bench args, e.g. "--num-pages 20000"), then batch-1 decode per format in ALLOC_B1
              # (default "int8 none"); one process each (~5 min with one cold fp8 compile). An empty ALLOC_FORMATS or
              # ALLOC_B1 skips that part.
    for alloc in cuda_async bfc; do
      ( export XLA_PYTHON_CLIENT_ALLOCATOR=$alloc
        python3 -c "import jax; from glint.kvcache.state import free_device_bytes
s = jax.devices()[0].memory_stats() or {}
print('$alloc', {k: s.get(k) for k in ('bytes_limit', 'bytes_in_use')}, 'free_device_bytes', free_device_bytes())" \
          > "$out/memory_$alloc.log" 2>&1 || echo "$alloc: the memory probe failed (memory_$alloc.log)"
        grep "^$alloc" "$out/memory_$alloc.log" )
    done
    for q in ${ALLOC_FORMATS-fp8+kv8}; do
      for alloc in cuda_async bfc; do
        ( export XLA_PYTHON_CLIENT_ALLOCATOR=$alloc
          QUANT_FORMATS=$q E2E_TIMEOUT=${E2E_TIMEOUT:-250} \
            E2E_ARGS="--forward-sizes 256,4096 --max-step-tokens 4096 ${ALLOC_E2E_ARGS:-}" quant_e2e \
            | grep -E "^==|KV pages|output tok|steps by|host per step" )
      done
    done
    for q in ${ALLOC_B1-int8 none}; do
      for alloc in cuda_async bfc; do
        ( export XLA_PYTHON_CLIENT_ALLOCATOR=$alloc
          log=$out/b1_${q}_$alloc.log
          timeout 100 python3 -m glint.runtime.cli bench llama3-8b --quantize $q --batch 1 --contexts 512 --requests 0 \
            --forward-sizes 1 --max-step-tokens 16 --repeats 5 --json "${log%.log}.json" > "$log" 2>&1
          echo "== batch 1 $q $alloc rc=$?"; grep -B1 -A4 "┃ batch ┃ ctx ┃       ms" "$log" | grep "│"
          grep -A1 "the loop at batch 1" "$log" | head -2 )
      done
    done
    ;;
  skip-temp)  # quant-e2e at two widths, XLA's default command-buffer updates against SKIP_TEMP, bf16 and fp8 + fp8
              # KV (~6 min cold; SKIP_TEMP_ARGS adds bench args, e.g. "--num-pages 20000"; an fp8 process with no
              # compilation cache takes 125-140 s, most of it compiling the width-4096 program)
    QUANT_FORMATS="none fp8+kv8" UPDATE_MODES="ALWAYS_UPDATE SKIP_TEMP" E2E_TIMEOUT=${SKIP_TEMP_TIMEOUT:-250} \
      E2E_ARGS="--forward-sizes 256,4096 --max-step-tokens 4096 ${SKIP_TEMP_ARGS:-}" quant_e2e
    ;;
  fp8-kv)  # decode attention over bf16 and fp8 KV pools, 64 x 4096 (~1 min; FP8_KV_ARGS="256 640 --sweep" etc.)
    timeout 260 python3 tools/gpu_fp8_kv.py ${FP8_KV_ARGS:-64 4096} > "$out/fp8_kv.log" 2>&1
    grep -v cuda_timer "$out/fp8_kv.log" | grep -E "\||faster"
    ;;
  fp8-kv-mosaic)  # the same pools through the Triton and the Mosaic decode kernels, pages of 32 (a scaled cache's
                 # Mosaic path needs them), the Mosaic kernel at four tiles (gpu_fp8_kv.MOSAIC_TILES), 64 x 4096
                 # and 8 x 1024 (~5 min)
    for shape in ${FP8_KV_SHAPES:-64x4096 8x1024}; do  # BATCHxCONTEXT
      timeout 260 python3 tools/gpu_fp8_kv.py ${shape/x/ } --mosaic --page=32 > "$out/fp8_kv_mosaic_$shape.log" 2>&1
      grep -v cuda_timer "$out/fp8_kv_mosaic_$shape.log" | grep -E "\||faster|Error"
    done
    ;;
  quant-kernels)  # quantized matmuls at llama3-8b's shapes, M = 1, 8, 64: Mosaic int8 and int4 configs, XLA int8 /
                 # int4 / fp8, bf16 (~6 min before the int4 configs; give QUANT_ARGS --ways or --rows to fit 560 s)
    timeout 560 python3 tools/gpu_quant_kernels.py ${QUANT_ARGS:-} > "$out/quant_kernels.log" 2>&1
    sed -n '/^linear |/,$p' "$out/quant_kernels.log"; grep -E "^FAIL|Traceback" "$out/quant_kernels.log" | head -5
    ;;
  cold-glimmer-artifact)  # muse-glimmer-30b from its artifact: 60 GB of weights need the x2 kind's 128 GB disk
    timeout 580 python3 -m glint.runtime.cli bench muse-glimmer-30b --cold-start --ways artifact --batch 1,64 \
      --prompt-len 512 --gen-len 256 --workdir /tmp --json "$out/cold_glimmer_artifact.json" \
      > "$out/cold_glimmer_artifact.log" 2>&1
    tail -12 "$out/cold_glimmer_artifact.log"; df -h /tmp | tail -1
    ;;
  cold-glimmer)  # muse-glimmer-30b: no cache, then warm (its artifact's 60 GB of weights would not fit the disk)
    timeout 560 python3 -m glint.runtime.cli bench muse-glimmer-30b --cold-start --ways no-cache,warm \
      --batch 1,64 --prompt-len 512 --gen-len 256 --workdir /tmp --json "$out/cold_glimmer.json" \
      > "$out/cold_glimmer.log" 2>&1
    tail -14 "$out/cold_glimmer.log"
    ;;
  serve)  # glint serve + the load generator (~3 min); the server's packages ride in .gpu/pylib (no registry there):
    #   python3 -m pip install --target .gpu/pylib fastapi==0.163.2 uvicorn==0.54.0 prometheus-client==0.26.0 jinja2==3.1.6
    PYTHONPATH=$PWD/.gpu/pylib python3 -m glint.runtime.cli serve llama3-8b --max-seqs 256 --capacity 1024 \
      > "$out/serve.log" 2>&1 &
    server=$!
    for _ in $(seq 300); do grep -q "glint: serving" "$out/serve.log" && break; kill -0 $server || break; sleep 1; done
    tail -3 "$out/serve.log"
    timeout 150 python3 -m glint.runtime.cli bench llama3-8b --server http://127.0.0.1:8000 --requests 256 \
      --concurrency 256 --prompt-len 512 --gen-len 128 --json "$out/serve_bench.json" > "$out/serve_bench.log" 2>&1
    tail -20 "$out/serve_bench.log"
    kill $server; wait $server
    ;;&
  serve-load)  # the same 256 x 512 -> 128 in process and over HTTP, one engine (tools/serve_load.py, ~6 min; the
    #   server's packages ride in .gpu/pylib as for `serve`, with httpx==0.28.1 for the load generator)
    PYTHONPATH=$PWD/.gpu/pylib timeout 540 python3 tools/serve_load.py llama3-8b --requests 256 --prompt-len 512 \
      --gen-len 128 ${SERVE_LOAD_ARGS:-} > "$out/serve_load.log" 2>&1
    echo "serve-load rc=$?"; grep -E "^(in process|over HTTP|llama)|Error" "$out/serve_load.log" | tail -8
    ;;&
  prefix)  # prefix cache on and off: 256 requests sharing a 2,048-token system prompt, and sharing nothing (~4 min)
    timeout 330 python3 -m glint.runtime.cli bench llama3-8b --shared-prefix 2048 --prompt-len 128 --gen-len 128 \
      --requests 256 --batch 256 --json "$out/prefix.json" > "$out/prefix.log" 2>&1
    tail -12 "$out/prefix.log"
    ;;&
  prefix-check)  # prefix cache on == off through the kernels: fixtures and stories260K in float32, stories in bf16
    timeout 240 python3 tools/gpu_prefix.py .gpu/fixtures .gpu/stories260K > "$out/prefix_check.log" 2>&1
    sed -n '/^check |/,$p' "$out/prefix_check.log"; grep -E "Error|Traceback" "$out/prefix_check.log" | tail -3
    ;;&
  prefix|artifact-load|prefix-check)  # where an artifact's load time goes, at the cold-start bench's geometry (~4 min)
    timeout 260 python3 tools/gpu_artifact_load.py --bench-geometry > "$out/artifact_load.log" 2>&1
    cat "$out/artifact_load.log"
    ;;
  spec)  # speculative decoding through the Pallas kernels == the references (~2 min; cp -r ../shared/fixtures/dflash .gpu/)
    timeout 300 python3 tools/gpu_spec.py .gpu/fixtures .gpu/stories260K .gpu/dflash ${SPEC_CHECK_ARGS:-} \
      > "$out/spec_check.log" 2>&1
    sed -n '/^check |/,$p' "$out/spec_check.log"; grep -E "Error|Traceback" "$out/spec_check.log" | tail -3
    ;;&
  spec|serve)  # plain vs speculative decoding, oracle drafter, block 16 (~5 min)
    timeout 330 python3 -m glint.runtime.cli bench llama3-8b --draft oracle --num-speculative-tokens 15 \
      --batch ${SPEC_BATCH:-1,4,16,64} --prompt-len 512 --gen-len 256 --max-step-tokens 1024 \
      --json "$out/spec.json" > "$out/spec.log" 2>&1
    tail -14 "$out/spec.log"
    ;;
  spec-ngram)  # prompt lookup: llama3-8b on random and on self-quoting prompts, stories260K (trained) (~5 min)
    for q in 1 4; do
      timeout 150 python3 -m glint.runtime.cli bench llama3-8b --draft ngram --num-speculative-tokens 4 --batch 1,16 \
        --prompt-len 512 --gen-len 256 --quote $q --max-step-tokens 1024 --json "$out/ngram_q$q.json" \
        > "$out/ngram_q$q.log" 2>&1
      tail -9 "$out/ngram_q$q.log"
    done
    timeout 100 python3 -m glint.runtime.cli bench .gpu/stories260K --dtype float32 --draft ngram \
      --num-speculative-tokens 4 --batch 1,16 --prompt-len 2 --gen-len 200 --json "$out/ngram_stories.json" \
      > "$out/ngram_stories.log" 2>&1
    tail -9 "$out/ngram_stories.log"
    ;;
  dflash-time)  # DFlash of Qwen3-8B-DFlash-b16's shape, random weights, on qwen3-8b: draft + verify per step
    timeout 300 python3 -m glint.runtime.cli bench qwen3-8b --draft dflash-random --batch ${SPEC_BATCH:-1,4,16,64} \
      --prompt-len 512 --gen-len 128 --max-step-tokens 1024 --json "$out/dflash.json" > "$out/dflash.log" 2>&1
    tail -12 "$out/dflash.log"
    ;;
  fp8-mlp)  # the fp8 MLP middle in one kernel (pallas_kernels/gated_fp8.py): its tests compiled, then llama3-8b's
            # width-4096 step (8 x 512) bf16, fp8, fp8 + the kernel (GATED_TUNING adds tiles etc.), one process each
    XLA_PYTHON_CLIENT_PREALLOCATE=false GLINT_TEST_GPU=1 GLINT_HF_FIXTURES=$PWD/.gpu/fixtures \
      GLINT_STORIES=$PWD/.gpu/stories260K timeout 150 python3 -m pytest -q -p no:cacheprovider -n 4 \
      tests/test_quant.py -k "gated_fp8 or fp8_matmul" > "$out/fp8_mlp_tests.log" 2>&1
    tail -1 "$out/fp8_mlp_tests.log"; grep -E "^(FAILED|ERROR)" "$out/fp8_mlp_tests.log"
    for arm in bf16 fp8 fused; do
      case $arm in
        bf16) q=none; t= ;;
        fp8) q=fp8; t=FP8_GEMM_OUT=bfloat16 ;;
        fused) q=fp8; t=FP8_GEMM_OUT=bfloat16,FP8_GATED_KERNEL=1${GATED_TUNING:+,$GATED_TUNING} ;;
      esac
      PROFILE_QUANTIZE=$q TUNING=$t GLINT_CACHE_DIR=$(mktemp -d) timeout 200 python3 tools/with_tuning.py \
        tools/gpu_step_profile.py "$out/step_$arm" --batch 8 --q-len 512 > "$out/step_$arm.log" 2>&1
      echo "== $arm"; grep -E "^(step_ms_alone|us_per_step_by_kind|gpu_busy)" "$out/step_$arm.log"
      grep -E "gated|fusion_3[14]'" "$out/step_$arm.log" | head -3
      rm -rf "$out/step_$arm/trace"
    done
    ;;
  decode-mgpu)  # the Mosaic decode kernel against Triton and cuDNN, every shape and tile variant (~8 min;
                # DECODE_MGPU_ARGS: "--iters N" and/or shapes, see the tool)
    timeout ${DECODE_MGPU_TIMEOUT:-540} python3 tools/gpu_decode_mgpu.py ${DECODE_MGPU_ARGS:-} \
      > "$out/decode_mgpu.log" 2>&1
    echo "== decode_mgpu rc=$?"; cat "$out/decode_mgpu.log"
    ;;
  mosaic-sweep)  # both Mosaic attention kernels (prefill, decode) compiled, on the attention sweep's cases, fp8 too
                # (~3 min)
    timeout ${SWEEP_TIMEOUT:-300} python3 tools/gpu_kernels.py --skip-timing \
      --variants mosaic,mosaic_decode,triton_fp8,mosaic_decode_fp8,triton_fp8s,mosaic_decode_fp8s \
      > "$out/mosaic_sweep.log" 2>&1
    echo "== sweep rc=$?"; grep -E "^(PASS|FAIL|ERROR|sweep)" "$out/mosaic_sweep.log"
    ;;
  prefill-layers)  # the Mosaic prefill kernel against Triton on ring, window and soft-cap layers (~3 min;
                   # PREFILL_LAYERS_ARGS: "--iters N")
    timeout ${PREFILL_LAYERS_TIMEOUT:-300} python3 tools/gpu_prefill_layers.py ${PREFILL_LAYERS_ARGS:-} \
      > "$out/prefill_layers.log" 2>&1
    echo "== prefill_layers rc=$?"; cat "$out/prefill_layers.log"
    ;;
  decode-e2e)  # quant-e2e (bf16) with decode attention on each of DECODE_ARMS (default "triton mosaic":
               # tuning.DECODE_BACKEND; "mosaic-persistent": mosaic with MOSAIC_DECODE_MAX_CTAS=132), one process
               # each of at most E2E_TIMEOUT s (default 270, so two arms fit one 600 s call); E2E_ARGS adds bench args
    for arm in ${DECODE_ARMS:-triton mosaic}; do
      tuned=DECODE_BACKEND=${arm%-persistent}; [[ $arm == *-persistent ]] && tuned+=,MOSAIC_DECODE_MAX_CTAS=132
      TUNING=$tuned QUANT_FORMATS=none E2E_TIMEOUT=${E2E_TIMEOUT:-270} quant_e2e
    done
    ;;
  decode-profile)  # batch-1 decode profiles (~80 s each): bf16; fp8, int8 or int4 weights; fp8 with cuBLASLt recorded
                   # into XLA's command buffers; bf16 under XLA fusion / launch flags (PROFILE_VARIANTS picks)
    pdl="--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true"
    heroless=--xla_gpu_experimental_enable_triton_heroless_priority_fusion=true
    for v in ${PROFILE_VARIANTS:-bf16 fp8 fp8-cublaslt}; do
      case $v in
        bf16) env=() ;;
        base) env=(PYTHONPATH=$PWD/.gpu/base) ;;  # an earlier tree: git archive REV --prefix=glint/ | tar -x -C .gpu/base
        pdl) env=("XLA_FLAGS=$pdl") ;;
        heroless) env=(XLA_FLAGS=$heroless) ;;
        block-level) env=(XLA_FLAGS=--xla_gpu_experimental_enable_fusion_block_level_rewriter=true) ;;
        all-triton) env=(XLA_FLAGS=--xla_gpu_experimental_all_fusions_with_triton=true) ;;
        multi-output) env=(XLA_FLAGS=--xla_gpu_unsupported_enable_triton_multi_output_fusion=true) ;;
        min-blocks-*) env=(TUNING=MIN_BLOCKS_PER_SPLIT=${v#min-blocks-}) ;;  # key blocks per split-K split, at least
        mosaic-decode) env=(TUNING=DECODE_BACKEND=mosaic) ;;  # decode attention on decode_attention_mgpu.py
        fp8|int8|int4) env=(PROFILE_QUANTIZE=$v) ;;
        fp8-cublaslt) env=(PROFILE_QUANTIZE=fp8 XLA_FLAGS=--xla_gpu_enable_command_buffer=+CUBLASLT) ;;
      esac
      env "${env[@]}" timeout ${PROFILE_TIMEOUT:-150} python3 tools/with_tuning.py tools/gpu_decode_profile.py \
        "$out/prof_$v" > "$out/prof_$v.log" 2>&1
      echo "== $v"; grep -E "^(engine_ms|pct_of|gpu_busy|kernels_per|tokens|Error)" "$out/prof_$v.log"
      rm -rf "$out/prof_$v/trace"
    done
    ;;
esac
