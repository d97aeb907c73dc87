#!/usr/bin/env bash
# HFTA's own PyTorch arrays beside hftatf on one GPU, in one command (issue
# 44): HFTA's fused ResNet-18 and PointNet (serial vs fused at B = 1, 8, 32,
# random data, batch 64, float32 with PyTorch's TF32 defaults) by
# benchmarks/hfta_peer.py, then hftatf's benchmarks.run on JAX at the same
# model sizes (resnet18 width=1.0,stem=imagenet; pointnet width=1.0): one
# stock model timed (serial, scaled to B) and fused at B = 1, 8, 32, one
# benchmarks.run per model. Writes $OUT_DIR (default gpu_results/hfta_peer):
# hfta_peer.csv/.md, hftatf/results.csv, and side_by_side.md. HFTATF=0 skips the
# hftatf half; extra arguments go to hfta_peer.py (e.g. --precision
# fp32,bf16 --tf32_matmul).
#
# HFTA's code is never committed here: it travels as an ignored snapshot.
# Place it where $HFTA_DIR points (default .peer/hfta; .peer/ is in
# .gitignore), from a bare mirror of UofT-EcoSystem/hfta on GitHub (the
# search tool's fetch gives one; about 0.5 MiB; the whole tree does not
# archive: its slides are not in the mirror):
#
#   mkdir -p .peer/hfta && git --git-dir=<mirror> archive HEAD \
#       hfta examples/resnet examples/pointnet LICENSE | tar -x -C .peer/hfta
#
# then carry it with the run (the device tool's carry: [".peer/hfta"]). It
# needs PyTorch (CUDA) and NumPy, nothing else of HFTA's requirements
# (no torchvision, no data sets: the batches are random tensors).
#
# The hftatf half needs hftatf and Keras there as gpu.sh does (its wheels).
# Not yet timed on a GPU: HFTA's half is 8 points of ~2 s timed steps plus
# warm-up in one process (about a minute expected); hftatf's half is two
# benchmarks.run processes (a probe, a serial and three fused workers each,
# sharing one JAX compilation cache, benchmarks/jax_cache.sh; --timeout
# 240).
#
#   benchmarks/hfta_peer.sh             # the GPU run
#   HFTATF=0 benchmarks/hfta_peer.sh    # HFTA's half alone
#   benchmarks/hfta_peer.sh --dry-run   # tiny sizes on the CPU
set -euo pipefail
cd "$(dirname "$0")/.."
export HFTA_DIR=${HFTA_DIR:-.peer/hfta}
OUT_DIR=${OUT_DIR:-gpu_results/hfta_peer}
HFTATF=${HFTATF:-1}
SIZES=1,8,32
RESNET_ARGS=width=1.0,stem=imagenet
POINTNET_ARGS=width=1.0
POINTNET_DATA=
EXTRA=(--epochs 3 --warmup_steps 3 --epoch_seconds 2 --timeout 240)
if [[ " $* " == *" --dry-run "* ]]; then
  SIZES=1,2
  RESNET_ARGS=width=0.125,stem=imagenet
  POINTNET_ARGS=width=0.125,num_points=32
  POINTNET_DATA=num_points=32  # hfta_peer.py's dry run: 32 points
  EXTRA=(--quick --steps 2 --data_batches 2 --batch_size 4 --peak_size 64
         --peak_seconds 0.1 --timeout 300)
fi

# $PEER_PYTHON: an interpreter with PyTorch, where `python` has none.
"${PEER_PYTHON:-python}" benchmarks/hfta_peer.py --output_dir "$OUT_DIR" "$@"

if [[ "$HFTATF" == 1 ]]; then
  export KERAS_BACKEND=jax
  source benchmarks/jax_cache.sh
  for model in resnet18 pointnet; do
    margs=$RESNET_ARGS dargs=
    if [[ $model == pointnet ]]; then
      margs=$POINTNET_ARGS dargs=$POINTNET_DATA
    fi
    # Serial B models run at one model's rate: one timed, scaled to B.
    python -m benchmarks.run --backend jax --model $model --append \
      --model_args "$margs" --data_args "$dargs" --num_models "$SIZES" \
      --modes serial,fused --serial_models 1 --output_dir "$OUT_DIR/hftatf" \
      "${EXTRA[@]}"
  done
  python benchmarks/hfta_peer.py --side_by_side "$OUT_DIR"
  if [[ " $* " == *" --dry-run "* ]]; then
    echo "(dry run: HFTA at full width on one thread, hftatf at width" \
         "0.125: the two sides are not comparable)"
  fi
fi
echo "benchmarks/hfta_peer.sh: results in $OUT_DIR/"
