"""DCGAN builders and FusedGAN against B stock GANs (the oracle)."""

import keras
import numpy as np
import pytest
from testing import STEP_JIT, STOCK_NETWORK, assert_close, value_and_gradients

import hftatf
from hftatf.models import dcgan, recipes

B = 2
LATENT = 8
G_RATES = [0.05, 0.02]
D_RATES = [0.1, 0.03]


def small_gan(dropout=0.0):
    return dcgan.build(latent_dim=LATENT, image_size=8, filters=4,
                       dropout=dropout)


def images(n=16, size=8, seed=0):
    rng = np.random.default_rng(seed)
    return rng.uniform(-1, 1, (n, size, size, 1)).astype("float32")


def fused_gan(num_models=B, start=None):
    """A compiled array of small GANs; with `start` (another array), a
    fresh array holding `start`'s weights."""
    gan = (hftatf.fuse(small_gan(), num_models, model_class=dcgan.FusedGAN)
           if start is None else hftatf.fuse_models(
               start.unfuse(), model_class=dcgan.FusedGAN))
    gan.compile(
        generator_optimizer=hftatf.optimizers.Adam(G_RATES, beta_1=0.5),
        discriminator_optimizer=hftatf.optimizers.SGD(D_RATES, momentum=0.5),
        jit_compile=STEP_JIT)
    return gan


# -- builders ---------------------------------------------------------------


