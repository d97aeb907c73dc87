"""The GAN objective shared by the zoo's GANs, and `GAN`, one stock GAN
trained by `fit` with the simultaneous generator and discriminator step of
the TensorFlow DCGAN tutorial (the single-model twin of `FusedGAN`).

A GAN model here is one Keras model, `noise -> discriminator(generator(
noise))`, holding two nested models named `GENERATOR` and `DISCRIMINATOR`
(`hftatf.models.dcgan.build` or `combine` make one).
"""

import keras
from keras import ops

if keras.backend.backend() == "jax":
    from hftatf.models import gan_jax as steps
else:
    from hftatf.models import gan_tensorflow as steps

GENERATOR = "generator"
DISCRIMINATOR = "discriminator"


def gan_losses(real_logits, fake_logits):
    """DCGAN's losses from the discriminator's logits `[batch, B, 1]`.

    For each model (as the TensorFlow DCGAN tutorial and the Keras DCGAN
    example compute them, with `BinaryCrossentropy(from_logits=True)`, a
    mean over the batch):
        d_loss = BCE(1, D(x)) + BCE(0, D(G(z)))
        g_loss = BCE(1, D(G(z)))    (the non-saturating generator loss)

    Returns:
        `(d_losses, g_losses)`, `[B]` each.
    """

    def bce(target, logits):
        per_sample = keras.losses.binary_crossentropy(
            ops.full_like(logits, target), logits, from_logits=True)
        return ops.mean(per_sample, axis=0)

    d_losses = bce(1.0, real_logits) + bce(0.0, fake_logits)
    return d_losses, bce(1.0, fake_logits)


class GAN(keras.Model):
    """One stock DCGAN, trained by `fit` with the simultaneous generator and
    discriminator step of the TensorFlow DCGAN tutorial: the single-model
    twin of `FusedGAN`, built from the same `build` model, and what one of
    its models would be trained by alone.

    Training data are real images `[batch, H, W, C]` (labels are ignored),
    with noise drawn in the step, or a dict `{"images", "noise"}` with the
    noise `[batch, latent_dim]` given. Logs carry `d_loss` and `g_loss`.

    Args:
        gan: a model made by `build` or `combine` (its nested `"generator"`
            and `"discriminator"` are trained).
        seed: the seed of the noise drawn in the step.
    """

    def __init__(self, gan, seed=None, name="gan", **kwargs):
        super().__init__(name=name, **kwargs)
        self.generator = gan.get_layer(GENERATOR)
        self.discriminator = gan.get_layer(DISCRIMINATOR)
        self.latent_dim = self.generator.input_shape[-1]
        self.seed_generator = keras.random.SeedGenerator(seed)
        # The tutorial's loss, computed by stock Keras.
        self.bce = keras.losses.BinaryCrossentropy(from_logits=True)
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        # Its weights are its built networks': nothing for fit to build by
        # calling it on a batch of images (it takes noise).
        self.built = True

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, generator_optimizer=None, discriminator_optimizer=None,
                optimizer=None, jit_compile="auto", **kwargs):
        """One stock optimizer per network; both default to copies of
        `optimizer` (by default DCGAN's `Adam(2e-4, beta_1=0.5)`)."""
        optimizer = optimizer or keras.optimizers.Adam(2e-4, beta_1=0.5)
        self.generator_optimizer = keras.optimizers.get(
            generator_optimizer or fresh_copy(optimizer))
        self.discriminator_optimizer = keras.optimizers.get(
            discriminator_optimizer or fresh_copy(optimizer))
        self.generator_optimizer.build(self.generator.trainable_variables)
        self.discriminator_optimizer.build(
            self.discriminator.trainable_variables)
        super().compile(
            optimizer=steps.trainer_optimizer(self.discriminator_optimizer,
                                              self.generator_optimizer),
            jit_compile=jit_compile, **kwargs)

    def call(self, noise, training=False):
        return self.discriminator(self.generator(noise, training=training),
                                  training=training)

    def train_step(self, *state_and_data):
        """The backend's step (`gan_tensorflow` or `gan_jax`):
        `train_step(data)` on TensorFlow, the stateless
        `train_step(state, data)` on JAX."""
        return steps.train_gan(self, *state_and_data)

    def images_and_noise(self, data):
        """`(images, noise)` of a batch: noise from the data, else drawn."""
        images, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        noise = None
        if isinstance(images, dict):
            images, noise = images["images"], images.get("noise")
        if noise is None:
            noise = keras.random.normal(
                (ops.shape(images)[0], self.latent_dim),
                seed=self.seed_generator)
        return images, noise

    def losses_of(self, images, noise):
        """`(d_loss, g_loss)` of one training forward pass."""
        fake = self.generator(noise, training=True)
        real_logits = self.discriminator(images, training=True)
        fake_logits = self.discriminator(fake, training=True)
        d_loss = (self.bce(ops.ones_like(real_logits), real_logits)
                  + self.bce(ops.zeros_like(fake_logits), fake_logits))
        return d_loss, self.bce(ops.ones_like(fake_logits), fake_logits)


def fresh_copy(optimizer):
    """A fresh copy of an optimizer object (a name or config as it is), so
    the generator and the discriminator never share optimizer state."""
    if isinstance(optimizer, keras.optimizers.Optimizer):
        return type(optimizer).from_config(optimizer.get_config())
    return optimizer
