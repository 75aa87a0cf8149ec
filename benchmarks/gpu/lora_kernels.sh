set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /tmp/pip.txt 2>&1
export PYTHONPATH=/tmp/site:$PWD PATH=$PWD/.gpu/bin:$PATH NUMBA_CACHE_DIR=/tmp/numba
for k in runs masked runs masked; do
  echo "== kernel $k"; timeout 80 python3 benchmarks/bench_lora.py --shape qwen2.5-0.5b --device cuda --dtype bfloat16 --repeats 2 --kernel $k 2>&1 | grep -E "^\||target|swap"
done
echo "== tests"; timeout 120 python3 -m pytest -q -p xdist -n 8 tests/engine/test_lora.py tests/engine/test_lora_layers.py 2>&1 | tail -4
