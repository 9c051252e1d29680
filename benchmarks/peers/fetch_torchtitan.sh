#!/usr/bin/env bash
# Here, on a machine with network: what benchmarks/torchtitan_train.py needs on the GPU
# machine, which has no network, into .torchtitan/ (git-ignored; carry it):
#   .torchtitan/whl/   torchtitan 0.3.0 and the pure-Python packages it imports that the GPU
#                      machine's image lacks (its list in /work/.library/device/KINDS.md)
#   .torchtitan/data/  torchtitan's test tokenizer and the text to train on
# Usage, from the repository root: bash benchmarks/peers/fetch_torchtitan.sh [TEXT_URL]
# TEXT_URL (default: tiny-shakespeare, karpathy/char-rnn's input.txt) is any plain text, or a
# JSON-lines file with a "text" field such as torchtitan's tests/assets/c4_test/data.json.
set -euo pipefail
[ -e .git ] || { echo "run from the repository root"; exit 2; }
raw=https://raw.githubusercontent.com
text_url=${1:-$raw/karpathy/char-rnn/master/data/tinyshakespeare/input.txt}
rm -rf .torchtitan/whl && mkdir -p .torchtitan/whl .torchtitan/data
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp -d .torchtitan/whl torchtitan==0.3.0 spmd_types==0.2.3 \
  torch_checkpointing tyro typeguard docstring_parser torchdata
for f in tokenizer.json tokenizer_config.json; do
  curl -fsSL "$raw/pytorch/torchtitan/main/tests/assets/tokenizer/$f" -o ".torchtitan/data/$f"
done
case $text_url in
  *.json|*.jsonl) curl -fsSL "$text_url" -o .torchtitan/data/text.json ;;
  *) curl -fsSL "$text_url" -o .torchtitan/data/text.txt ;;
esac
echo "$text_url" > .torchtitan/data/SOURCE  # the runs' rows name their text by it
du -sh .torchtitan/whl .torchtitan/data
echo "next: a device call carrying .torchtitan: bash benchmarks/run_gpu.sh torchtitan debug"
