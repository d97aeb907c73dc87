"""BERT-style masked-language-model data from the zoo's text corpus
(`hftatf.models.text`): sentence-pair examples, BERT's masking, the loss
that ignores unmasked positions, and the `masked_lm_data` recipe.
"""

import keras
import numpy as np

from hftatf.models.batches import (
    ArrayBatches,
    batched,
    require_tensorflow,
    uses_tf_data,
)
from hftatf.models.text import (
    CLS_ID,
    IGNORED_LABEL,
    MASK_ID,
    PAD_ID,
    SEP_ID,
    SPECIAL_TOKENS,
    check_positive,
    corpus,
)


def masked_lm_examples(documents, sequence_length):
    """Sentence-pair examples as BERT is pre-trained on, before masking.

    Each document is cut into consecutive pieces of `sequence_length - 3`
    tokens; a piece becomes `[CLS] A [SEP] B [SEP]`, A and B its two halves,
    padded with 0 to `sequence_length`. Segment ids are 0 over `[CLS] A
    [SEP]` and 1 over `B [SEP]` (0 over padding).

    Returns:
        `(token_ids, segment_ids)`, `[n, sequence_length]` int32 each.
    """
    check_positive("sequence_length", sequence_length)
    if sequence_length < 5:
        raise ValueError(
            "`sequence_length` must be at least 5 ([CLS] A [SEP] B [SEP] "
            f"with A, B not empty). Received: {sequence_length}.")
    piece = sequence_length - 3
    token_rows, segment_rows = [], []
    for document in documents:
        for start in range(0, len(document), piece):
            chunk = document[start:start + piece]
            if len(chunk) < 2:
                continue
            half = (len(chunk) + 1) // 2
            first, second = chunk[:half], chunk[half:]
            tokens = np.concatenate(
                [[CLS_ID], first, [SEP_ID], second, [SEP_ID]])
            segments = np.concatenate([np.zeros(len(first) + 2),
                                       np.ones(len(second) + 1)])
            token_rows.append(_pad(tokens, sequence_length))
            segment_rows.append(_pad(segments, sequence_length))
    if not token_rows:
        raise ValueError("The documents hold no example of at least 2 tokens.")
    return (np.stack(token_rows).astype("int32"),
            np.stack(segment_rows).astype("int32"))


def _pad(values, length):
    return np.pad(values, (0, length - len(values)))


def mask_tokens(token_ids, seed, vocabulary_size, mask_rate=0.15):
    """BERT's masking of `token_ids` (int, any shape), drawn from `seed`.

    Each token other than `[PAD]`, `[CLS]`, `[SEP]` and `[MASK]` is chosen
    with probability `mask_rate`. A chosen token is replaced by `[MASK]`
    (80%), by a random regular token (10%) or kept (10%); its label is its
    original id. Every other position is labelled `IGNORED_LABEL` (-1).

    Args:
        token_ids: int ids.
        seed: two integers (`tf.random` stateless seed); the same seed
            gives the same masking.
        vocabulary_size: the size of the vocabulary random tokens come from
            (ids `5 .. vocabulary_size - 1`).
        mask_rate: the probability of a token being chosen.

    Returns:
        `(masked_ids, labels)`, int32 tensors of `token_ids`' shape.
    """
    _check_mask_rate(mask_rate)
    tf = require_tensorflow("mask_tokens")
    token_ids = tf.cast(token_ids, "int32")
    shape = tf.shape(token_ids)
    choose, action, replace = tf.unstack(
        tf.random.experimental.stateless_split(
            tf.cast(seed, "int64"), num=3))
    maskable = tf.logical_not(tf.reduce_any(tf.equal(
        token_ids[..., None], [PAD_ID, CLS_ID, SEP_ID, MASK_ID]), axis=-1))
    chosen = maskable & (tf.random.stateless_uniform(shape, choose)
                         < mask_rate)
    draw = tf.random.stateless_uniform(shape, action)
    random_ids = tf.random.stateless_uniform(
        shape, replace, minval=len(SPECIAL_TOKENS), maxval=vocabulary_size,
        dtype="int32")
    masked = tf.where(chosen & (draw < 0.8), MASK_ID, tf.where(
        chosen & (draw < 0.9), random_ids, token_ids))
    labels = tf.where(chosen, token_ids, IGNORED_LABEL)
    return masked, labels


