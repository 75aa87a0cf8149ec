#!/bin/bash
# LoRA on a lent GPU (issue 27), after benchmarks/gpu/prepare.sh here: device run "bash benchmarks/gpu/lora_kernels.sh",
# carry [".whl", ".gpu"]. Both LoRALinear forms at Qwen2.5-0.5B's shape in bf16, alternating (ONLY=tests: the tests
# alone: tests/engine/test_lora_layers.py runs on CUDA there, every layout and both forms against float64).
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONPATH=/tmp/site:$PWD PATH=$PWD/.gpu/bin:$PATH NUMBA_CACHE_DIR=/tmp/numba
if [ "${ONLY:-}" != tests ]; then
  for k in runs masked runs masked; do
    echo "== kernel $k"; timeout 80 python3 benchmarks/bench_lora.py --shape qwen2.5-0.5b --device cuda --dtype bfloat16 --repeats 2 --kernel $k 2>&1 | grep -E "^\||target|swap"
  done
fi
echo "== tests"; timeout 120 python3 -m pytest -q -rs tests/engine/test_lora_layers.py 2>&1 | tail -4
