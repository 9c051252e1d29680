#!/usr/bin/env bash
# Here, after a kernel source change: the packs a device session carries in .kcache/, built on
# this machine's cores (benchmarks/prebuild.py --pack; run_gpu.sh unpacks them), one per
# run_gpu.sh chunk, so a call measures instead of compiling. The tests' pack needs
# .kcache/tests.pkl (prebuild.py collect; it changes only with the plans).
#   bash lab/pack_kernels.sh KIND PACK...     KIND h100-sxm | h200; PACK of
#     tests fp8-ep1 layer models stack peers torchtitan (the last needs torchtitan importable)
# Writes .kcache/kernels-<h100|h200>[-PACK].tar.xz and the commit they are current at.
set -euo pipefail
KIND=${1:?usage: pack_kernels.sh KIND PACK...}
shift
tag=${KIND%-sxm}
export MOKGEN_GPU=$KIND
PRESETS=kimi-k2.7,glm-5.2,qwen3.5-397b-a17b,deepseek-v4-pro
FP8_EP1=qwen3-30b-a3b,olmoe-1b-7b,qwen3-235b-a22b,mixtral-8x7b
MODELS=qwen3-30b-a3b,qwen3-235b-a22b,qwen1.5-moe-a2.7b,deepseek-v2-lite,mixtral-8x7b,mixtral-8x22b,olmoe-1b-7b,llama-4-scout,granite-3.0-3b-a800m
pb() {  # pb NAME ARGS...: prebuild.py ARGS into a fresh cache, packed as NAME
  local cache; cache=$(mktemp -d)
  MOKGEN_CACHE=$cache python benchmarks/prebuild.py --pack ".kcache/kernels-$tag$1.tar.xz" "${@:2}"
  rm -rf "$cache"
}
mkdir -p .kcache
for p in "$@"; do
  case $p in
    tests) pb "" build "$([ "$tag" = h100 ] && echo .kcache/tests.pkl || echo .kcache/tests_h200.pkl)" ;;
    fp8-ep1) pb -fp8 layers "$FP8_EP1" --ep 1 --tokens 4096 --dtypes bf16,fp8,mxfp8 ;;
    layer) for ep in 64 8; do
             pb "-layer$ep" build --bench "--shapes $PRESETS --ep $ep --tokens 1024,2048,4096 --iters 20 --backward"
           done ;;
    models) pb -models layers "$MODELS" --tokens 4096 ;;
    stack) pb -stack layers qwen3-30b-a3b,olmoe-1b-7b --ep 1 --tokens 8192 --dtypes bf16,fp8 ;;
    peers) cache=$(mktemp -d)
           MOKGEN_CACHE=$cache python benchmarks/peers_sonicmoe.py --prebuild --dtypes bf16,fp8
           tar -cJf ".kcache/kernels-$tag-peers.tar.xz" -C "$cache" . && rm -rf "$cache" ;;
    torchtitan) cache=$(mktemp -d)  # torchtitan importable here (its wheels: --target)
           MOKGEN_CACHE=$cache python benchmarks/torchtitan_train.py prebuild \
             --pack ".kcache/kernels-$tag-tt.tar.xz" && rm -rf "$cache" ;;
    *) echo "unknown pack $p"; exit 2 ;;
  esac
done
git rev-parse --short HEAD > .kcache/commit
