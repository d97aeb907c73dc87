"""The GANs' training steps on the TensorFlow backend: one forward pass
under a persistent `GradientTape`, each network's gradient of its own loss
applied by its own optimizer (the TensorFlow DCGAN tutorial's step), for
the stock `GAN` and for `FusedGAN` (whose `[B]` losses give each model its
own gradient, applied through `apply_model_gradients`)."""

import tensorflow as tf
from keras import ops

from hftatf.core.axis import stack_models
from hftatf.core.compat import scale_loss_for_distribution


def trainer_optimizer(discriminator_optimizer, generator_optimizer):
    """What `GAN.compile` hands Keras's trainer: the step applies the two
    optimizers itself, so Keras's default, unused."""
    del discriminator_optimizer, generator_optimizer
    return "rmsprop"


def train_gan(gan, data):
    """`GAN.train_step(data)`: updates the weights and the loss trackers;
    returns the logs."""
    images, noise = gan.images_and_noise(data)
    with tf.GradientTape(persistent=True) as tape:
        d_loss, g_loss = gan.losses_of(images, noise)
    d_weights = gan.discriminator.trainable_variables
    g_weights = gan.generator.trainable_variables
    gan.discriminator_optimizer.apply(tape.gradient(d_loss, d_weights),
                                      d_weights)
    gan.generator_optimizer.apply(tape.gradient(g_loss, g_weights),
                                  g_weights)
    del tape
    gan.d_loss_tracker.update_state(d_loss)
    gan.g_loss_tracker.update_state(g_loss)
    return {m.name: m.result() for m in gan.metrics}


# -- FusedGAN ---------------------------------------------------------------


def extra_state_variables(array):
    """Variables a step's state must carry besides Keras's: none here (the
    tape step updates variables in place)."""
    del array
    return []


def model_noise(array, batch_size):
    """`FusedGAN.sample_noise`: model `b`'s standard normal noise drawn
    statelessly from `(noise_seed, replica, step, b)`."""
    replica = tf.distribute.get_replica_context()
    replica_id = 0 if replica is None else replica.replica_id_in_sync_group
    seed = ops.stack([
        ops.cast(array.noise_seed + 7919 * replica_id, "int64"),
        ops.cast(array.optimizer.iterations, "int64")])
    # One draw per model, stacked: the generators' first per-model layers
    # read each model's draw itself (`model_pieces`).
    return stack_models([
        tf.random.stateless_normal(
            (batch_size, array.latent_dim),
            seed=tf.random.experimental.stateless_fold_in(seed, index))
        for index in range(array.num_models)], 1)


def train_fused_gan(array, data):
    """`FusedGAN.train_step(data)`: returns the logs."""
    real, noise = array.unpack_data(data)
    discriminator_weights = array.discriminator.trainable_variables
    generator_weights = array.generator.trainable_variables
    state = array.model_state()
    with tf.GradientTape(persistent=True) as tape:
        d_losses, g_losses = array.gan_losses_of(real, noise, training=True)
        d_objective = array.optimizer.scale_model_losses(
            scale_loss_for_distribution(d_losses))
        g_objective = array.generator_optimizer.scale_model_losses(
            scale_loss_for_distribution(g_losses))
    d_gradients = tape.gradient(d_objective, discriminator_weights)
    g_gradients = tape.gradient(g_objective, generator_weights)
    del tape
    array.apply_model_gradients(
        [(array.optimizer, d_gradients, discriminator_weights),
         (array.generator_optimizer, g_gradients, generator_weights)],
        (d_losses, g_losses), state=state,
        data=({"images": real, "noise": noise}, None, None, None))
    return array.track_gan(ops.shape(real)[0], d_losses, g_losses)


def test_fused_gan(array, data):
    """`FusedGAN.test_step(data)`: returns the logs."""
    return array.evaluate_batch(data)
