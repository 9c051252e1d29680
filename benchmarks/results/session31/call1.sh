# session 31 call 1 (carry .kcache/collected.pkl): GPU suite half A at the head (605caed)
KERNELS=.kcache/collected.pkl HALVES=a TEST_TIMEOUT=450 MOKGEN_COMMIT=605caed bash benchmarks/device_suite.sh
grep -h "passed\|failed" $OUT/pytest_a.log | tail -3
