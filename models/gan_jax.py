"""The GANs' training steps on the JAX backend: stateless, as Keras's JAX
trainer calls them, `train_step(state, data) -> (logs, state)` over the
four state lists (trainable, non-trainable, optimizer and metric
variables). The steps are the TensorFlow ones' (`gan_tensorflow`): one
forward pass, each network's gradient of its own loss.

Keras's trainer keeps state for one optimizer, `model.optimizer`; a GAN
has two. For the stock `GAN`, `OptimizerPair` is that one optimizer: its
variables are the discriminator's optimizer's, then the generator's. For
`FusedGAN`, whose `optimizer` is the discriminator's fused optimizer, the
generator's optimizer rides among the metric variables
(`extra_state_variables`), as the array's own status does.
"""

import jax
import keras
from keras import ops

from hftatf.core.axis import stack_models


class OptimizerPair(keras.optimizers.Optimizer):
    """The discriminator's and the generator's optimizers as the one
    optimizer whose variables Keras's JAX trainer carries in its state.
    Never applied itself: `train_gan` applies the two."""

    def __init__(self, discriminator_optimizer, generator_optimizer):
        super().__init__(learning_rate=0.0, name="gan_optimizers")
        self.discriminator_optimizer = discriminator_optimizer
        self.generator_optimizer = generator_optimizer

    @property
    def variables(self):
        return (self.discriminator_optimizer.variables
                + self.generator_optimizer.variables)

    def build(self, variables):
        # The two are built on their own networks by GAN.compile.
        self.built = True


def trainer_optimizer(discriminator_optimizer, generator_optimizer):
    """What `GAN.compile` hands Keras's trainer: both optimizers' state."""
    return OptimizerPair(discriminator_optimizer, generator_optimizer)


def train_gan(gan, state, data):
    """`GAN.train_step(state, data)`: the new state and the logs."""
    trainable, non_trainable, optimizer_values, metric_values = state
    in_generator = _membership(gan.trainable_variables,
                               gan.generator.trainable_variables)

    def losses(trainable):
        mapping = [*zip(gan.trainable_variables, trainable),
                   *zip(gan.non_trainable_variables, non_trainable)]
        with keras.StatelessScope(state_mapping=mapping) as scope:
            images, noise = gan.images_and_noise(data)
            d_loss, g_loss = gan.losses_of(images, noise)
        return (d_loss, g_loss), [scope.get_current_value(v)
                                  for v in gan.non_trainable_variables]

    (d_loss, g_loss), pullback, non_trainable = jax.vjp(
        losses, trainable, has_aux=True)
    zero = jax.numpy.zeros_like
    d_grads, = pullback((jax.numpy.ones_like(d_loss), zero(g_loss)))
    g_grads, = pullback((zero(d_loss), jax.numpy.ones_like(g_loss)))
    count = len(gan.discriminator_optimizer.variables)
    d_values, d_state = gan.discriminator_optimizer.stateless_apply(
        optimizer_values[:count],
        [g for g, mine in zip(d_grads, in_generator) if not mine],
        [t for t, mine in zip(trainable, in_generator) if not mine])
    g_values, g_state = gan.generator_optimizer.stateless_apply(
        optimizer_values[count:],
        [g for g, mine in zip(g_grads, in_generator) if mine],
        [t for t, mine in zip(trainable, in_generator) if mine])
    d_values, g_values = iter(d_values), iter(g_values)
    trainable = [next(g_values) if mine else next(d_values)
                 for mine in in_generator]
    logs, metric_values = _tracked(gan, metric_values, (d_loss, g_loss))
    return logs, (trainable, non_trainable, [*d_state, *g_state],
                  metric_values)


def _membership(variables, members):
    """For each of `variables`, whether it is one of `members`."""
    ids = {id(v) for v in members}
    return [id(v) in ids for v in variables]


