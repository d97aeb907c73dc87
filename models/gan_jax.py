"""The stock `GAN`'s training step on the JAX backend: stateless, as
Keras's JAX trainer calls it, `train_step(state, data) -> (logs, state)`
over the four state lists (trainable, non-trainable, optimizer and metric
variables).

Keras's trainer keeps state for one optimizer, `model.optimizer`; a GAN
has two. `OptimizerPair` is that one optimizer: its variables are the
discriminator's optimizer's, then the generator's, and the step applies
each to its own network. The step is the TensorFlow one's (`gan_tensorflow`):
one forward pass, each network's gradient of its own loss.
"""

import jax
import keras


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
