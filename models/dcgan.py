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

`FusedGAN` is also the worked example of a custom training step on a
`FusedModel`: a subclass computes one `[B]` vector of losses per objective
(entry b is model b's loss, exactly what one stock model would compute),
differentiates their sums (so model b's gradient is its own), and applies a
fused optimizer per objective with the array's per-model step mask.
"""

import math
import random

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from hftatf import optimizers as fused_optimizers
from hftatf.api import hftatf_export
from hftatf.core.axis import stack_models
from hftatf.core.compat import (
    scale_loss_for_distribution,
    unscale_loss_for_distribution,
)
from hftatf.model import FusedModel, PerModelMean
from hftatf.models import data, recipes

GENERATOR = "generator"
DISCRIMINATOR = "discriminator"


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

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, generator_optimizer=None, discriminator_optimizer=None,
                optimizer=None, jit_compile="auto", **kwargs):
        """One stock optimizer per network; both default to copies of
        `optimizer` (by default DCGAN's `Adam(2e-4, beta_1=0.5)`)."""
        super().compile(jit_compile=jit_compile, **kwargs)
        optimizer = optimizer or keras.optimizers.Adam(2e-4, beta_1=0.5)
        self.generator_optimizer = keras.optimizers.get(
            generator_optimizer or _copy(optimizer))
        self.discriminator_optimizer = keras.optimizers.get(
            discriminator_optimizer or _copy(optimizer))
        self.generator_optimizer.build(self.generator.trainable_variables)
        self.discriminator_optimizer.build(
            self.discriminator.trainable_variables)

    def call(self, noise, training=False):
        return self.discriminator(self.generator(noise, training=training),
                                  training=training)

    def train_step(self, data):
        images, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        noise = None
        if isinstance(images, dict):
            images, noise = images["images"], images.get("noise")
        if noise is None:
            noise = keras.random.normal(
                (ops.shape(images)[0], self.latent_dim),
                seed=self.seed_generator)
        with tf.GradientTape(persistent=True) as tape:
            fake = self.generator(noise, training=True)
            real_logits = self.discriminator(images, training=True)
            fake_logits = self.discriminator(fake, training=True)
            d_loss = (self.bce(ops.ones_like(real_logits), real_logits)
                      + self.bce(ops.zeros_like(fake_logits), fake_logits))
            g_loss = self.bce(ops.ones_like(fake_logits), fake_logits)
        d_weights = self.discriminator.trainable_variables
        g_weights = self.generator.trainable_variables
        self.discriminator_optimizer.apply(tape.gradient(d_loss, d_weights),
                                           d_weights)
        self.generator_optimizer.apply(tape.gradient(g_loss, g_weights),
                                       g_weights)
        del tape
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {m.name: m.result() for m in self.metrics}


@hftatf_export
class FusedGAN(FusedModel):
    """An array of B GANs, each trained as a stock DCGAN.

    Build it with `hftatf.fuse(model, B, model_class=FusedGAN)` (or
    `hftatf.fuse_models(models, model_class=FusedGAN)`) from a model made by
    `build` or `combine`, whose nested models `"generator"` and
    `"discriminator"` become the fused generator and discriminator arrays.

    Layout:
        generator: noise `[batch, B, latent_dim]` -> images
            `[batch, B, H, W, C]`.
        discriminator: images `[batch, B, H, W, C]` -> logits
            `[batch, B, 1]`.
        calling the array: noise (shared `[batch, latent_dim]` or, with
            `shared_inputs=False`, `[batch, B, latent_dim]`) -> logits
            `[batch, B, 1]` of the discriminator on the generated images.

    Training (`fit`): the data are real images, shared by the models
    (`[batch, H, W, C]`) or one batch per model (`[batch, B, H, W, C]`);
    labels and sample weights are ignored. Each step draws independent
    noise for every model (`sample_noise`), or takes it from the data
    when they are a dict `{"images": ..., "noise": [batch, B, latent]}`.
    It computes `gan_losses` for every model from one forward pass, and
    applies the discriminator's gradients with the discriminator
    optimizer and the generator's with the generator optimizer (the
    simultaneous update of the TensorFlow DCGAN tutorial). Logs carry
    `d_loss`, `g_loss` (means over models) and `d_loss_b`, `g_loss_b`.
    A model whose loss or gradient is not finite is frozen, as in
    `FusedModel`.

    Attributes:
        generator_optimizer: the generator's fused optimizer (the
            discriminator's is `optimizer`, alias `discriminator_optimizer`).
        noise_seed: the seed of the noise. Model `b`'s noise of step `s`
            is drawn statelessly from `(noise_seed, s, b)` (and the replica
            id), so a resumed run draws the noise an uninterrupted one
            would, and model `b` draws the same noise in arrays of any
            size.
    """

    def __init__(self, inputs, outputs, num_models, shared_inputs=True,
                 source=None, **kwargs):
        super().__init__(inputs, outputs, num_models,
                         shared_inputs=shared_inputs, source=source, **kwargs)
        names = [layer.name for layer in self.layers
                 if isinstance(layer, keras.Model)]
        if GENERATOR not in names or DISCRIMINATOR not in names:
            raise ValueError(
                f"FusedGAN needs a model holding two nested models named "
                f"'{GENERATOR}' and '{DISCRIMINATOR}'. Received a model "
                f"whose nested models are {names}. Build it with "
                "hftatf.models.dcgan.build or dcgan.combine(generator, "
                "discriminator).")
        self.noise_seed = random.randrange(2**31)
        self.generator_optimizer = None
        self._d_loss_tracker = None
        self._g_loss_tracker = None

    @property
    def generator(self):
        """The fused generator, `[batch, B, latent]` -> `[batch, B, H, W,
        C]`."""
        return self.get_layer(GENERATOR)

    @property
    def discriminator(self):
        """The fused discriminator, `[batch, B, H, W, C]` -> `[batch, B,
        1]`."""
        return self.get_layer(DISCRIMINATOR)

    @property
    def discriminator_optimizer(self):
        """The discriminator's fused optimizer (also `self.optimizer`)."""
        return self.optimizer

    @property
    def latent_dim(self):
        """The size of each model's noise vector."""
        return self.generator.input_shape[-1]

    def compile(self, generator_optimizer=None, discriminator_optimizer=None,
                optimizer=None, loss=None, loss_weights=None, metrics=None,
                weighted_metrics=None, run_eagerly=False,
                steps_per_execution=1, jit_compile="auto",
                per_model_labels=None, auto_scale_loss=True):
        """Configures training with one fused optimizer per network.

        Args:
            generator_optimizer, discriminator_optimizer: fused optimizers
                (or names, or stock optimizers, as for `FusedModel.compile`);
                their hyper-parameters may differ per model. They default
                to `optimizer` (the discriminator) and a copy of it (the
                generator).
            optimizer: the default of both (what a generic launcher
                passes); by default DCGAN's `Adam(2e-4, beta_1=0.5)`.
            loss, loss_weights, metrics, weighted_metrics: must be empty:
                the losses are DCGAN's (`gan_losses`).
            run_eagerly, steps_per_execution, jit_compile: as for
                `FusedModel.compile`.
            per_model_labels, auto_scale_loss: accepted for the signature
                of `FusedModel.compile`; unused (there are no labels).
        """
        del per_model_labels
        for argument, value in (("loss", loss), ("loss_weights", loss_weights),
                                ("metrics", metrics),
                                ("weighted_metrics", weighted_metrics)):
            if value:
                raise ValueError(
                    f"FusedGAN computes DCGAN's losses itself (see "
                    f"hftatf.models.dcgan.gan_losses) and logs d_loss and "
                    f"g_loss per model; it takes no `{argument}`. Received: "
                    f"{argument}={value!r}. Subclass FusedGAN and override "
                    "`compute_gan_losses` for other losses.")
        if optimizer is None:
            optimizer = fused_optimizers.Adam(2e-4, beta_1=0.5)
        if generator_optimizer is None:
            generator_optimizer = _copy(optimizer)
        if discriminator_optimizer is None:
            discriminator_optimizer = optimizer
        discriminator_optimizer = fused_optimizers.get(discriminator_optimizer)
        generator_optimizer = fused_optimizers.get(generator_optimizer)
        if generator_optimizer is discriminator_optimizer:
            raise ValueError(
                "The generator and the discriminator need optimizers of "
                "their own (each keeps state for its own weights). Received "
                "the same object for both.")
        super().compile(optimizer=discriminator_optimizer,
                        run_eagerly=run_eagerly,
                        steps_per_execution=steps_per_execution,
                        jit_compile=jit_compile,
                        auto_scale_loss=auto_scale_loss)
        generator_optimizer.num_models = self.num_models
        # Built here on its own network's weights: left to `fit`, Keras would
        # build the optimizer on every weight of the array.
        self.optimizer.build(self.discriminator.trainable_variables)
        generator_optimizer.build(self.generator.trainable_variables)
        self.generator_optimizer = generator_optimizer
        self._d_loss_tracker = PerModelMean(self.num_models, name="d_loss")
        self._g_loss_tracker = PerModelMean(self.num_models, name="g_loss")
        self._compile_config.config.update(
            optimizer=None,
            generator_optimizer=keras.optimizers.serialize(
                generator_optimizer),
            discriminator_optimizer=keras.optimizers.serialize(
                discriminator_optimizer))

    def compile_from_config(self, config):
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)

    # -- the training step --------------------------------------------------

    def sample_noise(self, batch_size):
        """Independent standard normal noise for every model,
        `[batch_size, B, latent_dim]`: model `b`'s drawn from `(noise_seed,
        step, b)`, so it does not depend on how many models the array
        holds. Override for another noise distribution."""
        replica = tf.distribute.get_replica_context()
        replica_id = 0 if replica is None else (
            replica.replica_id_in_sync_group)
        seed = ops.stack([
            ops.cast(self.noise_seed + 7919 * replica_id, "int64"),
            ops.cast(self.optimizer.iterations, "int64")])
        # One draw per model, stacked: the generators' first per-model
        # layers read each model's draw itself (`model_pieces`).
        return stack_models([
            tf.random.stateless_normal(
                (batch_size, self.latent_dim),
                seed=tf.random.experimental.stateless_fold_in(seed, index))
            for index in range(self.num_models)], 1)

    def compute_gan_losses(self, real_logits, fake_logits):
        """`(d_losses, g_losses)`, `[B]` each; `gan_losses` by default."""
        return gan_losses(real_logits, fake_logits)

    def train_step(self, data):
        real, noise = self._unpack_data(data)
        discriminator_weights = self.discriminator.trainable_variables
        generator_weights = self.generator.trainable_variables
        state = self.model_state()
        with tf.GradientTape(persistent=True) as tape:
            d_losses, g_losses = self._gan_losses(real, noise, training=True)
            d_objective = self.optimizer.scale_model_losses(
                scale_loss_for_distribution(d_losses))
            g_objective = self.generator_optimizer.scale_model_losses(
                scale_loss_for_distribution(g_losses))
        d_gradients = tape.gradient(d_objective, discriminator_weights)
        g_gradients = tape.gradient(g_objective, generator_weights)
        del tape
        # Each model takes the step only where both its losses and all its
        # gradients are finite; a diverging one is frozen, as in FusedModel.
        self.apply_model_gradients(
            [(self.optimizer, d_gradients, discriminator_weights),
             (self.generator_optimizer, g_gradients, generator_weights)],
            (d_losses, g_losses), state=state)
        return self._track_gan(ops.shape(real)[0], d_losses, g_losses)

    def test_step(self, data):
        real, noise = self._unpack_data(data)
        d_losses, g_losses = self._gan_losses(real, noise, training=False)
        return self._track_gan(ops.shape(real)[0], d_losses, g_losses)

    def generate(self, noise, training=False):
        """The B generators' images for `noise`, shared `[batch, latent]` or
        per model `[batch, B, latent]`: `[batch, B, H, W, C]`."""
        noise = ops.convert_to_tensor(noise, "float32")
        if len(noise.shape) == 2:
            noise = ops.broadcast_to(ops.expand_dims(noise, 1), (
                ops.shape(noise)[0], self.num_models, noise.shape[-1]))
        return self.generator(noise, training=training)

    def _gan_losses(self, real, noise, training):
        fake = self.generator(noise, training=training)
        real_logits = self.discriminator(real, training=training)
        fake_logits = self.discriminator(fake, training=training)
        return self.compute_gan_losses(real_logits, fake_logits)

    def _unpack_data(self, data):
        """`(real [batch, B, H, W, C], noise [batch, B, latent])`."""
        images, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        noise = None
        if isinstance(images, dict):
            unknown = set(images) - {"images", "noise"}
            if unknown or "images" not in images:
                raise ValueError(
                    "FusedGAN takes real images, or a dict with 'images' and "
                    f"optionally 'noise'. Received a dict with keys "
                    f"{sorted(images)}.")
            images, noise = images["images"], images.get("noise")
        images = ops.convert_to_tensor(images)
        image_shape = tuple(self.discriminator.input_shape[2:])
        batch_size = ops.shape(images)[0]
        if tuple(images.shape[1:]) == image_shape:
            # B copies of the shared batch, stacked: the discriminator's
            # per-model convolutions read the batch itself (`model_pieces`).
            images = stack_models(
                [ops.cast(images, self.compute_dtype)] * self.num_models, 1)
        elif tuple(images.shape[1:]) != (self.num_models, *image_shape):
            raise ValueError(
                f"FusedGAN expects real images of shape [batch, "
                f"{', '.join(map(str, image_shape))}] (shared by the models)"
                f" or [batch, {self.num_models}, ...] (one batch per model)."
                f" Received shape {tuple(images.shape)}.")
        if noise is None:
            noise = self.sample_noise(batch_size)
        elif tuple(noise.shape[1:]) != (self.num_models, self.latent_dim):
            raise ValueError(
                f"FusedGAN expects noise of shape [batch, {self.num_models}, "
                f"{self.latent_dim}] (one draw per model). Received shape "
                f"{tuple(noise.shape)}.")
        return ops.cast(images, self.compute_dtype), noise

    def _track_gan(self, batch_size, d_losses, g_losses):
        diverged = self._status.diverged > 0
        for tracker, losses in ((self._d_loss_tracker, d_losses),
                                (self._g_loss_tracker, g_losses)):
            losses = ops.where(diverged, float("nan"), losses)
            tracker.update_state(unscale_loss_for_distribution(losses),
                                 sample_weight=batch_size)
        return self.get_metrics_result()

    # -- metrics ------------------------------------------------------------

    @property
    def metrics(self):
        if self._d_loss_tracker is None:
            return []
        return [self._d_loss_tracker, self._g_loss_tracker]

    def get_metrics_result(self):
        """`d_loss`, `g_loss` (means over the models that did not diverge)
        and `d_loss_b`, `g_loss_b` for every model `b`."""
        logs = {}
        healthy = ops.logical_not(self._status.diverged > 0)
        count = ops.sum(ops.cast(healthy, "float32"))
        for tracker in self.metrics:
            values = tracker.result()
            logs[tracker.name] = ops.where(
                count > 0,
                ops.sum(ops.where(healthy, values, 0.0)) / ops.maximum(
                    count, 1.0), float("nan"))
            for index in range(self.num_models):
                logs[f"{tracker.name}_{index}"] = values[index]
        return logs

    # -- serialization ------------------------------------------------------

    def get_config(self):
        return {**super().get_config(), "noise_seed": self.noise_seed}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        noise_seed = config.pop("noise_seed", None)
        array = super().from_config(config, custom_objects=custom_objects)
        if noise_seed is not None:
            array.noise_seed = noise_seed
        return array


def _copy(optimizer):
    """A fresh copy of an optimizer object (a name or config as it is), so
    the generator and the discriminator never share optimizer state."""
    if isinstance(optimizer, keras.optimizers.Optimizer):
        return type(optimizer).from_config(optimizer.get_config())
    return optimizer


# -- data -------------------------------------------------------------------


def digit_images(batch_size, seed=0, image_size=16, validation_fraction=0.2):
    """The DCGAN data recipe: scikit-learn's bundled digits as images.

    The 8x8 digits are scaled to [-1, 1] (the generator's tanh range) and
    resized bilinearly to `image_size`.

    Returns:
        `(train, validation)` datasets of image batches
        `[batch, image_size, image_size, 1]` float32 (no labels); training
        batches are all full and reshuffled every epoch.
    """
    (train, _), (validation, _) = data.digits(
        validation_fraction=validation_fraction, seed=seed)

    def images(pixels):
        # Eagerly, also where the pipeline is built inside a tf.data
        # function (the launcher's training stream).
        with tf.init_scope():
            pixels = tf.image.resize(pixels[..., None],
                                     (image_size, image_size))
            return np.asarray(pixels * 2.0 - 1.0, dtype="float32")

    train, validation = images(train), images(validation)
    return (tf.data.Dataset.from_tensor_slices(train)
            .shuffle(len(train), seed=seed, reshuffle_each_iteration=True)
            .batch(batch_size, drop_remainder=True),
            tf.data.Dataset.from_tensor_slices(validation).batch(batch_size))


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
