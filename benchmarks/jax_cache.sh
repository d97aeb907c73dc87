# Sourced by benchmarks/gpu.sh and hfta_peer.sh: one JAX compilation cache
# for every worker process of the run (every program cached, however fast
# it compiled), so a stock model's program compiles once. A cache made here
# is removed when the sourcing script exits; $JAX_COMPILATION_CACHE_DIR,
# where set, is used and kept.
if [[ -z "${JAX_COMPILATION_CACHE_DIR:-}" ]]; then
  JAX_COMPILATION_CACHE_DIR=$(mktemp -d)
  trap 'rm -rf "$JAX_COMPILATION_CACHE_DIR"' EXIT
fi
export JAX_COMPILATION_CACHE_DIR
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0}
