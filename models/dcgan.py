"""DCGAN (Radford et al., 2016) and `FusedGAN`, which trains B of them.

`build_generator` and `build_discriminator` are plain functional Keras
models; `build` joins them into one model, `noise -> discriminator(
generator(noise))`, with the two as nested models named `"generator"` and
`"discriminator"`. `hftatf.fuse(build(...), B, model_class=FusedGAN)` turns
that into an array of B GANs trained by `FusedGAN`'s own training step:

    gan = hftatf.fuse(dcgan.build(image_size=16), 4,
                      model_class=dcgan.FusedGAN)
    gan.compile(
        generator_optimizer=hftatf.optimizers.Adam(
            [2e-4, 1e-4, 2e-4, 1e-4], beta_1=0.5),
        discriminator_optimizer=hftatf.optimizers.Adam(
            [2e-4, 2e-4, 1e-4, 1e-4], beta_1=0.5))
    gan.fit(images, epochs=5)          # logs d_loss_b and g_loss_b
    generators = [m.get_layer("generator") for m in gan.unfuse()]

`FusedGAN` (`hftatf.models.fused_gan`) is also the worked example of a
custom training step on a `FusedModel`. The GAN objective and `GAN`, one
stock GAN with the same step, are in `hftatf.models.gan`.
"""

import contextlib
import math

import keras

from hftatf.models import data, recipes
from hftatf.models.batches import batched, require_tensorflow, uses_tf_data
from hftatf.models.fused_gan import FusedGAN
from hftatf.models.gan import (  # noqa: F401
    DISCRIMINATOR,
    GAN,
    GENERATOR,
    gan_losses,
)


def _initializer():
    # DCGAN initialises every weight from N(0, 0.02).
    return keras.initializers.RandomNormal(stddev=0.02)


def _upsamplings(image_size):
    """The number of stride-2 steps from 4x4 to `image_size`."""
    steps = math.log2(image_size / 4) if image_size >= 8 else 0
    if isinstance(image_size, bool) or not isinstance(image_size, int) or (
            steps < 1 or steps != int(steps)):
        raise ValueError(
            "`image_size` must be 4 times a power of two, at least 8 (8, "
            f"16, 32, 64, ...). Received: image_size={image_size!r}.")
    return int(steps)


def build_generator(latent_dim=100, image_size=32, channels=1, filters=64,
                    name=GENERATOR):
    """DCGAN's generator: noise `[batch, latent_dim]` -> images
    `[batch, image_size, image_size, channels]` in [-1, 1].

    `Dense` (no bias) to a 4x4 map of `filters * image_size / 8` channels,
    BatchNormalization and ReLU, then stride-2 `Conv2DTranspose` layers
    (4x4 kernels) that double the size and halve the channels, each with
    BatchNormalization and ReLU, and a last one to `channels` with tanh.

    Args:
        latent_dim: the size of the noise vector.
        image_size: 8, 16, 32, 64, ...
        channels: image channels.
        filters: channels of the last hidden map (the largest one).
        name: the model's name.
    """
    steps = _upsamplings(image_size)
    width = filters * 2 ** (steps - 1)
    noise = keras.Input((latent_dim,), name="noise")
    x = keras.layers.Dense(4 * 4 * width, use_bias=False,
                           kernel_initializer=_initializer(),
                           name="project")(noise)
    x = _normalize_and_activate(x, "project")
    x = keras.layers.Reshape((4, 4, width), name="project_reshape")(x)
    for index in range(steps - 1):
        width //= 2
        x = keras.layers.Conv2DTranspose(
            width, 4, strides=2, padding="same", use_bias=False,
            kernel_initializer=_initializer(), name=f"up_{index}")(x)
        x = _normalize_and_activate(x, f"up_{index}")
    images = keras.layers.Conv2DTranspose(
        channels, 4, strides=2, padding="same", activation="tanh",
        kernel_initializer=_initializer(), name="to_images")(x)
    return keras.Model(noise, images, name=name)


def _normalize_and_activate(x, prefix):
    x = keras.layers.BatchNormalization(
        gamma_initializer=keras.initializers.RandomNormal(1.0, 0.02),
        name=f"{prefix}_norm")(x)
    return keras.layers.ReLU(name=f"{prefix}_relu")(x)


