"""Random draws in an array's training step take their keys straight from
their seeds (`hftatf.seeds`)."""

import keras
import numpy as np
import pytest

import hftatf
from hftatf import seeds

pytestmark = pytest.mark.backends(
    "tensorflow", reason="hftatf.seeds changes how TensorFlow's stateless "
    "random ops take their keys; JAX draws from its keys already")
tf = pytest.importorskip("tensorflow")

SHAPE = (100_000,)
AUTO_SELECT = 3  # TensorFlow's default stateless algorithm.


def uniform(seed):
    return tf.random.stateless_uniform(SHAPE, seed=seed).numpy()


def test_draws_in_the_context_take_the_seed_bits_as_key():
    assert seeds.supported()
    hashed = uniform([3, 7])
    with seeds.keys_from_seeds():
        keyed = uniform([3, 7])
    expected = tf.raw_ops.StatelessRandomUniformV2(
        shape=SHAPE, key=tf.constant([3 + (7 << 32)], tf.uint64),
        counter=tf.zeros([2], tf.uint64), alg=AUTO_SELECT).numpy()
    np.testing.assert_array_equal(keyed, expected)
    assert np.abs(keyed - hashed).max() > 0.5
    # Outside the context, draws hash their seeds again.
    np.testing.assert_array_equal(uniform([3, 7]), hashed)


# The pieces `seeds._tensorflow_parts` finds after the module itself.
@pytest.mark.parametrize("missing", [
    "_get_key_counter", "_uint32s_to_uint64", "Algorithm.AUTO_SELECT"])
def test_without_any_tensorflow_piece_it_needs_the_context_changes_nothing(
        monkeypatch, missing):
    hashed = uniform([5, 9])
    module, *pieces = seeds._tensorflow_parts()
    pieces[["_get_key_counter", "_uint32s_to_uint64",
            "Algorithm.AUTO_SELECT"].index(missing)] = None
    monkeypatch.setattr(seeds, "_tensorflow_parts",
                        lambda: (module, *pieces))
    assert not seeds.supported()
    with seeds.keys_from_seeds():
        np.testing.assert_array_equal(uniform([5, 9]), hashed)


def test_nested_contexts_restore_the_hash_at_the_outermost_exit():
    hashed = uniform([1, 2])
    with seeds.keys_from_seeds():
        keyed = uniform([1, 2])
        with seeds.keys_from_seeds():
            np.testing.assert_array_equal(uniform([1, 2]), keyed)
        np.testing.assert_array_equal(uniform([1, 2]), keyed)
    np.testing.assert_array_equal(uniform([1, 2]), hashed)


def test_an_explicit_algorithm_keeps_its_own_keys():
    def philox():
        return tf.random.stateless_uniform(SHAPE, seed=[5, 6],
                                           alg="philox").numpy()

    outside = philox()
    with seeds.keys_from_seeds():
        np.testing.assert_array_equal(philox(), outside)


def test_seeds_a_generator_gives_in_turn_draw_unrelated_numbers():
    # A SeedGenerator's successive seeds differ by one in one word: their
    # keys do too. Philox must still give uniform, uncorrelated streams.
    generator = keras.random.SeedGenerator(1234)
    with seeds.keys_from_seeds():
        draws = np.stack([keras.random.uniform(SHAPE, seed=generator).numpy()
                          for _ in range(4)])
        normal = keras.random.normal(SHAPE, seed=generator).numpy()
        masks = np.stack([keras.random.dropout(
            tf.ones(SHAPE), 0.3, seed=generator).numpy() == 0
            for _ in range(2)])
    # Standard errors: 0.0009 for a mean, 0.0032 for a correlation.
    np.testing.assert_allclose(draws.mean(axis=1), 0.5, atol=0.005)
    np.testing.assert_allclose(draws.var(axis=1), 1 / 12, atol=0.002)
    correlations = np.corrcoef(draws)[np.triu_indices(4, 1)]
    assert np.abs(correlations).max() < 0.02, correlations
    assert abs(normal.mean()) < 0.02 and abs(normal.std() - 1) < 0.01
    np.testing.assert_allclose(masks.mean(axis=1), 0.3, atol=0.005)
    assert abs(np.corrcoef(masks)[0, 1]) < 0.02


def network():
    x = keras.Input((6,))
    h = keras.layers.Dense(16, activation="relu")(x)
    h = keras.layers.Dropout(0.5)(h)
    h = keras.layers.GaussianNoise(0.1)(h)
    return keras.Model(x, keras.layers.Dense(2)(h))


def step_ops(function, *args):
    """The op types of `function`'s graph and of every function in it
    (loop bodies included)."""
    graph = tf.function(function).get_concrete_function(
        *args).graph.as_graph_def()
    types = {node.op for node in graph.node}
    for library_function in graph.library.function:
        types.update(node.op for node in library_function.node_def)
    return types


@pytest.mark.parametrize("jit_compile, models_per_pass", [
    (True, 1),  # passes as one loop
    (False, None),  # one pass
])
def test_training_steps_draw_without_hashing_seeds(monkeypatch, jit_compile,
                                                   models_per_pass):
    keyed = []
    original = seeds.key_counter_from_seed

    def counting(seed):
        keyed.append(seed)
        return original(seed)

    monkeypatch.setattr(seeds, "key_counter_from_seed", counting)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 6)).astype("float32")
    y = rng.integers(0, 2, size=(16,))
    array = hftatf.fuse(network(), 3)
    array.compile("sgd", loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), jit_compile=jit_compile,
        models_per_pass=models_per_pass)
    array.fit(x, y, batch_size=8, epochs=1, verbose=0)
    # Two random layers, in each pass the step traced.
    assert len(keyed) >= 2
    data = (tf.constant(x[:8]), tf.constant(y[:8]))
    assert "StatelessRandomGetKeyCounter" not in step_ops(
        array._train_step_keyed, data)
    # What the context changes: the same step traced without it hashes.
    assert "StatelessRandomGetKeyCounter" in step_ops(array.train_step, data)
