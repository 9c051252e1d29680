# session 32 call 5 (carry .build/kc .build/ab/wgo): wg-order (the weight gradients walk the
# smaller operand's blocks) against main: whole layers at the cap in alternating processes,
# then energy a step (both trees) and ncu's DRAM bytes of the wg-order step, Mixtral-8x22B
export PYTHONPATH=$PWD TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
ARGS="--sustained 2" RUN_TIMEOUT=130 bash benchmarks/ab_models.sh wgo \
  mixtral-8x22b,mixtral-8x7b,qwen3-30b-a3b,qwen3-235b-a22b 1 4096 2>&1 | tail -14
python3 - $OUT <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/models_*_*/models_fwdbwd_bf16.json")):
    for r in json.load(open(f))["rows"]:
        b = r["backward"]
        print(f.split("/")[-2], r["shape"], "dW1 err %.2e dW2 err %.2e" % (b["err_dw1_vs_grouped"], b["err_dw2_vs_grouped"]))
PY
for side in base wgo; do
  d=$PWD; c=$PWD/.build/kc
  [ $side = base ] || { d=$PWD/.build/ab/wgo; c=$d/kc; }
  (cd $d && PYTHONPATH=$d MOKGEN_CACHE=$c timeout 60 python3 benchmarks/energy_step.py mixtral-8x22b 4096 --seconds 3 2>&1 | tail -3 | sed "s/^/$side: /")
done
cd .build/ab/wgo && PYTHONPATH=$PWD MOKGEN_CACHE=$PWD/kc timeout 120 /usr/local/cuda/bin/ncu --profile-from-start off \
  --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum --csv --log-file $OUT/ncu_wgo.csv \
  python3 benchmarks/energy_step.py mixtral-8x22b 4096 --profile ours > $OUT/ncu_wgo.log 2>&1; echo "ncu: exit $?"
grep -E "mokgen_(fwd|bwd)" $OUT/ncu_wgo.csv | cut -d, -f5,13-15 | sed 's/"//g' | cut -c1-120