def build_discriminator(image_size=32, channels=1, filters=64, dropout=0.3,
                        name=DISCRIMINATOR):
    """DCGAN's discriminator: images -> one real/fake logit `[batch, 1]`.

    Stride-2 `Conv2D` layers (4x4 kernels) from `filters` channels,
    doubling, down to a 4x4 map, each followed by LeakyReLU(0.2) and
    Dropout, then `Dense(1)` on the flattened map (a logit: no sigmoid).

    Args:
        image_size, channels, filters: as for `build_generator`.
        dropout: the rate of the Dropout layers.
        name: the model's name.
    """
    steps = _upsamplings(image_size)
    images = keras.Input((image_size, image_size, channels), name="images")
    x = images
    for index in range(steps):
        x = keras.layers.Conv2D(filters * 2 ** index, 4, strides=2,
                                padding="same",
                                kernel_initializer=_initializer(),
                                name=f"down_{index}")(x)
        x = keras.layers.LeakyReLU(0.2, name=f"down_{index}_relu")(x)
        x = keras.layers.Dropout(dropout, name=f"down_{index}_dropout")(x)
    x = keras.layers.Flatten(name="flatten")(x)
    logits = keras.layers.Dense(1, kernel_initializer=_initializer(),
                                name="logit")(x)
    return keras.Model(images, logits, name=name)


def combine(generator, discriminator, name="dcgan"):
    """Joins a generator and a discriminator into one model, `noise ->
    discriminator(generator(noise))`, the form `FusedGAN` is fused from.

    The two keep their own names unless these are not `"generator"` and
    `"discriminator"`, which `FusedGAN` looks for: then they are renamed.
    """
    if generator.name != GENERATOR:
        generator.name = GENERATOR
    if discriminator.name != DISCRIMINATOR:
        discriminator.name = DISCRIMINATOR
    noise = keras.Input(generator.input_shape[1:], name="noise")
    return keras.Model(noise, discriminator(generator(noise)), name=name)


def build(latent_dim=100, image_size=32, channels=1, filters=64,
          discriminator_filters=None, dropout=0.3, name="dcgan"):
    """A DCGAN as one model (`combine` of `build_generator` and
    `build_discriminator`): noise `[batch, latent_dim]` -> the
    discriminator's logit on the generated images.

    Args:
        latent_dim, image_size, channels, filters: as for
            `build_generator`.
        discriminator_filters: the discriminator's `filters` (default:
            `filters`).
        dropout: the discriminator's dropout rate.
        name: the model's name.
    """
    generator = build_generator(latent_dim, image_size, channels, filters)
    discriminator = build_discriminator(
        image_size, channels, discriminator_filters or filters, dropout)
    return combine(generator, discriminator, name=name)


# -- data -------------------------------------------------------------------


def digit_images(batch_size, seed=0, image_size=16, validation_fraction=0.2):
    """The DCGAN data recipe: scikit-learn's bundled digits as images.

    The 8x8 digits are scaled to [-1, 1] (the generator's tanh range) and
    resized bilinearly to `image_size`.

    Returns:
        `(train, validation)` batches of images
        `[batch, image_size, image_size, 1]` float32 (no labels); training
        batches are all full and reshuffled every epoch.
    """
    (train, _), (validation, _) = data.digits(
        validation_fraction=validation_fraction, seed=seed)
    with _eagerly():
        train, validation = (data.image_array(pixels, image_size) * 2.0 - 1.0
                             for pixels in (train, validation))
    return (batched(train, batch_size, seed, drop_remainder=True),
            batched(validation, batch_size))


def _eagerly():
    """Where the recipes build tf.data pipelines, a context that resizes
    eagerly also inside a tf.data function (the launcher's training
    stream); elsewhere nothing."""
    if uses_tf_data():
        return require_tensorflow("A tf.data pipeline").init_scope()
    return contextlib.nullcontext()


recipes.register(recipes.Recipe(
    name="dcgan",
    build=build,
    data=digit_images,
    loss=None,
    metrics=(),
    optimizer="adam",
    learning_rate=2e-4,
    epochs=20,
    model_args=dict(latent_dim=64, image_size=16, channels=1, filters=32),
    data_args=dict(image_size=16),
    model_class=FusedGAN,
    # GAN losses do not measure sample quality; the generator's loss is
    # the closest to "lower is better" there is.
    monitor="g_loss",
    monitor_mode="min",
))
