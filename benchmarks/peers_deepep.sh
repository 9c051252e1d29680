#!/usr/bin/env bash
# One device call on a 2-GPU machine (nvidia-h200-x2): build DeepEP from the carried source,
# then benchmarks/peers_deepep.py (mokgen vs DeepEP dispatch/combine + grouped_mm).
#   carry: [".peers-deepep", ".mokgen-cache"]  (the DeepEP source, git-ignored; the kernels)
#   bash benchmarks/peers_deepep.sh [tokens, default 2048]
# DeepEP (.peers-deepep/COMMIT) is built without NVSHMEM: only its intranode kernels (CUDA
# IPC over NVLink), for sm_90, by pip into /tmp/deepep (MAX_JOBS=16). Two changes to its
# setup.py, in the build copy only: it enables NVSHMEM whenever the nvidia.nvshmem wheel is
# installed (torch's CUDA 13 wheels bring it), so that lookup is pointed at a module that does
# not exist; and it compiles with -rdc=true but device-links only with NVSHMEM, which leaves
# the module with undefined __cudaRegisterLinkedBinary_* symbols (DeepEP issue #429), so
# nvcc_dlink becomes ['-dlink']. A failed build prints the compiler's errors and the log's
# tail and exits 3; a module that does not import exits 4; else the benchmark's status.
# Expected: build ~3-4 min (deep_ep.cpp is the long pole), benchmark ~2 min. Two calls if
# that does not fit: BUILD_ONLY=1, then SKIP_BUILD=1 (reuses /tmp/deepep while it imports).
source "$(dirname "$0")/device_env.sh"
TOKENS=${1:-2048}
SRC=$PWD/.peers-deepep BUILD=/tmp/deepep-src TARGET=/tmp/deepep
if [ ! -f "$SRC/setup.py" ]; then
  echo "no DeepEP source at $SRC: carry .peers-deepep"; exit 2
fi
python3 -c "import setuptools as s, torch as t; print(s.__version__, t.__version__)" \
  || { echo "setuptools missing: cannot build DeepEP"; exit 3; }
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$NVCC")")}
"$CUDA_HOME/bin/nvcc" --version | tail -1
# headers torch's CUDA headers include (cuBLAS, cuSPARSE, cuSOLVER) where the toolkit lacks
# them: the CUDA wheels torch depends on ship them under site-packages/nvidia
EXTRA_INC=$(python3 - <<'EOF'
import glob, os
try:
    import nvidia
    roots = list(nvidia.__path__)
except ImportError:
    roots = []
print(":".join(d for r in roots for d in sorted(glob.glob(os.path.join(r, "*", "include"))
               + glob.glob(os.path.join(r, "*", "*", "include")))))
EOF
)
export CPATH=${EXTRA_INC}${CPATH:+:$CPATH}
if ! ldconfig -p | grep -q 'libcuda.so '; then  # link against the stub; the driver's at run
  export LIBRARY_PATH=$CUDA_HOME/lib64/stubs${LIBRARY_PATH:+:$LIBRARY_PATH}
fi
imports() {
  PYTHONPATH=$TARGET:$PWD python3 -c \
    "import deep_ep; print('deep_ep imports, sm90:', deep_ep.Buffer.is_sm90_compiled())" \
    > "$OUT/deepep_import.log" 2>&1
}
if [ "${SKIP_BUILD:-0}" = 1 ] && imports; then
  echo "== DeepEP already built in $TARGET"
else
  rm -rf "$BUILD" "$TARGET" && cp -r "$SRC" "$BUILD"
  sed -i -e "s/^    nvcc_dlink = \[\]$/    nvcc_dlink = ['-dlink']/" \
    -e 's/find_spec("nvidia.nvshmem")/find_spec("nvidia.nvshmem_not_for_intranode")/' \
    "$BUILD/setup.py"
  [ "$(grep -c "nvcc_dlink = \['-dlink'\]\|nvshmem_not_for_intranode" "$BUILD/setup.py")" = 2 ] \
    || { echo "the setup.py changes did not apply"; exit 3; }
  # deep_ep.cpp calls three low-latency mask kernels outside its DISABLE_NVSHMEM guards
  # (bindings we never use); without NVSHMEM they are not built and the import fails on
  # their symbols: define them in the build copy, raising if ever called
  cat >> "$BUILD/csrc/deep_ep.cpp" <<'STUBS'

#ifdef DISABLE_NVSHMEM
namespace deep_ep::internode_ll {  // mokgen's intranode-only build: not available
void query_mask_buffer(int*, int, int*, cudaStream_t) { EP_HOST_ASSERT(false and "no low-latency mode"); }
void update_mask_buffer(int*, int, bool, cudaStream_t) { EP_HOST_ASSERT(false and "no low-latency mode"); }
void clean_mask_buffer(int*, int, cudaStream_t) { EP_HOST_ASSERT(false and "no low-latency mode"); }
}  // namespace deep_ep::internode_ll
#endif
STUBS
  echo "== building DeepEP $(cat "$SRC/COMMIT" 2>/dev/null) (intranode, sm_90)"
  T0=$SECONDS
  ( cd "$BUILD" && env -u NVSHMEM_DIR MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 timeout 420 \
      python3 -m pip install -v --no-build-isolation --no-deps --target "$TARGET" . ) \
    > "$OUT/deepep_build.log" 2>&1
  STATUS=$?
  echo "build exit $STATUS after $((SECONDS - T0)) s (log: deepep_build.log)"
  if [ $STATUS -ne 0 ]; then
    grep -nE "error|Error|undefined|cannot find" "$OUT/deepep_build.log" | grep -v "Wno-error" \
      | head -30
    echo "--- log tail"; tail -40 "$OUT/deepep_build.log"; exit 3
  fi
  grep -E "NVSHMEM|Sources" "$OUT/deepep_build.log" | head -3
  imports || { tail -20 "$OUT/deepep_import.log"; exit 4; }
fi
cat "$OUT/deepep_import.log"
[ "${BUILD_ONLY:-0}" = 1 ] && exit 0
export PYTHONPATH=$TARGET:$PWD
echo "== prebuild (mokgen kernels of the benchmark)"
timeout 150 python3 benchmarks/prebuild.py --world 2 --tokens "$TOKENS" 2>&1 | tail -2
echo "== mokgen vs DeepEP, R = 2"
timeout 400 torchrun --nproc-per-node=2 benchmarks/peers_deepep.py --tokens "$TOKENS" \
  --out "$OUT" 2>&1 | tee "$OUT/peers_deepep_R2.log" | grep -v '^{' | tail -14
STATUS=${PIPESTATUS[0]}
cp "$OUT"/peers_deepep_R2.json benchmarks/results/ 2>/dev/null
exit "$STATUS"
