"""How `benchmarks.kernels` times programs: one compiled SGD training step
of a workload's B models (`Program`), B one-model programs stepped in turn
(`Serial`), their median seconds per step in alternating rounds, and the
device's matrix-product peak.
"""

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernel_forms import BUILDERS, convnet_flops, to_device

LEARNING_RATE = 0.01


class Program:
    """One compiled SGD training step of `num_models` models and its
    parameters on the device; `like` shares the compiled step of another
    program of the same shapes."""

    def __init__(self, workload, num_models, form, seed=0, like=None):
        build, config = BUILDERS[workload]
        rng = np.random.default_rng(seed)
        params, loss, batch = build(rng, num_models, config, form)
        self.params = to_device(params)
        self.batch = to_device(batch)
        self.samples = config["batch"]
        self.value = None
        if like is not None:
            self.step, self.flops = like.step, like.flops
            return

        def step(params, x, y):
            value, grads = jax.value_and_grad(loss)(params, x, y)
            return jax.tree.map(lambda p, g: p - LEARNING_RATE * g,
                                params, grads), value

        self.step = jax.jit(step, donate_argnums=0).lower(
            self.params, *self.batch).compile()
        self.flops = (convnet_flops(config, num_models)
                      if workload == "convnet" else _cost(self.step))

    def run(self, steps):
        for _ in range(steps):
            self.params, self.value = self.step(self.params, *self.batch)

    def block(self):
        jax.block_until_ready((self.params, self.value))


def _cost(compiled):
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - not every backend reports costs
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return (cost or {}).get("flops")


class Serial:
    """B one-model programs stepped one after another."""

    def __init__(self, workload, num_models):
        first = Program(workload, 1, "grouped")
        self.programs = [first] + [
            Program(workload, 1, "grouped", seed=b, like=first)
            for b in range(1, num_models)]
        self.flops = (None if self.programs[0].flops is None
                      else num_models * self.programs[0].flops)
        self.samples = self.programs[0].samples

    def run(self, steps):
        for _ in range(steps):
            for program in self.programs:
                program.run(1)

    def block(self):
        for program in self.programs:
            program.block()


def seconds_per_step(sides, seconds, repeats):
    """Median seconds per step of each side, timed in alternating rounds of
    about `seconds` each."""
    counts = []
    for side in sides:
        side.run(2)  # warm-up: first dispatches and allocations
        side.block()
        steps, elapsed = 1, 0.0
        while elapsed < seconds / 4 and steps < 1 << 20:
            steps *= 2
            start = time.perf_counter()
            side.run(steps)
            side.block()
            elapsed = time.perf_counter() - start
        counts.append(max(1, int(steps * seconds / elapsed)))
    times = [[] for _ in sides]
    for _ in range(repeats):
        for side, steps, measured in zip(sides, counts, times):
            start = time.perf_counter()
            side.run(steps)
            side.block()
            measured.append((time.perf_counter() - start) / steps)
    return [statistics.median(measured) for measured in times]


def matmul_peak(size, dtype, precision, repeats=10):
    """FLOP/s of a `size`-cube matrix product on the default device."""
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=(size, size)), dtype)
    b = jnp.asarray(rng.normal(size=(size, size)), dtype)
    product = jax.jit(lambda a, b: jnp.matmul(a, b, precision=precision))
    product(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        product(a, b).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * size ** 3 / statistics.median(times)
