#!/usr/bin/env bash
# Prepares what benchmarks/gpu/checklist.sh needs on a lent GPU machine (no network there), from this checkout:
#   .whl/  wheels (CPython 3.12, x86-64) of rose's dependencies the device image lacks, at this machine's versions
#   .gpu/  redis-server with the libraries it links beyond glibc; qwen-real/ (Qwen2.5-0.5B's config + its real
#          151k tokenizer from ../shared/data/tokenizers, when present)
# Both folders are git-ignored through .git/info/exclude; name them in the device call's `carry`.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || printf '/.whl/\n/.gpu/\n' >> .git/info/exclude
ver() { python3 -m pip show "$1" 2>/dev/null | awk '/^Version:/{print $2}'; }
pkgs="redis hiredis rq croniter fakeredis lupa xgrammar llguidance apache-tvm-ffi openai jiter httpx2 httpcore2 truststore sniffio
pydantic pydantic_core pydantic-settings python-dotenv annotated-types typing-inspection typing_extensions jsonschema
jsonschema-specifications referencing rpds-py transformers tokenizers huggingface_hub"
specs=(); for p in $pkgs; do v=$(ver "$p"); [ -n "$v" ] && specs+=("$p==$v"); done
mkdir -p .whl && python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "${specs[@]}"
mkdir -p .gpu/bin .gpu/lib
cp "$(command -v redis-server)" .gpu/lib/redis-server
for lib in $(ldd "$(command -v redis-server)" | awk '/=>/{print $3}'); do
  case "$(basename "$lib")" in libc.so*|libm.so*|libstdc++*|libssl*|libcrypto*|libsystemd*) ;; *) cp -L "$lib" .gpu/lib/ ;; esac
done
printf '#!/bin/sh\nd=$(dirname "$(readlink -f "$0")")/../lib\nLD_LIBRARY_PATH=$d exec "$d/redis-server" "$@"\n' > .gpu/bin/redis-server
chmod +x .gpu/bin/redis-server
tok=../shared/data/tokenizers/qwen2.5-instruct
if [ -d "$tok" ]; then
  mkdir -p .gpu/qwen-real && zcat "$tok/tokenizer.json.gz" > .gpu/qwen-real/tokenizer.json
  cp "$tok/tokenizer_config.json" .gpu/qwen-real/
  python3 -c "
from rose.engine.presets import qwen2_5_0_5b_config
c = qwen2_5_0_5b_config(); c.bos_token_id = c.pad_token_id = 151643; c.eos_token_id = 151645
c.save_pretrained('.gpu/qwen-real')"
fi
du -sh .whl .gpu
