#!/usr/bin/env bash
# One command for a machine with JAX and CUDA and no TensorFlow: checks the
# GPU, runs the tests marked `gpu` on the JAX backend, then the training
# benchmark (serial stock Keras vs the fused array, XLA) for the zoo's
# MLP, ResNet-18, PointNet, MobileNetV3-small, BERT-tiny and Transformer
# at B = 1, 8, 32, in that order, within a time budget. Writes results.csv,
# results.md and speedup PNGs to $OUT_DIR (default gpu_results/$DTYPE_POLICY).
# See benchmarks/README.md for the wheels to carry there.
#
#   benchmarks/gpu.sh             # the full run (under 10 minutes)
#   benchmarks/gpu.sh --dry-run   # tiny sizes on any device (CPU too)
#
# Settings (environment): DTYPE_POLICY (float32, the default, with TF32 as
# stock Keras on JAX uses it; or mixed_bfloat16), MODES (serial,fused),
# MODELS, SIZES (1,8,32; with auto, also the B that auto_num_models picks,
# up to 1024: minutes more per model), BUDGET (seconds of measurements
# started: 360; what is not measured by then is left out of the table),
# TESTS (1: run the gpu tests first; 0: not). The serial mode times 2
# stock models at each B and scales their time to B (--serial_models);
# the workers share one JAX compilation cache (benchmarks/jax_cache.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
export KERAS_BACKEND=jax
DTYPE_POLICY=${DTYPE_POLICY:-float32}
OUT_DIR=${OUT_DIR:-gpu_results/$DTYPE_POLICY}
MODES=${MODES:-serial,fused}
MODELS=${MODELS:-mlp,resnet18,pointnet,mobilenet_v3_small,bert_tiny,transformer_lm}
BUDGET=${BUDGET:-360}
TESTS=${TESTS:-1}
SIZES=${SIZES:-1,8,32}
EXTRA=(--epochs 3 --warmup_steps 3 --epoch_seconds 1 --timeout 120
       --serial_models 2)
DEVICE=gpu
if [[ "${1:-}" == "--dry-run" ]]; then
  # The same steps at the smallest sizes, on whatever device JAX has.
  MODELS=mlp
  SIZES=1,2,4
  EXTRA=(--quick --steps 2 --data_batches 2 --batch_size 8 --peak_size 64
         --peak_seconds 0.1 --timeout 300 --serial_models 2)
  DEVICE=any
fi
source benchmarks/jax_cache.sh

python - "$DEVICE" <<'PY'
import sys
import jax
devices = jax.devices()
print("JAX", jax.__version__, "devices:", devices)
if sys.argv[1] == "gpu" and not any(d.platform == "gpu" for d in devices):
    raise SystemExit("benchmarks/gpu.sh: JAX sees no GPU (install jax[cuda] "
                     "or run with --dry-run).")
try:
    import tensorflow  # noqa: F401
    print("note: TensorFlow is installed; the run does not use it.")
except ImportError:
    print("TensorFlow: not installed (as expected).")
PY

if [[ "$DEVICE" == gpu && "$TESTS" == 1 ]]; then
  HFTATF_TEST_GPU=1 python -m pytest -p no:xdist -q -m gpu tests
fi

python -m benchmarks.run --backend jax --model "$MODELS" \
  --num_models "$SIZES" --modes "$MODES" --output_dir "$OUT_DIR" \
  --dtype_policy "$DTYPE_POLICY" --time_budget "$BUDGET" "${EXTRA[@]}"
echo "benchmarks/gpu.sh: results in $OUT_DIR/ (results.csv, results.md," \
     "speedup*.png)"
