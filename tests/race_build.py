"""One rank's build for test_codegen's race of eight (spawned processes): here, not in the
test module, so each process imports the compiler alone, not torch with the test module."""
import importlib
import os


def build_in(cache: str) -> tuple[str, bool]:
    os.environ["MOKGEN_CACHE"] = cache
    import mokgen.config

    importlib.reload(mokgen.config)
    from mokgen.compiler import build as b

    importlib.reload(b)
    k = b.Kernel("race", '#include "mokgen/sync.cuh"\nextern "C" __global__ void k(int* p) '
                         "{ if (p) *p = 1; }\n")
    binary = b.build([k])[0]
    return str(binary.path), binary.cached
