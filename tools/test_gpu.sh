#!/usr/bin/env bash
# `make test-gpu`: the test suite's kernel, model and engine tests with the Pallas kernels compiled for the GPU
# (GLINT_TEST_GPU=1: attention="pallas", interpret=False), then the kernel sweep (tools/gpu_kernels.py, every kernel
# variant against its jnp reference at GPU sizes); one summary line last. Exits non-zero unless all of it passed.
# Fixtures as for `make test` (../shared), or GLINT_HF_FIXTURES / GLINT_STORIES / GLINT_DFLASH_FIXTURES; on a lent
# machine without ../shared, the copies in .gpu/ (see tools/gpu_session.sh) are used. Logs go to $OUT (or ./out).
set -u
out=${OUT:-out}
mkdir -p "$out"
py=${GPU_PYTHON:-python3}
if [ ! -d ../shared/fixtures ] && [ -d .gpu/fixtures ]; then
  export GLINT_HF_FIXTURES=${GLINT_HF_FIXTURES:-$PWD/.gpu/fixtures} GLINT_STORIES=${GLINT_STORIES:-$PWD/.gpu/stories260K}
  export GLINT_DFLASH_FIXTURES=${GLINT_DFLASH_FIXTURES:-$PWD/.gpu/dflash}
fi
device=$($py -c "import jax; d = jax.devices()[0]; print(d.platform, d.device_kind)" 2>/dev/null)
case "$device" in
  gpu*|cuda*) ;;
  *) echo "test-gpu: no GPU visible to jax (got '${device:-nothing}')"; exit 2 ;;
esac
tests=${GPU_TESTS:-tests/test_kernels_attention.py tests/test_kernels_ring_write.py tests/test_kernels_qkv_write.py \
  tests/test_kernels_mosaic.py tests/test_kernels_mosaic_decode.py tests/test_paged_model.py \
  tests/test_model_parity.py tests/test_engine.py tests/test_quant.py}
# The Mosaic kernels on random steps, where hypothesis is installed (the lent machines may lack it).
$py -c "import hypothesis" 2>/dev/null && tests="$tests tests/test_kernels_mosaic_fuzz.py"
# The sweep (~6 min in one process on the H200; SWEEP_SHARDS processes, 3 by default, each taking every third
# case: 5.3 min on an H100 with nothing beside them) runs beside the tests; all of them share the GPU, each taking
# memory as it needs it instead of 75 % of it up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
shards=${SWEEP_SHARDS:-3}
(
  for ((k = 0; k < shards; k++)); do
    $py tools/gpu_kernels.py --skip-timing --shard $k/$shards > "$out/test_gpu_sweep_$k.log" 2>&1 &
  done
  rc=0
  for ((k = 0; k < shards; k++)); do wait -n || rc=1; done
  exit $rc
) &
sweep=$!
GLINT_TEST_GPU=1 $py -m pytest -q -p no:cacheprovider ${GPU_PYTEST_ARGS:--n 4} $tests > "$out/test_gpu_pytest.log" 2>&1
pytest_rc=$?
summary=$(grep -E "^(=+ )?[0-9]+ (passed|failed)|(passed|failed|error).* in [0-9.]+s" "$out/test_gpu_pytest.log" | tail -1)
grep -E "^(FAILED|ERROR)" "$out/test_gpu_pytest.log" | head -20
wait $sweep
sweep_rc=$?
pass=$(cat "$out"/test_gpu_sweep_*.log | grep -cE "^PASS")
fail=$(cat "$out"/test_gpu_sweep_*.log | grep -cE "^(FAIL|ERROR)")
grep -hE "^(FAIL|ERROR)" "$out"/test_gpu_sweep_*.log | head -20
verdict=GREEN
{ [ $pytest_rc -ne 0 ] || [ $sweep_rc -ne 0 ] || [ "$fail" -ne 0 ] || [ "$pass" -eq 0 ]; } && verdict=RED
echo "test-gpu $(date -u +%F) on $device: pytest ${summary:-(no summary, rc $pytest_rc)} | kernel sweep $pass passed," \
  "$fail failed | $verdict"
[ $verdict = GREEN ]
