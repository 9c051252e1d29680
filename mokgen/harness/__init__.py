"""The measuring harness: benchmark timing and workloads, the NCCL baseline, plots, the
autotuner and the deployment simulator. Nothing in the compiler or the runtime imports it."""