def mask_token_array(token_ids, rng, vocabulary_size, mask_rate=0.15):
    """`mask_tokens` in NumPy, drawn from the generator `rng`: the same
    rule (chosen with probability `mask_rate`; `[MASK]` 80%, a random
    regular token 10%, kept 10%), from NumPy's random stream.

    Returns:
        `(masked_ids, labels)`, int32 arrays of `token_ids`' shape.
    """
    _check_mask_rate(mask_rate)
    token_ids = np.asarray(token_ids, "int32")
    maskable = ~np.isin(token_ids, [PAD_ID, CLS_ID, SEP_ID, MASK_ID])
    chosen = maskable & (rng.uniform(size=token_ids.shape) < mask_rate)
    draw = rng.uniform(size=token_ids.shape)
    random_ids = rng.integers(len(SPECIAL_TOKENS), vocabulary_size,
                              token_ids.shape, dtype="int32")
    masked = np.where(chosen & (draw < 0.8), MASK_ID, np.where(
        chosen & (draw < 0.9), random_ids, token_ids))
    labels = np.where(chosen, token_ids, IGNORED_LABEL)
    return masked.astype("int32"), labels.astype("int32")


def _check_mask_rate(mask_rate):
    if not 0.0 < mask_rate < 1.0:
        raise ValueError(
            f"`mask_rate` must be in (0, 1). Received: mask_rate={mask_rate}.")


def masked_lm_loss():
    """The masked-language-model loss: cross-entropy of the logits at the
    labelled positions, averaged over them (labels -1 are ignored)."""
    return keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, ignore_class=IGNORED_LABEL)


def masked_lm_data(batch_size, seed=0, sequence_length=64,
                   vocabulary_size=2000, validation_fraction=0.1,
                   mask_rate=0.15, source=None, shuffle=True):
    """The masked-language-model data recipe: `(train, validation)`.

    Each element is a batch `({"token_ids", "segment_ids"}, labels)`, all
    `[batch, sequence_length]` int32: the examples of `masked_lm_examples`
    masked by `mask_tokens` (on other backends than TensorFlow, by
    `mask_token_array` in `ArrayBatches`, from `(seed, epoch, batch)`).
    Training batches are masked anew every epoch
    (a deterministic sequence of masks for a given seed and TensorFlow
    global seed, which `keras.utils.set_random_seed` sets); validation
    batches are masked the same way every time, from `seed` alone, so
    validation losses are comparable across epochs, runs and processes.
    Train with `masked_lm_loss()`.

    Args:
        batch_size: examples per batch (training drops the last partial
            batch).
        seed: seeds the document split, the shuffling and the masking.
        sequence_length: tokens per example, `[CLS]` and `[SEP]`s included.
        vocabulary_size, validation_fraction: as for `corpus`.
        mask_rate: the share of tokens to predict.
        source: the text, as for `load_texts`.
        shuffle: whether training examples are reshuffled every epoch.
    """
    check_positive("batch_size", batch_size)
    text = corpus(source, vocabulary_size, validation_fraction, seed)
    size = text.vocabulary_size
    _check_mask_rate(mask_rate)
    if not uses_tf_data():
        return tuple(_masked_arrays(
            masked_lm_examples(documents, sequence_length), batch_size,
            seed, train, shuffle, size, mask_rate)
            for documents, train in ((text.train, True),
                                     (text.validation, False)))
    tf = require_tensorflow("A tf.data pipeline")

    def masked(examples, train):
        dataset = batched(examples, batch_size,
                          seed if shuffle and train else None,
                          drop_remainder=train)
        if train:
            seeds = tf.data.Dataset.random(
                seed=seed, rerandomize_each_iteration=True).batch(2)
        else:
            # Batch i's masks from (seed, i) alone: the same in every
            # process, whatever TensorFlow's global seed.
            seeds = tf.data.Dataset.counter().map(
                lambda index: tf.stack([tf.cast(seed, "int64"), index]))

        def apply(batch, pair_seed):
            tokens, segments = batch
            masked_ids, labels = mask_tokens(tokens, pair_seed, size,
                                             mask_rate)
            return {"token_ids": masked_ids, "segment_ids": segments}, labels

        return tf.data.Dataset.zip((dataset, seeds)).map(
            apply, num_parallel_calls=tf.data.AUTOTUNE)

    return (masked(masked_lm_examples(text.train, sequence_length), True),
            masked(masked_lm_examples(text.validation, sequence_length),
                   False))


def _masked_arrays(examples, batch_size, seed, train, shuffle,
                   vocabulary_size, mask_rate):
    """`masked_lm_data`'s batches as `ArrayBatches`: training ones masked
    anew every epoch, validation ones the same way every time."""

    def apply(batch, rng):
        tokens, segments = batch
        masked_ids, labels = mask_token_array(tokens, rng, vocabulary_size,
                                              mask_rate)
        return {"token_ids": masked_ids, "segment_ids": segments}, labels

    return ArrayBatches(examples, batch_size,
                        seed=seed if shuffle and train else None,
                        drop_remainder=train, transform=apply,
                        transform_seed=seed, transform_each_epoch=train)
