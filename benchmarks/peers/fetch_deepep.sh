#!/usr/bin/env bash
# Here, on a machine with network: DeepEP's source at the commit benchmarks/peers_deepep.py
# was measured with, into .peers-deepep/ (git-ignored). The GPU machine has no network: carry
# .peers-deepep to it, where `benchmarks/run_gpu.sh deepep` builds it (build_deepep.sh).
# Usage, from the repository root: bash benchmarks/peers/fetch_deepep.sh
# (DEEPEP_COMMIT=<sha> for another commit: its last release before EPv2, which made NVSHMEM
# mandatory, is the default; the intranode build needs no NVSHMEM.)
set -euo pipefail
COMMIT=${DEEPEP_COMMIT:-567632dd59810d77b3cc05553df953cc0f779799}
[ -e .git ] || { echo "run from the repository root"; exit 2; }
rm -rf .peers-deepep
git clone -q https://github.com/deepseek-ai/DeepEP .peers-deepep
git -C .peers-deepep checkout -q "$COMMIT"
rm -rf .peers-deepep/.git  # the carry holds the source alone
echo "$COMMIT" > .peers-deepep/COMMIT
du -sh .peers-deepep
