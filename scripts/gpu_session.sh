#!/usr/bin/env bash
# On a lent CUDA machine (the device tool): everything in one command, results under $OUT.
#   bash scripts/gpu_session.sh [samples] [cuda] [bench] [ckpt] [suite] [truth] [alloc]   (default: the first five)
# bench: the recorder's overhead against the plain step, interleaved (issue 26): GPT-2 124M and a small
# Llama, amp and fp32, torch's own history, tracekit default / no origins / full detail.
# ckpt: transformers' gradient checkpointing under torch's history and under tracekit, each in a fresh
# process (exit codes: torch's own is known to crash), and the checkpointing tests marked cuda.
# truth: our tests/simulate_scripts (single GPU) and ../shared's fixture scripts run for real, unmodified, each under
# bench/gpu_truth.py's wrapper (max allocated/reserved, NVML used, a gzipped snapshot) and the NVML/torch ledger probe
# -> truth.tgz + truth.log. alloc: train_hf.py qwen2 amp under three PYTORCH_CUDA_ALLOC_CONF -> alloc.tgz + alloc.log.
# Both want .gpu/ (bench/gpu_prep.sh, run beforehand here; carry it): ../shared does not travel to the device.
# The machine's python3 has torch with CUDA, numpy, pandas, click and pytest; tracekit runs from this tree.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 QT_QPA_PLATFORM=offscreen
steps=${*:-samples cuda bench ckpt suite}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
  python3 setup.py -q build_ext --inplace >/dev/null 2>&1 && echo "compiled scanner built" || echo "no compiled scanner"
} 2>&1 | tee "$OUT/env.log"
for step in $steps; do
  t=$(date +%s)
  case $step in
    samples) timeout 300 python3 samples/make_cuda_samples.py "$OUT/rec" ${SAMPLES:-} 2>&1 | tee "$OUT/samples.log" ;;
    cuda) timeout 180 python3 -m pytest -q -p no:cacheprovider -m cuda tests 2>&1 | tee "$OUT/cuda_tests.log" ;;
    bench) timeout 420 python3 bench/bench_record_cuda.py --rounds 3 --steps 6 2>&1 | tee "$OUT/bench.log" ;;
    ckpt) { timeout 300 python3 bench/bench_record_cuda.py --models gpt2 --precisions amp --rounds 1 --steps 1 --checkpointing
            timeout 240 python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_record_features.py; } 2>&1 | tee "$OUT/ckpt.log" ;;
    suite) { timeout 420 python3 -m pytest -q -rfs -p no:cacheprovider -n 12 tests --ignore=tests/test_cache.py -m "not slow"; timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_cache.py; } 2>&1 > "$OUT/suite.log" ;;
    truth) timeout 300 python3 bench/gpu_truth.py truth --out "$OUT" ${TRUTH_ARGS:-} 2>&1 | tail -40 ;;
    alloc) timeout 120 python3 bench/gpu_truth.py alloc --out "$OUT" --jobs 3 2>&1 | tail -10 ;;
  esac
  echo "== $step: $(( $(date +%s) - t )) s"
done
if [ -d "$OUT/rec" ]; then tar czf "$OUT/rec.tgz" -C "$OUT" rec && rm -rf "$OUT/rec"; fi
ls -la "$OUT"
