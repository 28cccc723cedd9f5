#!/usr/bin/env bash
# Everything one GPU device call should run, from the repository root, in under 5 minutes:
#
#   (once, where a package registry is: the peer wheels in .whl/, see benchmarks/README.md; /.whl/ is git-ignored)
#   device run:  command="bash benchmarks/gpu_run.sh", carry=[".whl"], timeout_s=420
#
# 1. installs the carried peer wheels (.whl/*.whl, if any) into /tmp/site ($PEER_SITE overrides);
# 2. prints nvidia-smi;
# 3. starts DeepSpeed's CPUAdam JIT build (~45 s of g++) in the background so that it
#    overlaps the GPU tests instead of the benchmark (the benchmark then loads it from
#    the torch-extensions cache in ~1 s, and reports that time separately);
# 4. runs the GPU tests (pytest -m gpu, short);
# 5. runs benchmarks/gpu_bench.py with what is left of a 280 s budget; log and JSON in $OUT.
# Extra arguments go to gpu_bench.py (e.g. --systems plain,zero2_offload,ds2_offload).
set -uo pipefail
T0=$(date +%s)
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/benchmarks/out}
mkdir -p "$OUT"
since() { echo $(( $(date +%s) - T0 )); }

SITE=${PEER_SITE:-/tmp/site}
if compgen -G ".whl/*.whl" > /dev/null; then
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl; then
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
    echo "== peer wheels installed into $SITE ($(since) s)"
  else
    echo "== peer wheels NOT installed (built for the GPU machine's Python 3.12?); peers may say 'not installed'"
  fi
else
  echo "== no .whl/ carried: DeepSpeed rows will say 'not installed' unless it is already there"
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}

echo "== nvidia-smi"
nvidia-smi || true
python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__, "cpus", __import__("os").cpu_count())'

BUILD_PID=""
if python3 -c 'import deepspeed' 2> /dev/null; then
  echo "== DeepSpeed CPUAdam build started in the background ($(since) s)"
  python3 -c 'import time; t=time.time(); from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(); print(f"CPUAdam ready in {time.time()-t:.1f} s")' \
    > "$OUT/ds_cpu_adam_build.log" 2>&1 &
  BUILD_PID=$!
fi

echo "== GPU tests ($(since) s)"
timeout 120 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tail -n 15 | tee "$OUT/pytest_gpu.log"

if [ -n "$BUILD_PID" ]; then
  wait "$BUILD_PID"; echo "== DeepSpeed CPUAdam build: rc $? ($(since) s): $(tail -n 1 "$OUT/ds_cpu_adam_build.log")"
fi

BUDGET=$(( 280 - $(since) ))
[ "$BUDGET" -lt 60 ] && BUDGET=60
echo "== gpu_bench.py, budget ${BUDGET} s ($(since) s so far)"
python3 benchmarks/gpu_bench.py --budget "$BUDGET" "$@" 2>&1 | tee "$OUT/gpu_bench.log"
RC=${PIPESTATUS[0]}
echo "== done in $(since) s, gpu_bench rc $RC; files in $OUT:"
ls -la "$OUT"
exit "$RC"
