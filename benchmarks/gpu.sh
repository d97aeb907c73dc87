#!/usr/bin/env bash
# One command for a machine with JAX and CUDA and no TensorFlow: checks the
# GPU, runs the tests marked `gpu` on the JAX backend, then the training
# benchmark (serial stock Keras vs the fused array, XLA) for the zoo's
# MLP, ResNet-18, MobileNetV3-small, PointNet, BERT-tiny and Transformer at
# B = 1, 8, 32. Writes results.csv, results.md and speedup PNGs to
# $OUT_DIR (default gpu_results/); $MODES picks the modes (default
# serial,fused). See benchmarks/README.md for the wheels to carry there.
#
#   benchmarks/gpu.sh             # the full run (under 10 minutes, H200)
#   benchmarks/gpu.sh --dry-run   # tiny sizes on any device (CPU too)
set -euo pipefail
cd "$(dirname "$0")/.."
export KERAS_BACKEND=jax
OUT_DIR=${OUT_DIR:-gpu_results}
MODES=${MODES:-serial,fused}
MODELS=mlp,resnet18,mobilenet_v3_small,pointnet,bert_tiny,transformer_lm
SIZES=1,8,32
EXTRA=(--epochs 3 --warmup_steps 3 --epoch_seconds 2 --timeout 240)
DEVICE=gpu
if [[ "${1:-}" == "--dry-run" ]]; then
  # The same steps at the smallest sizes, on whatever device JAX has.
  MODELS=mlp
  SIZES=1,2
  EXTRA=(--quick --steps 2 --data_batches 2 --batch_size 8 --peak_size 64
         --peak_seconds 0.1 --timeout 300)
  DEVICE=any
fi

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

if [[ "$DEVICE" == gpu ]]; then
  HFTATF_TEST_GPU=1 python -m pytest -p no:xdist -q -m gpu tests
fi

python -m benchmarks.run --backend jax --model "$MODELS" \
  --num_models "$SIZES" --modes "$MODES" --output_dir "$OUT_DIR" \
  "${EXTRA[@]}"
echo "benchmarks/gpu.sh: results in $OUT_DIR/ (results.csv, results.md," \
     "speedup*.png)"
