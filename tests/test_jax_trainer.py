"""The JAX trainer's building blocks for a custom stateless `train_step`,
against the array's own step."""

import jax
import keras
import numpy as np
import pytest
from keras import ops
from testing import assert_close, jaxpr_equations

import hftatf

pytestmark = pytest.mark.backends(
    "jax", reason="the stateless train_step of Keras's JAX trainer")

B = 3


class CustomStep(hftatf.FusedModel):
    """The array's step written with the public building blocks, as a
    custom JAX step is."""

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_values, metrics_values = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        (_, (losses, y_pred, updated, metrics_values)), gradients = (
            jax.value_and_grad(self.compute_loss_and_updates,
                               has_aux=True)(
                trainable, non_trainable, metrics_values, x, y,
                sample_weight, training=True,
                optimizer_variables=optimizer_values))
        state = (trainable, non_trainable, optimizer_values, metrics_values)
        with self.stateless_scope(state) as scope:
            model_state = self.model_state()
            for variable, value in zip(self.non_trainable_variables,
                                       updated):
                variable.assign(value)
            self.apply_model_gradients(
                [(self.optimizer, gradients, self.trainable_variables)],
                losses, state=model_state)
            self._model_loss_tracker.update_state(
                losses, sample_weight=ops.shape(x)[0])
            logs = {"loss": ops.mean(self._model_loss_tracker.result())}
        return logs, self.state_after(scope, state)


def network():
    x = keras.Input((5,))
    h = keras.layers.Dense(8, activation="relu")(x)
    h = keras.layers.BatchNormalization()(h)
    return keras.Model(x, keras.layers.Dense(3)(h))


def trained(model_class, rates, x, y, initial):
    array = hftatf.fuse(network(), B, model_class=model_class)
    array.set_weights(initial)
    array.compile(hftatf.optimizers.Adam(rates), loss=keras.losses.
                  SparseCategoricalCrossentropy(from_logits=True))
    array.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return array


def test_a_custom_step_of_the_building_blocks_trains_as_the_array():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 5)).astype("float32")
    y = rng.integers(0, 3, (32,)).astype("int32")
    initial = hftatf.fuse(network(), B).get_weights()
    # Model 1 diverges: the custom step freezes it as the array's does.
    rates = [1e-2, 1e38, 3e-2]
    ours = trained(CustomStep, rates, x, y, initial)
    theirs = trained(hftatf.FusedModel, rates, x, y, initial)
    assert list(ours.diverged_models) == [False, True, False]
    for a, b in zip(ours.weights, theirs.weights):
        assert_close(a, b, atol=0, rtol=0, err_msg=b.path)


def test_evaluation_losses_of_the_stateless_call_are_the_arrays():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(8, 5)).astype("float32")
    y = rng.integers(0, 3, (8,)).astype("int32")
    array = hftatf.fuse(network(), B)
    array.compile("sgd", loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    logs = array.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    total, (losses, _, _, _) = array.compute_loss_and_updates(
        [v.value for v in array.trainable_variables],
        [v.value for v in array.non_trainable_variables],
        [v.value for v in array.metrics_variables], x, y, None)
    assert_close(losses, [logs[f"loss_{b}"] for b in range(B)])
    assert_close(total, sum(logs[f"loss_{b}"] for b in range(B)))


@pytest.mark.parametrize("num_models, on_host", [(3, False), (65, True)])
def test_a_steps_model_logs_are_read_on_the_host_only_for_many_models(
        monkeypatch, num_models, on_host):
    # Reading a step's per-model logs on the host waits for the step, and so
    # for every step of `fit`: a small array splits them on the device.
    from hftatf.training import jax_trainer

    reads = []

    def host_values(vector):
        reads.append(vector.shape)
        return list(np.asarray(vector))

    monkeypatch.setattr(jax_trainer, "host_values", host_values)
    x = np.random.default_rng(0).normal(size=(16, 5)).astype("float32")
    y = np.arange(16) % 3
    array = hftatf.fuse(network(), num_models)
    array.compile("sgd", loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), metrics=["accuracy"])
    logs = array.train_on_batch(x, y, return_dict=True)
    assert bool(reads) == on_host, reads
    assert sorted(k for k in logs if k.startswith("accuracy_")) == sorted(
        f"accuracy_{b}" for b in range(num_models))
    assert_close(np.mean([logs[f"loss_{b}"] for b in range(num_models)]),
                 logs["loss"])


def test_per_model_gradients_are_stacked_not_padded():
    # Per-model convolutions take the models' slices of their input: the
    # gradient of a slice is a zero tensor of the whole input around it,
    # B of them summed per layer, where one concatenation of the B
    # gradients does.
    inputs = keras.Input((6, 6, 2))
    hidden = keras.layers.Conv2D(4, 3, padding="same")(inputs)
    hidden = keras.layers.Conv2D(4, 3, padding="same")(hidden)
    model = keras.Model(inputs, keras.layers.GlobalAveragePooling2D()(hidden))
    array = hftatf.fuse(model, B, layout="models_first")
    x = np.random.default_rng(0).normal(size=(4, 6, 6, 2)).astype("float32")
    weights = [v.value for v in array.trainable_variables]

    def loss(weights):
        outputs, _ = array.stateless_call(
            weights, [v.value for v in array.non_trainable_variables], x)
        return ops.sum(outputs ** 2)

    program = jax.make_jaxpr(jax.grad(loss))(weights)
    primitives = [equation.primitive.name
                  for equation in jaxpr_equations(program.jaxpr)]
    assert "conv_general_dilated" in primitives
    assert "pad" not in primitives, sorted(set(primitives))
