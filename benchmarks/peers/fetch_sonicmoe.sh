#!/usr/bin/env bash
# Here, on a machine with network: SonicMoE's wheels for the GPU machine (Python 3.12,
# x86_64), which has no network, into .peersA/ and .peersB/ (git-ignored).
# Usage, from the repository root: bash benchmarks/peers/fetch_sonicmoe.sh
#
# The CuTe DSL libraries' wheel (~74 MB) is larger than one device call may carry (64 MiB),
# so it is cut in two: its first part goes in .peersA, its second part and every other wheel
# in .peersB. Two device calls then put it back together, back to back so the machine (and
# its /tmp) is still the same one (benchmarks/peers/README.md):
#   call 1, carry [".peersA"]:           bash benchmarks/run_gpu.sh sonicmoe-stage
#   call 2, carry [".peersB", ".peersC"]: bash benchmarks/run_gpu.sh sonicmoe [SHAPES]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
[ -e .git ] || { echo "run from the repository root"; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux2014_x86_64 -d "$tmp" -r "$here/sonicmoe-requirements.txt"
rm -rf .peersA .peersB
mkdir -p .peersA .peersB
big=$(ls "$tmp"/nvidia_cutlass_dsl_libs_base-*.whl)
basename "$big" > .peersB/big.name  # what the two parts make again on the GPU machine
split -b 38000000 "$big" "$tmp/part."
mv "$tmp/part.aa" .peersA/ && mv "$tmp"/part.* .peersB/
rm "$big"
mv "$tmp"/*.whl .peersB/
du -sh .peersA .peersB
echo "next: two device calls back to back (benchmarks/peers/README.md)"
