#!/bin/bash
# ../shared/gpu-checklist.md in one device call, after benchmarks/gpu/prepare.sh here:
#   device run: command "bash benchmarks/gpu/checklist.sh", carry [".whl", ".gpu"], timeout_s 590
#   (ONLY="worker pytest" DEADLINE=280 bash benchmarks/gpu/checklist.sh: those steps alone, within 280 s)
# Every step is time-boxed and skipped when it cannot end before DEADLINE seconds; logs go to /tmp/w, tarred into
# $OUT/all.tgz after each step (a device call brings back at most 8 files); each step's tail is printed.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
O=${OUT:-/tmp/out}; W=/tmp/w; mkdir -p "$O" "$W"
T0=$(date +%s); DEADLINE=${DEADLINE:-540}
el(){ echo $(( $(date +%s) - T0 )); }
log(){ echo "[$(el)s] $*" | tee -a "$W/summary.txt"; }
pack(){ cp "$W/summary.txt" "$O/summary.txt"; tar czf "$O/all.tgz" -C "$W" . 2>/dev/null; }
step(){ # step NAME SECONDS CMD...: skipped when it cannot finish before DEADLINE
  local name=$1 t=$2; shift 2
  [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]] && return  # ONLY="a b": a rerun of those steps alone
  local left=$(( DEADLINE - $(el) )); [ "$left" -lt 20 ] && { log "skip $name (${left}s left)"; return; }
  [ "$t" -gt "$left" ] && t=$left
  log "start $name (limit ${t}s)"
  timeout -s INT -k 10 "$t" "$@" > "$W/$name.txt" 2>&1; local rc=$?
  log "end $name rc=$rc"; echo "----- $name (tail)"; grep -v -E "^\s*$|Warning|warn\(" "$W/$name.txt" | grep -E "${KEEP:-.}" | tail -n ${TAILN:-30}; pack
}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > "$W/pip.txt" 2>&1 || log "pip failed: $(tail -3 $W/pip.txt)"
chmod +x .gpu/bin/* 2>/dev/null
export PYTHONPATH=/tmp/site:$PWD PATH=$PWD/.gpu/bin:$PATH NUMBA_CACHE_DIR=/tmp/numba
log "pip done"
TAILN=12 step env 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; nproc; python3 -c "import torch,transformers,xgrammar,rq,redis,tokenizers,numba; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0), transformers.__version__, rq.__version__, tokenizers.__version__, numba.__version__); import rose.engine.flash_attention as f; print(\"flash-attn kernel:\", f.kernel())"; redis-server --version'
B="python3 -m rose bench"
KEEP="wrong|crash|exact,|Error" step cov_smoke 60 python3 benchmarks/coverage.py llama qwen2 --device cuda --dtype float32 --json-out $W/cov_smoke.json
step step 90 $B step --model qwen2.5-0.5b --device cuda --dtype bfloat16 --batch-sizes 1,16,64,256 --profile --plain --json-out $W/step.json
step engine 150 $B engine --model qwen2.5-0.5b --device cuda --dtype bfloat16 --repeats 3 --plain --json-out $W/engine.json
step worker 100 $B worker --model qwen2.5-0.5b --device cuda --dtype bfloat16 --repeats 2 --plain --json-out $W/worker.json
# correctness: the suite (CUDA where tests say device auto) beside the parity runs, in parallel
( export KEEP="wrong|crash|exact,|Error" TAILN=12; step coverage_fp32 150 python3 benchmarks/coverage.py llama qwen2 qwen3 mistral gemma2 gemma3_text phi3 gpt2 olmo2 granite cohere starcoder2 --device cuda --dtype float32 --json-out $W/cov_fp32.json
  step coverage_bf16 80 python3 benchmarks/coverage.py llama qwen2 qwen3 mistral gemma2 phi3 gpt2 --device cuda --dtype bfloat16 --json-out $W/cov_bf16.json ) &
# -v: each result on its own line as it comes (a suite cut off by the limit still says what failed)
KEEP="FAILED|ERROR|passed|failed" TAILN=40 step pytest 160 python3 -m pytest -v -p xdist -n 12 --timeout 90 -rfE tests/engine tests/worker tests/cli tests/jobs tests/bench
wait
TAILN=20 step structured 70 $B engine --structured --model .gpu/qwen-real/config.json --device cuda --dtype bfloat16 --repeats 1 --plain --json-out $W/structured.json
# LoRA (issue 27): 8 adapters mixed at batch 64 against the base model, a real shape in bf16, CUDA's masked form
TAILN=12 step lora 60 python3 benchmarks/bench_lora.py --shape qwen2.5-0.5b --device cuda --dtype bfloat16 --repeats 2
log "done"; pack