@STOCK_NETWORK
@pytest.mark.parametrize("size", [8, 16, 32])
def test_builders_give_dcgan_shapes(size):
    generator = dcgan.build_generator(latent_dim=10, image_size=size,
                                      channels=3, filters=8)
    discriminator = dcgan.build_discriminator(image_size=size, channels=3,
                                              filters=8)
    noise = np.zeros((2, 10), "float32")
    generated = generator(noise)
    assert generated.shape == (2, size, size, 3)
    assert discriminator(generated).shape == (2, 1)
    # tanh images, and one ConvTranspose/Conv per doubling of 4x4.
    assert np.all(np.abs(generated) <= 1.0)
    ups = [layer for layer in generator.layers
           if isinstance(layer, keras.layers.Conv2DTranspose)]
    downs = [layer for layer in discriminator.layers
             if isinstance(layer, keras.layers.Conv2D)]
    assert len(ups) == len(downs) == int(np.log2(size // 4))


def test_32x32_parameter_count():
    generator = dcgan.build_generator(image_size=32)
    discriminator = dcgan.build_discriminator(image_size=32)
    # Dense 100 -> 4x4x256 (no bias), BN, 256->128->64 4x4 transposed
    # convolutions (no bias) with BN, 64->1 with bias.
    expected_g = (100 * 4096 + 4 * 4096 + 16 * 256 * 128 + 4 * 128
                  + 16 * 128 * 64 + 4 * 64 + 16 * 64 + 1)
    # 1->64->128->256 4x4 convolutions with biases, Dense 4096 -> 1.
    expected_d = (16 * 64 + 64 + 16 * 64 * 128 + 128 + 16 * 128 * 256 + 256
                  + 4096 + 1)
    assert generator.count_params() == expected_g
    assert discriminator.count_params() == expected_d


@pytest.mark.parametrize("size", [4, 12, 24, 8.0])
def test_image_size_must_be_four_times_a_power_of_two(size):
    with pytest.raises(ValueError, match="image_size"):
        dcgan.build_generator(image_size=size)


def test_gan_losses_are_the_stock_binary_crossentropies():
    rng = np.random.default_rng(0)
    real = rng.normal(size=(6, 3, 1)).astype("float32")
    fake = rng.normal(size=(6, 3, 1)).astype("float32")
    d_losses, g_losses = dcgan.gan_losses(real, fake)
    bce = keras.losses.BinaryCrossentropy(from_logits=True)
    for b in range(3):
        ones, zeros = np.ones((6, 1)), np.zeros((6, 1))
        assert_close(d_losses[b], bce(ones, real[:, b])
                     + bce(zeros, fake[:, b]))
        assert_close(g_losses[b], bce(ones, fake[:, b]))


# -- the stock GAN's step (the oracle's) on each backend --------------------


def test_stock_gan_step_applies_each_loss_to_its_own_network():
    model = small_gan()
    start = model.get_weights()
    x = images(8)
    noise = np.random.default_rng(4).normal(size=(8, LATENT)).astype(
        "float32")
    reference = dcgan.GAN(model)
    losses = {}
    gradients = {}
    for index, (name, network) in enumerate(
            (("d_loss", reference.discriminator),
             ("g_loss", reference.generator))):
        value, _, gradients[name] = value_and_gradients(
            lambda index=index: (reference.losses_of(x, noise)[index],) * 2,
            (),
            network.trainable_variables)
        losses[name] = float(keras.ops.convert_to_numpy(value))
    expected = {}
    for name, network, rate in (("d_loss", reference.discriminator, 0.1),
                                ("g_loss", reference.generator, 0.05)):
        for variable, gradient in zip(network.trainable_variables,
                                      gradients[name]):
            expected[variable.path] = keras.ops.convert_to_numpy(
                variable.value) - rate * np.asarray(gradient)

    model.set_weights(start)
    gan = dcgan.GAN(model)
    gan.compile(keras.optimizers.SGD(0.05), keras.optimizers.SGD(0.1))
    history = gan.fit({"images": x, "noise": noise}, batch_size=8,
                      epochs=1, shuffle=False, verbose=0).history
    for name in ("d_loss", "g_loss"):
        assert_close(history[name][0], losses[name], err_msg=name)
    for variable in (gan.generator.trainable_variables
                     + gan.discriminator.trainable_variables):
        assert_close(variable.value, expected[variable.path],
                     err_msg=variable.path)


# -- FusedGAN against stock GANs --------------------------------------------


def test_fused_gan_trains_as_stock_gans():
    gan = fused_gan()
    stock = gan.unfuse()
    x = images()
    noise = np.random.default_rng(1).normal(
        size=(len(x), B, LATENT)).astype("float32")
    # 16 images, batch 8: two steps.
    history = gan.fit({"images": x, "noise": noise}, batch_size=8, epochs=1,
                      shuffle=False, verbose=0)
    for b, model in enumerate(stock):
        reference = dcgan.GAN(model)
        reference.compile(keras.optimizers.Adam(G_RATES[b], beta_1=0.5),
                          keras.optimizers.SGD(D_RATES[b], momentum=0.5),
                          jit_compile=STEP_JIT)
        stock_history = reference.fit(
            {"images": x, "noise": noise[:, b]}, batch_size=8, epochs=1,
            shuffle=False, verbose=0)
        trained = gan.unfuse()[b]
        for ours, theirs in zip(trained.weights, model.weights):
            assert_close(ours, theirs, err_msg=f"model {b} {theirs.path}")
        for name in ("d_loss", "g_loss"):
            assert_close(history.history[f"{name}_{b}"],
                         stock_history.history[name])
    # The models really differ (own start, own learning rates).
    first, second = (m.get_weights()[0] for m in gan.unfuse())
    assert not np.allclose(first, second)


def dense_gan():
    """A GAN of Dense networks (BatchNormalization in the generator), as
    `combine` joins any generator and discriminator."""
    noise = keras.Input((LATENT,))
    hidden = keras.layers.BatchNormalization()(
        keras.layers.Dense(8, activation="relu")(noise))
    fake = keras.layers.Reshape((2, 2, 1))(
        keras.layers.Dense(4, activation="tanh")(hidden))
    real = keras.Input((2, 2, 1))
    hidden = keras.layers.Dense(6, activation="relu")(
        keras.layers.Flatten()(real))
    return dcgan.combine(keras.Model(noise, fake),
                         keras.Model(real, keras.layers.Dense(1)(hidden)))


def test_fused_gan_of_any_networks_trains_as_stock_gans():
    gan = hftatf.fuse(dense_gan(), B, model_class=dcgan.FusedGAN)
    gan.compile(
        generator_optimizer=hftatf.optimizers.Adam(G_RATES, beta_1=0.5),
        discriminator_optimizer=hftatf.optimizers.SGD(D_RATES, momentum=0.5))
    stock = gan.unfuse()
    x = images(16, size=2)
    noise = np.random.default_rng(1).normal(
        size=(len(x), B, LATENT)).astype("float32")
    history = gan.fit({"images": x, "noise": noise}, batch_size=8, epochs=1,
                      shuffle=False, verbose=0).history
    for b, model in enumerate(stock):
        reference = dcgan.GAN(model)
        reference.compile(keras.optimizers.Adam(G_RATES[b], beta_1=0.5),
                          keras.optimizers.SGD(D_RATES[b], momentum=0.5))
        stock_history = reference.fit(
            {"images": x, "noise": noise[:, b]}, batch_size=8, epochs=1,
            shuffle=False, verbose=0).history
        for ours, theirs in zip(gan.unfuse()[b].weights, model.weights):
            assert_close(ours, theirs, err_msg=f"model {b} {theirs.path}")
        for name in ("d_loss", "g_loss"):
            assert_close(history[f"{name}_{b}"], stock_history[name])
    # Noise drawn in the step, and evaluation.
    logs = gan.fit(x, batch_size=8, epochs=1, verbose=0).history
    assert np.isfinite(logs["d_loss"]).all()
    assert set(gan.evaluate(x, batch_size=8, verbose=0, return_dict=True)) == {
        "d_loss", "g_loss", "d_loss_0", "d_loss_1", "g_loss_0", "g_loss_1"}


def test_real_images_may_be_given_per_model():
    x = images(8)
    noise = np.random.default_rng(2).normal(
        size=(8, B, LATENT)).astype("float32")
    per_model = fused_gan()
    shared = fused_gan(start=per_model)
    per_model.train_on_batch(
        {"images": np.stack([x, images(8, seed=3)], axis=1), "noise": noise})
    shared.train_on_batch({"images": x, "noise": noise})
    for ours, theirs in zip(per_model.discriminator.get_weights(),
                            shared.discriminator.get_weights()):
        # Model 0 saw the same images both times; model 1 did not.
        assert_close(ours[0], theirs[0])
        assert not np.allclose(ours[1], theirs[1])


def test_noise_is_independent_per_model_and_step():
    gan = hftatf.fuse(small_gan(), 3, model_class=dcgan.FusedGAN)
    gan.compile(jit_compile=False)
    first = keras.ops.convert_to_numpy(gan.sample_noise(64))
    assert first.shape == (64, 3, LATENT)
    assert not np.allclose(first[:, 0], first[:, 1])
    again = keras.ops.convert_to_numpy(gan.sample_noise(64))
    np.testing.assert_array_equal(first, again)  # stateless in the step
    gan.optimizer.iterations.assign(1)
    assert not np.allclose(first, gan.sample_noise(64))
    assert abs(first.mean()) < 0.1 and abs(first.std() - 1.0) < 0.1
    # Model b's noise does not depend on how many models the array holds.
    pair = hftatf.fuse(small_gan(), 2, model_class=dcgan.FusedGAN)
    pair.compile(jit_compile=False)
    pair.noise_seed = gan.noise_seed
    pair.optimizer.iterations.assign(1)
    np.testing.assert_array_equal(pair.sample_noise(64),
                                  gan.sample_noise(64)[:, :2])


def test_a_diverging_model_leaves_the_other_untouched():
    x = np.stack([images(8), images(8)], axis=1)
    noise = np.random.default_rng(4).normal(
        size=(8, B, LATENT)).astype("float32")
    poisoned = x.copy()
    poisoned[0, 0, 0, 0, 0] = np.nan
    gan = fused_gan()
    clean = fused_gan(start=gan)
    start = [keras.ops.convert_to_numpy(w) for w in gan.trainable_weights]
    gan.train_on_batch({"images": poisoned, "noise": noise})
    clean.train_on_batch({"images": x, "noise": noise})
    assert list(gan.diverged_models) == [True, False]
    assert not any(clean.diverged_models)
    for ours, theirs in zip(gan.get_weights(), clean.get_weights()):
        np.testing.assert_array_equal(ours[1], theirs[1])
    # The diverged model kept its trainable weights (its BatchNormalization
    # statistics move in the forward pass, as in FusedModel).
    for variable, initial in zip(gan.trainable_weights, start):
        np.testing.assert_array_equal(variable.numpy()[0], initial[0])


def test_evaluate_and_generate():
    gan = fused_gan()
    logs = gan.evaluate(images(16), batch_size=8, verbose=0,
                        return_dict=True)
    assert set(logs) == {"d_loss", "g_loss", "d_loss_0", "d_loss_1",
                         "g_loss_0", "g_loss_1"}
    assert all(np.isfinite(v) for v in logs.values())
    shared = np.random.default_rng(5).normal(size=(4, LATENT))
    generated = keras.ops.convert_to_numpy(gan.generate(shared))
    assert generated.shape == (4, B, 8, 8, 1)
    for b, model in enumerate(gan.unfuse()):
        assert_close(generated[:, b], model.get_layer("generator")(shared))


# -- errors -----------------------------------------------------------------


def test_compile_refuses_a_loss():
    gan = hftatf.fuse(small_gan(), B, model_class=dcgan.FusedGAN)
    with pytest.raises(ValueError, match="gan_losses"):
        gan.compile(loss="mse")


def test_compile_defaults_and_optimizer_fallback():
    gan = hftatf.fuse(small_gan(), B, model_class=dcgan.FusedGAN)
    gan.compile(optimizer=hftatf.optimizers.Adam(1e-3))
    assert gan.generator_optimizer is not gan.discriminator_optimizer
    assert len(gan.generator_optimizer._trainable_variables) == len(
        gan.generator.trainable_variables)
    gan.compile()
    assert_close(gan.generator_optimizer.learning_rate, [2e-4] * B)
    assert_close(gan.generator_optimizer.get_hyperparameter("beta_1"),
                 [0.5] * B)


def test_model_without_generator_and_discriminator_is_refused():
    x = keras.Input((4,))
    plain = keras.Model(x, keras.layers.Dense(1)(x))
    with pytest.raises(ValueError, match="'generator' and 'discriminator'"):
        hftatf.fuse(plain, B, model_class=dcgan.FusedGAN)


def test_wrong_image_and_noise_shapes_are_refused():
    gan = fused_gan()
    with pytest.raises(ValueError, match="real images of shape"):
        gan.train_on_batch(np.zeros((4, 16, 16, 1), "float32"))
    with pytest.raises(ValueError, match="noise of shape"):
        gan.train_on_batch({"images": images(4),
                            "noise": np.zeros((4, LATENT), "float32")})


# -- serialization and export -----------------------------------------------


def test_config_round_trip_keeps_the_class_and_noise_seed():
    gan = hftatf.fuse(small_gan(), B, model_class=dcgan.FusedGAN)
    gan.noise_seed = 1234
    again = dcgan.FusedGAN.from_config(gan.get_config())
    assert type(again) is dcgan.FusedGAN
    assert again.num_models == B and again.noise_seed == 1234
    assert [w.shape for w in again.weights] == [w.shape for w in gan.weights]


def test_keras_file_round_trip_of_a_trained_gan(tmp_path):
    gan = fused_gan()
    gan.fit(images(16), batch_size=8, epochs=1, verbose=0)
    gan.save(tmp_path / "gan.keras")
    loaded = keras.models.load_model(tmp_path / "gan.keras")
    assert type(loaded) is dcgan.FusedGAN
    for ours, theirs in zip(loaded.weights, gan.weights):
        np.testing.assert_array_equal(ours, theirs)
    assert_close(loaded.generator_optimizer.learning_rate, G_RATES)
    assert_close(loaded.discriminator_optimizer.learning_rate, D_RATES)
    # Both optimizers' states (moments, momenta, step counts) come back.
    for ours, theirs in ((loaded.generator_optimizer, gan.generator_optimizer),
                         (loaded.optimizer, gan.optimizer)):
        assert len(ours.variables) == len(theirs.variables)
        for mine, original in zip(ours.variables, theirs.variables):
            np.testing.assert_array_equal(mine, original)


def test_export_round_trip(tmp_path):
    gan = fused_gan()
    gan.fit(images(16), batch_size=8, epochs=1, verbose=0)
    hftatf.export_models(gan, tmp_path, format="keras")
    noise = np.random.default_rng(6).normal(size=(5, LATENT)).astype(
        "float32")
    logits = gan.predict(noise, verbose=0)
    generated = keras.ops.convert_to_numpy(gan.generate(noise))
    for b in range(B):
        model = keras.models.load_model(tmp_path / f"model_{b}" /
                                        "model.keras")
        assert_close(model.predict(noise, verbose=0), logits[:, b])
        assert_close(model.get_layer("generator")(noise), generated[:, b])


def test_recipe():
    recipe = recipes.get("dcgan")
    assert recipe.model_class is dcgan.FusedGAN
    model = recipe.build(**recipe.model_args)
    train, validation = recipe.data(8, **recipe.data_args)
    batch = next(iter(train))
    assert tuple(batch.shape[1:]) == model.get_layer(
        "discriminator").input_shape[1:]
    assert float(np.min(batch)) >= -1.0 and float(np.max(batch)) <= 1.0


# -- convergence ------------------------------------------------------------


@pytest.mark.full_scale
def test_gan_array_trains_on_digits_with_finite_losses():
    recipe = recipes.get("dcgan")
    train, validation = recipe.data(64, **recipe.data_args)
    gan = hftatf.fuse(recipe.build(**recipe.model_args), 3,
                      model_class=dcgan.FusedGAN)
    gan.compile(
        generator_optimizer=hftatf.optimizers.Adam([2e-4, 5e-4, 1e-3],
                                                   beta_1=0.5),
        discriminator_optimizer=hftatf.optimizers.Adam([2e-4, 2e-4, 5e-4],
                                                       beta_1=0.5))
    history = gan.fit(train, epochs=8, validation_data=validation,
                      verbose=0)
    for name, values in history.history.items():
        assert np.all(np.isfinite(values)), name
    assert not any(gan.diverged_models)
    # The generators moved away from their start: their images differ
    # between noise draws.
    samples = keras.ops.convert_to_numpy(gan.generate(
        np.random.default_rng(0).normal(size=(16, 64))))
    assert np.all(samples.std(axis=0).mean(axis=(1, 2, 3)) > 0.05)
