#!/usr/bin/env bash
# Here, at a session's start: a new checkout has none of the ignored folders the device calls
# carry. Builds them in one go (~25 min on 2 cores; run it in the background and do CPU work):
#   bash lab/prepare_session.sh > /tmp/prepare.log 2>&1 &
# .kcache: the tests' plan list and the H100 packs (tests, peers, stack, torchtitan);
# .peersA/.peersB: SonicMoE's wheels; .peersC: its kernel cache (lab/quack_cache.tgz);
# .torchtitan: torchtitan's wheels, tokenizer and text.
# Where raw.githubusercontent.com does not resolve, the tokenizer and text come from the git
# mirrors of the `fetch` tool: fetch github:pytorch/torchtitan and github:karpathy/char-rnn
# first. A pack that exists is kept: delete .kcache/kernels-* after a kernel source change.
set -uo pipefail
[ -e .git ] || { echo "run from the repository root"; exit 2; }
python3 -m pip install -q torch==2.13.0 && python3 -m pip install -q -e '.[test]'
[ -d .peersB ] || bash benchmarks/peers/fetch_sonicmoe.sh
# SonicMoE's compiled and autotuned kernels from the last device run (QuACK's cache, returned
# by run_gpu.sh sonicmoe as quack_cache.tgz and committed here): the JIT costs 2-7 min of
# device time per hidden size on a fresh machine
[ -d .peersC/quack_cache ] || { mkdir -p .peersC && tar -xzf lab/quack_cache.tgz -C .peersC; }
if [ ! -f .torchtitan/data/tokenizer.json ]; then
  bash benchmarks/peers/fetch_torchtitan.sh || {
    tt=/work/.mirror/pytorch+torchtitan/repo cr=/work/.mirror/karpathy+char-rnn/repo
    for f in tokenizer.json tokenizer_config.json; do
      git --git-dir=$tt show HEAD:tests/assets/tokenizer/$f > .torchtitan/data/$f
    done
    git --git-dir=$cr show HEAD:data/tinyshakespeare/input.txt > .torchtitan/data/text.txt
    echo https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt \
      > .torchtitan/data/SOURCE
  }
fi
for m in pytorch+torchtitan karpathy+char-rnn; do  # the fallback's mirrors: say so at once
  [ -f .torchtitan/data/text.txt ] || [ -d /work/.mirror/$m/repo ] ||
    echo "no /work/.mirror/$m: fetch github:${m/+//} first (the text and tokenizer need it)"
done
# the small packs first (minutes): the torchtitan and SonicMoE calls can run while the tests'
# pack (~20 min) builds
packs=()
for p in peers stack; do [ -f .kcache/kernels-h100-$p.tar.xz ] || packs+=("$p"); done
[ ${#packs[@]} = 0 ] || bash lab/pack_kernels.sh h100-sxm "${packs[@]}"
if [ ! -f .kcache/kernels-h100-tt.tar.xz ]; then
  # torchtitan (and triton, which it imports and a CPU-only torch does not bring) in the
  # environment, as .ci/run installs them: its tests then run here too
  python3 -m pip install -q --no-deps .torchtitan/whl/*.whl triton shtab
  bash lab/pack_kernels.sh h100-sxm torchtitan
fi
[ -f .kcache/tests.pkl ] ||
  MOKGEN_GPU=h100-sxm python3 benchmarks/prebuild.py collect .kcache/tests.pkl
[ -f .kcache/kernels-h100.tar.xz ] || bash lab/pack_kernels.sh h100-sxm tests
ls -la .kcache .peersA .peersB .torchtitan/data
