"""What running a layer once per model costs: keras.io's Transformer text
classifier written with layers of its own, against the same model written
with stock layers only, side by side.

keras.io's "Text classification with Transformer" defines two layers of
its own, `TokenAndPositionEmbedding` and `TransformerBlock`, made of stock
layers and `keras.ops`. hftatf has no fused form for them, so an array runs
each once per model (`hftatf.layers.FusedPerModel`); the same computation
written with stock layers in a functional model fuses layer by layer. For
each B it trains, in rounds that alternate them,

  * serial: B stock models (the functional one), each with stock `fit`,
    one after another;
  * fused: the array of the functional model (every layer fused);
  * per_model: the array of the model with the layers of its own;

and prints model-samples per second and the ratios of side-by-side rounds
(medians): per_model / serial, fused / serial and per_model / fused, in
wall-clock and in processor time.

    python -m benchmarks.per_model
    python -m benchmarks.per_model --num_models 1,4,8 --steps 20 --rounds 3
"""

import argparse
import os
import statistics
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import layers, ops  # noqa: E402

import hftatf  # noqa: E402
from benchmarks import flags  # noqa: E402
from benchmarks.measure import timed_fit  # noqa: E402

VOCAB, MAXLEN, EMBED, HEADS, FF = 2000, 64, 32, 2, 64


class TokenAndPositionEmbedding(layers.Layer):
    """keras.io's token and position embedding."""

    def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = layers.Embedding(vocab_size, embed_dim)
        self.pos_emb = layers.Embedding(maxlen, embed_dim)

    def call(self, x):
        positions = self.pos_emb(ops.arange(0, ops.shape(x)[-1]))
        return self.token_emb(x) + positions


class TransformerBlock(layers.Layer):
    """keras.io's Transformer block."""

    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.att = layers.MultiHeadAttention(num_heads=num_heads,
                                             key_dim=embed_dim)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"),
                                     layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs, training=None):
        attention = self.dropout1(self.att(inputs, inputs), training=training)
        out1 = self.layernorm1(inputs + attention)
        ffn = self.dropout2(self.ffn(out1), training=training)
        return self.layernorm2(out1 + ffn)


def own_layers_model():
    """keras.io's classifier, with its layers of its own."""
    inputs = keras.Input((MAXLEN,), dtype="int32")
    hidden = TokenAndPositionEmbedding(MAXLEN, VOCAB, EMBED)(inputs)
    hidden = TransformerBlock(EMBED, HEADS, FF)(hidden)
    hidden = layers.GlobalAveragePooling1D()(hidden)
    hidden = layers.Dropout(0.1)(hidden)
    hidden = layers.Dense(20, activation="relu")(hidden)
    hidden = layers.Dropout(0.1)(hidden)
    return keras.Model(inputs, layers.Dense(2, activation="softmax")(hidden))


def stock_layers_model():
    """The same model, every layer a stock one (positions looked up per
    sample)."""
    inputs = keras.Input((MAXLEN,), dtype="int32")
    tokens = layers.Embedding(VOCAB, EMBED)(inputs)
    # The positions of each sample's tokens (a functional graph has no
    # tensor without a batch axis to look them up from).
    positions = layers.Embedding(MAXLEN, EMBED)(
        ops.cumsum(ops.ones_like(inputs), axis=1) - 1)
    hidden = tokens + positions
    attention = layers.MultiHeadAttention(HEADS, EMBED)(hidden, hidden)
    out1 = layers.LayerNormalization(epsilon=1e-6)(
        hidden + layers.Dropout(0.1)(attention))
    ffn = layers.Dense(EMBED)(layers.Dense(FF, activation="relu")(out1))
    hidden = layers.LayerNormalization(epsilon=1e-6)(
        out1 + layers.Dropout(0.1)(ffn))
    hidden = layers.GlobalAveragePooling1D()(hidden)
    hidden = layers.Dropout(0.1)(hidden)
    hidden = layers.Dense(20, activation="relu")(hidden)
    hidden = layers.Dropout(0.1)(hidden)
    return keras.Model(inputs, layers.Dense(2, activation="softmax")(hidden))


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.per_model",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("--num_models", default="1,4,8",
                        help="comma-separated array sizes B")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10,
                        help="timed steps per model and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup_steps", type=int, default=3,
                        help="untimed steps before each timed fit")
    args = parser.parse_args(argv)
    args.num_models = flags.array_sizes(parser, args.num_models)
    flags.check_minimums(parser, args, dict.fromkeys(
        ("batch_size", "steps", "rounds", "warmup_steps"), 1))
    return args


def dataset(batch_size, steps, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCAB, (batch_size * steps, MAXLEN)).astype("int32")
    y = rng.integers(0, 2, (batch_size * steps,))
    return x, y


def seconds(timer):
    return sum(timer.durations), sum(timer.cpu_durations)


def measure(args, num_models):
    """Per round: (wall, processor) seconds of serial, fused and
    per_model for the same model-samples."""
    x, y = dataset(args.batch_size, args.steps)
    stock = []
    for _ in range(num_models):
        model = stock_layers_model()
        model.compile("adam", "sparse_categorical_crossentropy")
        stock.append(model)
    arrays = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the per-model warning
        for name, build in (("fused", stock_layers_model),
                            ("per_model", own_layers_model)):
            array = hftatf.fuse(build(), num_models)
            array.compile(hftatf.optimizers.Adam(),
                          "sparse_categorical_crossentropy")
            arrays[name] = array
    rounds = []
    for _ in range(args.rounds):
        times = {"serial": [0.0, 0.0]}
        for model in stock:
            wall, cpu = seconds(timed_fit(
                model, _batches(x, y, args.batch_size), args.steps, 1,
                args.warmup_steps))
            times["serial"][0] += wall
            times["serial"][1] += cpu
        for name, array in arrays.items():
            times[name] = list(seconds(timed_fit(
                array, _batches(x, y, args.batch_size), args.steps, 1,
                args.warmup_steps)))
        rounds.append(times)
    return rounds


def _batches(x, y, batch_size):
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices((x, y)).batch(
        batch_size).repeat()


def ratio(rounds, top, bottom, index):
    """Median over rounds of time(bottom) / time(top): the speedup of
    `top` over `bottom`."""
    return statistics.median(r[bottom][index] / r[top][index]
                             for r in rounds)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    print(f"{'B':>3} {'serial/s':>10} {'fused/s':>10} {'per_model/s':>12} "
          f"{'per_model/serial':>17} {'fused/serial':>13} "
          f"{'per_model/fused':>16}  (wall; processor time in brackets)")
    for num_models in args.num_models:
        rounds = measure(args, num_models)
        samples = num_models * args.batch_size * args.steps

        def rate(name, rounds=rounds, samples=samples):
            return samples / statistics.median(r[name][0] for r in rounds)

        cells = []
        for top, bottom in (("per_model", "serial"), ("fused", "serial"),
                            ("per_model", "fused")):
            cells.append(f"{ratio(rounds, top, bottom, 0):.2f} "
                         f"({ratio(rounds, top, bottom, 1):.2f})")
        print(f"{num_models:>3} {rate('serial'):>10.0f} "
              f"{rate('fused'):>10.0f} {rate('per_model'):>12.0f} "
              f"{cells[0]:>17} {cells[1]:>13} {cells[2]:>16}", flush=True)


if __name__ == "__main__":
    main()
