"""The stock `GAN`'s training step on the TensorFlow backend: one forward
pass under a persistent `GradientTape`, each network's gradient of its own
loss applied by its own optimizer (the TensorFlow DCGAN tutorial's step)."""

import tensorflow as tf


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
