# session 31 call 2 (carry .kcache/s31.pkl: 145 plans collected at 605caed from half A + B +
# pingpong): build them all, then GPU suite half A at the head
KERNELS=.kcache/s31.pkl HALVES=a TEST_TIMEOUT=430 MOKGEN_COMMIT=605caed bash benchmarks/device_suite.sh
grep -h "passed\|failed" $OUT/pytest_a.log | tail -3
