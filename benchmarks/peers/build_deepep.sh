#!/usr/bin/env bash
# On the GPU machine: build DeepEP from the carried source (.peers-deepep/, made here by
# benchmarks/peers/fetch_deepep.sh) into /tmp/deepep, for benchmarks/peers_deepep.py. Called
# by `benchmarks/run_gpu.sh deepep`; by hand: bash benchmarks/peers/build_deepep.sh
#
# DeepEP is built without NVSHMEM: only its intranode kernels (CUDA IPC over NVLink), for
# sm_90, by pip into /tmp/deepep (MAX_JOBS=16, ~1-4 min). Three changes, in the build copy only:
# - its setup.py enables NVSHMEM whenever the nvidia.nvshmem wheel is installed (torch's CUDA
#   13 wheels bring it): that lookup is pointed at a module that does not exist;
# - it compiles with -rdc=true but device-links only with NVSHMEM, which leaves the module
#   with undefined __cudaRegisterLinkedBinary_* symbols: nvcc_dlink becomes ['-dlink'];
# - deep_ep.cpp calls three low-latency mask kernels outside its DISABLE_NVSHMEM guards
#   (bindings this benchmark never uses): the build copy defines them, raising if called.
# Exit status: 2 no source, 3 the build failed (the compiler's errors and the log's tail are
# printed), 4 the module does not import; 0 when `import deep_ep` works. A second call on the
# same warm machine reuses /tmp/deepep while it imports.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
SRC=$PWD/.peers-deepep BUILD=/tmp/deepep-src TARGET=/tmp/deepep
[ -f "$SRC/setup.py" ] || { echo "no DeepEP source at $SRC: carry .peers-deepep"; exit 2; }
imports() {
  PYTHONPATH=$TARGET:$PWD python3 -c \
    "import deep_ep; print('deep_ep imports, sm90:', deep_ep.Buffer.is_sm90_compiled())" \
    > "$OUT/deepep_import.log" 2>&1
}
if imports; then
  echo "== DeepEP already built in $TARGET"; cat "$OUT/deepep_import.log"; exit 0
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
rm -rf "$BUILD" "$TARGET" && cp -r "$SRC" "$BUILD"
sed -i -e "s/^    nvcc_dlink = \[\]$/    nvcc_dlink = ['-dlink']/" \
  -e 's/find_spec("nvidia.nvshmem")/find_spec("nvidia.nvshmem_not_for_intranode")/' \
  "$BUILD/setup.py"
[ "$(grep -c "nvcc_dlink = \['-dlink'\]\|nvshmem_not_for_intranode" "$BUILD/setup.py")" = 2 ] \
  || { echo "the setup.py changes did not apply"; exit 3; }
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
imports || { tail -20 "$OUT/deepep_import.log"; exit 4; }
cat "$OUT/deepep_import.log"
