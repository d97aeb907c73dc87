"""`FusedGAN`: an array of B GANs trained by its own training step, the
worked example of a custom training step on a `FusedModel`.

A subclass computes one `[B]` vector of losses per objective (entry b is
model b's loss, exactly what one stock model would compute), differentiates
their sums (so model b's gradient is its own), and applies a fused
optimizer per objective with the array's per-model step mask.
"""

import random

import keras
from keras import ops

from hftatf import optimizers as fused_optimizers
from hftatf.api import hftatf_export
from hftatf.core.axis import stack_models
from hftatf.core.compat import (
    unscale_loss_for_distribution,
)
from hftatf.core.logs import model_log_name, models_log_name
from hftatf.model import FusedModel
from hftatf.models.gan import (
    DISCRIMINATOR,
    GENERATOR,
    fresh_copy,
    gan_losses,
    steps,
)
from hftatf.training.losses import PerModelMean


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
            generator_optimizer = fresh_copy(optimizer)
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
        holds (TensorFlow's stateless generator on TensorFlow, JAX's on
        JAX: the two draw different numbers). Override for another noise
        distribution."""
        return steps.model_noise(self, batch_size)

    def compute_gan_losses(self, real_logits, fake_logits):
        """`(d_losses, g_losses)`, `[B]` each; `gan_losses` by default."""
        return gan_losses(real_logits, fake_logits)

    def train_step(self, *state_and_data):
        """The backend's step (`gan_tensorflow` or `gan_jax`): one forward
        pass, each network's gradient of its own `[B]` losses, then
        `apply_model_gradients` with both optimizers (each model takes the
        step only where both its losses and all its gradients are finite;
        a diverging one is frozen, as in `FusedModel`)."""
        return steps.train_fused_gan(self, *state_and_data)

    def test_step(self, *state_and_data):
        """The backend's evaluation step (`gan_tensorflow` or `gan_jax`)
        around `evaluate_batch`."""
        return steps.test_fused_gan(self, *state_and_data)

    def evaluate_batch(self, data):
        """Tracks the losses of one batch in inference mode; returns the
        logs."""
        real, noise = self.unpack_data(data)
        d_losses, g_losses = self.gan_losses_of(real, noise, training=False)
        return self.track_gan(ops.shape(real)[0], d_losses, g_losses)

    def generate(self, noise, training=False):
        """The B generators' images for `noise`, shared `[batch, latent]` or
        per model `[batch, B, latent]`: `[batch, B, H, W, C]`."""
        noise = ops.convert_to_tensor(noise, "float32")
        if len(noise.shape) == 2:
            noise = ops.broadcast_to(ops.expand_dims(noise, 1), (
                ops.shape(noise)[0], self.num_models, noise.shape[-1]))
        return self.generator(noise, training=training)

    def gan_losses_of(self, real, noise, training):
        """`(d_losses, g_losses)`, `[B]` each, of one forward pass."""
        fake = self.generator(noise, training=training)
        real_logits = self.discriminator(real, training=training)
        fake_logits = self.discriminator(fake, training=training)
        return self.compute_gan_losses(real_logits, fake_logits)

    def unpack_data(self, data):
        """`(real [batch, B, H, W, C], noise [batch, B, latent])` of a
        batch (noise drawn by `sample_noise` where the data give none)."""
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

    def track_gan(self, batch_size, d_losses, g_losses):
        """Updates the per-model loss trackers; returns the logs."""
        diverged = self._status.diverged > 0
        for tracker, losses in ((self._d_loss_tracker, d_losses),
                                (self._g_loss_tracker, g_losses)):
            losses = ops.where(diverged, float("nan"), losses)
            tracker.update_state(unscale_loss_for_distribution(losses),
                                 sample_weight=batch_size)
        return self.get_metrics_result()

    # -- metrics ------------------------------------------------------------

    @property
    def metrics_variables(self):
        # On JAX the generator's optimizer rides in the step's state here
        # (Keras's state holds one optimizer, the discriminator's).
        return super().metrics_variables + steps.extra_state_variables(self)

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
            if self._traced(values):
                # One `[B]` entry, split into the `name_b` on the host.
                logs[models_log_name(tracker.name)] = values
                continue
            for index, value in enumerate(self._model_values(values)):
                logs[model_log_name(tracker.name, index)] = value
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
