"""One measurement of the training benchmark, in a process of its own (so
its peak memory is its own): `python -m benchmarks.worker SPEC_JSON`.

SPEC_JSON names the `task` and the workload (`model`, `batch_size`,
`model_args`, `data_args`), the schedule (`steps`, `epochs`,
`warmup_steps`, `data_batches`) and what the task needs:

* `probe`: one stock model trained with each `jit_settings` (XLA off, then
  on, by default; `epochs` timed epochs each); also the FLOPs of its
  training step and the device's matmul peak (`peak_size`,
  `peak_seconds`, in the dtype policy's compute dtype). The run picks the
  stock setting from it.
* `serial`: `num_models` stock models trained with `fit` one after another
  (`jit_compile` as given).
* `single`: one stock model, for the concurrent mode: it warms up, prints
  `READY`, waits for a line on stdin, then trains its timed epochs (timed
  by the same epoch callback as the other tasks).
* `fused`: one array of `num_models` (`fused_jit_compile`,
  `steps_per_execution`).
* `size`: the B that `hftatf.tuning.auto_num_models` picks (up to
  `max_num_models`): the largest array of the model that fits the device
  and still gains throughput.

Stock models are compiled with `stock_steps_per_execution` (default 1).

Every task builds its models under the Keras dtype policy `dtype_policy`
(default float32).

The last line printed is `RESULT <json>`: epoch timings (wall-clock and
processor seconds), `peak_rss_mb`, `peak_device_mb` (the accelerator's
peak allocation, None where the device reports none, as a CPU), and what
the task measured.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import measure  # noqa: E402
from benchmarks.protocol import READY, RESULT_PREFIX  # noqa: E402
from benchmarks.workloads import Workload, stock_optimizer  # noqa: E402


def workload(spec):
    return Workload(spec["model"], batch_size=spec["batch_size"],
                    model_args=spec.get("model_args", {}),
                    data_args=spec.get("data_args", {}))


def _fit(model, dataset, spec):
    timer = measure.timed_fit(model, dataset, spec["steps"], spec["epochs"],
                              spec["warmup_steps"])
    return {"epoch_seconds": timer.durations,
            "epoch_cpu_seconds": timer.cpu_durations}


def probe(spec):
    """Times one stock model without and with XLA; counts its FLOPs."""
    work = workload(spec)
    dataset = work.dataset(spec["data_batches"])
    result = {"jit": {}}
    model = None
    for jit in spec.get("jit_settings", (False, True)):
        keras.utils.set_random_seed(spec["seed"])
        model = work.stock_model(
            jit_compile=jit,
            steps_per_execution=spec.get("stock_steps_per_execution", 1))
        result["jit"][str(jit).lower()] = _fit(model, dataset, spec)[
            "epoch_seconds"]
    batch = next(iter(dataset))
    result["step_flops"] = measure.train_step_flops(model, batch)
    # Summed from the weights: a subclassed stock twin (the GAN) may not
    # count as built, which count_params() requires.
    result["parameters"] = int(sum(np.prod(w.shape)
                                   for w in model.weights))
    result["matmul_peak_flops"], result["matmul_peak"] = (
        measure.matmul_peak(spec.get("peak_size", 2048),
                            spec.get("peak_seconds", 2.0),
                            keras.config.dtype_policy().compute_dtype))
    return result


def serial(spec):
    """Trains `num_models` stock models one after another."""
    work = workload(spec)
    dataset = work.dataset(spec["data_batches"])
    models = []
    for index in range(spec["num_models"]):
        keras.utils.set_random_seed(spec["seed"] + index)
        model = work.stock_model(
            jit_compile=spec["jit_compile"],
            steps_per_execution=spec.get("stock_steps_per_execution", 1))
        models.append(_fit(model, dataset, spec))
        # Each model is done before the next starts, as separate jobs are.
        del model
        keras.backend.clear_session()
    return {"model_epoch_seconds": [m["epoch_seconds"] for m in models],
            "model_epoch_cpu_seconds": [m["epoch_cpu_seconds"]
                                        for m in models]}


def single(spec):
    """One stock model of the concurrent mode, started on a signal."""
    work = workload(spec)
    dataset = work.dataset(spec["data_batches"])
    keras.utils.set_random_seed(spec["seed"])
    model = work.stock_model(
        jit_compile=spec["jit_compile"],
        steps_per_execution=spec.get("stock_steps_per_execution", 1))
    model.fit(dataset, epochs=1, steps_per_epoch=spec["warmup_steps"],
              verbose=0, shuffle=False)
    print(READY, flush=True)
    sys.stdin.readline()
    timer = measure.EpochTimer()
    model.fit(dataset, epochs=spec["epochs"], steps_per_epoch=spec["steps"],
              verbose=0, callbacks=[timer], shuffle=False)
    return {"epoch_seconds": timer.durations,
            "epoch_cpu_seconds": timer.cpu_durations}


def fused(spec):
    """Trains one array of `num_models`."""
    work = workload(spec)
    dataset = work.dataset(spec["data_batches"])
    keras.utils.set_random_seed(spec["seed"])
    array = work.fused_model(
        spec["num_models"], jit_compile=spec.get("fused_jit_compile", "auto"),
        steps_per_execution=spec.get("steps_per_execution", 1),
        models_per_pass=spec.get("models_per_pass", "auto"))
    result = _fit(array, dataset, spec)
    result["jit_compile"] = bool(array.jit_compile)
    result["models_per_pass"] = getattr(array, "models_per_pass", None)
    return result


def size(spec):
    """The array size B that `hftatf.tuning.auto_num_models` picks for the
    workload on this device (the largest that fits and still pays, up to
    `max_num_models`), without its cache file."""
    from hftatf.tuning import auto_num_models

    work = workload(spec)
    recipe = work.recipe
    if recipe.model_class is not None:
        raise ValueError(
            f"{spec['model']!r} trains with {recipe.model_class.__name__}'s "
            "step of its own; auto_num_models sizes a plain model's array.")
    batch = keras.tree.map_structure(lambda leaf: leaf[0], work.batches(1))
    x, y = batch if isinstance(batch, tuple) else (batch, None)
    keras.utils.set_random_seed(spec["seed"])
    return {"num_models": auto_num_models(
        work.build(), x, y, optimizer=stock_optimizer(
            recipe.optimizer, recipe.learning_rate),
        loss=recipe.loss, metrics=list(recipe.metrics or ()),
        max_num_models=spec["max_num_models"], cache=False)}


TASKS = {"probe": probe, "serial": serial, "single": single, "fused": fused,
         "size": size}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m benchmarks.worker SPEC_JSON")
    spec = json.loads(argv[0])
    measure.quiet()
    # Before any model is built: the stock models and the array alike.
    keras.config.set_dtype_policy(spec.get("dtype_policy", "float32"))
    result = TASKS[spec["task"]](spec)
    result["peak_rss_mb"] = measure.peak_rss_mb()
    result["peak_device_mb"] = measure.peak_device_mb()
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