def _tracked(gan, metric_values, losses):
    """The loss trackers updated statelessly with `losses`: `(logs, their
    new variables)`."""
    logs, updated, start = {}, [], 0
    for tracker, loss in zip(gan.metrics, losses):
        count = len(tracker.variables)
        values = tracker.stateless_update_state(
            metric_values[start:start + count], loss)
        logs[tracker.name] = tracker.stateless_result(values)
        updated.extend(values)
        start += count
    return logs, updated


# -- FusedGAN ---------------------------------------------------------------


def extra_state_variables(array):
    """The generator's optimizer's variables (once compiled): the step's
    state carries them with the metric variables."""
    optimizer = getattr(array, "generator_optimizer", None)
    return [] if optimizer is None else list(optimizer.variables)


def model_noise(array, batch_size):
    """`FusedGAN.sample_noise`: model `b`'s standard normal noise drawn
    from JAX's generator keyed by `(noise_seed, step, b)` (one program for
    every device under `keras.distribution`: no replica to tell apart)."""
    key = jax.random.fold_in(jax.random.key(array.noise_seed),
                             ops.convert_to_tensor(array.optimizer.iterations))
    return stack_models([
        jax.random.normal(jax.random.fold_in(key, index),
                          (batch_size, array.latent_dim))
        for index in range(array.num_models)], 1)


def train_fused_gan(array, state, data):
    """`FusedGAN.train_step(state, data)`: the logs and the new state."""
    trainable = state[0]

    def objectives(trainable):
        values = (trainable, *state[1:])
        with array.stateless_scope(values) as scope:
            real, noise = array.unpack_data(data)
            d_losses, g_losses = array.gan_losses_of(real, noise,
                                                     training=True)
            d_objective = array.optimizer.scale_model_losses(d_losses)
            g_objective = array.generator_optimizer.scale_model_losses(
                g_losses)
        updated = [scope.get_current_value(v) for v in
                   array.non_trainable_variables]
        return (d_objective, g_objective), (real, noise, d_losses, g_losses,
                                            updated)

    (d_objective, g_objective), pullback, aux = jax.vjp(
        objectives, trainable, has_aux=True)
    real, noise, d_losses, g_losses, updated = aux
    zero, one = jax.numpy.zeros_like, jax.numpy.ones_like
    d_gradients, = pullback((one(d_objective), zero(g_objective)))
    g_gradients, = pullback((zero(d_objective), one(g_objective)))
    d_gradients = _of(array.discriminator, array, d_gradients)
    g_gradients = _of(array.generator, array, g_gradients)
    with array.stateless_scope(state) as scope:
        # What the forward pass updated, given back to the models that do
        # not take the step.
        model_state = array.model_state()
        for variable, value in zip(array.non_trainable_variables, updated):
            variable.assign(value)
        array.apply_model_gradients(
            [(array.optimizer, d_gradients,
              array.discriminator.trainable_variables),
             (array.generator_optimizer, g_gradients,
              array.generator.trainable_variables)],
            (d_losses, g_losses), state=model_state,
            data=({"images": real, "noise": noise}, None, None, None))
        logs = array.track_gan(ops.shape(real)[0], d_losses, g_losses)
    return logs, array.state_after(scope, state)


def _of(network, array, gradients):
    """The gradients (of all the array's trainable variables) of
    `network`'s trainable variables, in their order."""
    by_id = {id(v): g for v, g in zip(array.trainable_variables, gradients)}
    return [by_id[id(v)] for v in network.trainable_variables]


def test_fused_gan(array, state, data):
    """`FusedGAN.test_step(state, data)`: the logs and the new state."""
    trainable, non_trainable, metric_values = state
    mapping = [*zip(array.trainable_variables, trainable),
               *zip(array.non_trainable_variables, non_trainable),
               *zip(array.metrics_variables, metric_values)]
    with keras.StatelessScope(state_mapping=mapping) as scope:
        logs = array.evaluate_batch(data)
    return logs, (trainable, [
        scope.get_current_value(v) for v in array.non_trainable_variables],
        [scope.get_current_value(v) for v in array.metrics_variables])
