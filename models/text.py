"""Text data that needs no download, for the zoo's language models.

The default corpus is the English reference documentation that ships with
every CPython: `pydoc_data.topics.topics`, 79 topics (the language
reference's chapters on statements, operators, types, ...), about 465,000
characters. Users' own text comes in through `load_texts` (strings, text
files, directories, glob patterns or a `tf.data.Dataset` of strings).
Batches are `tf.data` pipelines on the TensorFlow backend and
`keras.utils.PyDataset`s of NumPy arrays elsewhere (`batches`).

The text is split into documents (topics, files, dataset elements), the
documents into a training and a validation set (whole documents, so no
validation text is seen in training), and tokenised by a `WordTokenizer`
whose vocabulary is built from the training documents only. From there:

* `language_model_data`: `(token_ids, next_token_ids)` windows for a
  decoder-only language model, with `unigram_perplexity` as the baseline
  a model must beat;
* `masked_lm.masked_lm_data`: BERT-style masked-language-model batches,
  `({"token_ids", "segment_ids"}, labels)` with labels -1 where no token is
  predicted (train with `masked_lm_loss()`, which ignores them).
"""

import collections
import dataclasses
import functools
import glob
import math
import os
import pathlib
import re

import numpy as np

from hftatf.models.batches import batched

PAD, UNK, CLS, SEP, MASK = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"
# Ids 0..4, in this order: padding is 0, as `Embedding(mask_zero=True)` and
# the zoo's attention masks expect.
SPECIAL_TOKENS = (PAD, UNK, CLS, SEP, MASK)
PAD_ID, UNK_ID, CLS_ID, SEP_ID, MASK_ID = range(len(SPECIAL_TOKENS))
# The label of a position the masked-language-model loss ignores.
IGNORED_LABEL = -1

# Words, numbers, and runs of one punctuation character ("-----" is one
# token: reStructuredText rules would otherwise flood the corpus with easy
# predictions).
_TOKEN_PATTERN = re.compile(r"[^\W\d_]+|\d+|([^\w\s]|_)\1*")


class WordTokenizer:
    """A deterministic word-level tokenizer.

    Text is (optionally) lower-cased and split into words (runs of
    letters), numbers (runs of digits) and punctuation (runs of one
    character). Ids 0..4 are the special tokens `[PAD] [UNK] [CLS] [SEP]
    [MASK]`; the others are the most frequent tokens of the text the
    tokenizer was built from, by decreasing count, ties in alphabetical
    order, so the same text always gives the same vocabulary. Tokens
    outside the vocabulary become `[UNK]`.

    Args:
        vocabulary: the tokens of ids 5, 6, ... (the special tokens are
            added in front; they must not appear here).
        lowercase: whether text is lower-cased before it is split.
    """

    def __init__(self, vocabulary, lowercase=True):
        vocabulary = [str(token) for token in vocabulary]
        special = [t for t in vocabulary if t in SPECIAL_TOKENS]
        if special:
            raise ValueError(
                f"`vocabulary` must not contain the special tokens "
                f"{SPECIAL_TOKENS}; they get ids 0..{len(SPECIAL_TOKENS) - 1}"
                f" by themselves. Received: {special}.")
        if len(set(vocabulary)) != len(vocabulary):
            repeated = sorted(t for t, n in collections.Counter(
                vocabulary).items() if n > 1)
            raise ValueError(
                f"`vocabulary` lists tokens more than once: {repeated[:10]}. "
                "Give each token once.")
        self.lowercase = bool(lowercase)
        self._tokens = list(SPECIAL_TOKENS) + vocabulary
        self._ids = {token: index for index, token in enumerate(self._tokens)}

    @classmethod
    def from_texts(cls, texts, vocabulary_size=2000, lowercase=True):
        """Builds the vocabulary of the `vocabulary_size - 5` most frequent
        tokens of `texts` (an iterable of strings)."""
        if (not isinstance(vocabulary_size, int)
                or vocabulary_size <= len(SPECIAL_TOKENS)):
            raise ValueError(
                f"`vocabulary_size` must be an integer above "
                f"{len(SPECIAL_TOKENS)} (the special tokens). Received: "
                f"vocabulary_size={vocabulary_size!r}.")
        splitter = cls([], lowercase=lowercase)
        counts = collections.Counter()
        for text in texts:
            counts.update(splitter.split(text))
        for token in SPECIAL_TOKENS:
            counts.pop(token, None)
        ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
        size = vocabulary_size - len(SPECIAL_TOKENS)
        return cls([token for token, _ in ranked[:size]], lowercase=lowercase)

    @property
    def vocabulary(self):
        """Every token, by id (the special tokens first)."""
        return list(self._tokens)

    @property
    def vocabulary_size(self):
        """The number of ids, special tokens included."""
        return len(self._tokens)

    def split(self, text):
        """The tokens of `text` (strings, before the vocabulary lookup)."""
        if self.lowercase:
            text = text.lower()
        return [match.group(0) for match in _TOKEN_PATTERN.finditer(text)]

    def encode(self, text):
        """The ids of `text`'s tokens, `[num_tokens]` int32."""
        return np.array([self._ids.get(token, UNK_ID)
                         for token in self.split(text)], dtype="int32")

    def decode(self, ids):
        """The tokens of `ids`, joined by spaces (padding left out)."""
        return " ".join(self._tokens[int(i)] for i in np.ravel(ids)
                        if int(i) != PAD_ID)

    def get_config(self):
        return {"vocabulary": self._tokens[len(SPECIAL_TOKENS):],
                "lowercase": self.lowercase}

    @classmethod
    def from_config(cls, config):
        return cls(**config)


# -- texts ------------------------------------------------------------------


def reference_texts():
    """The topics of CPython's bundled reference documentation, as a list of
    strings in the order of their (sorted) topic names."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def load_texts(source=None):
    """Returns a list of documents (strings) from `source`.

    Args:
        source: one of
            * None: CPython's reference documentation (`reference_texts`);
            * a `tf.data.Dataset` of strings (scalars or batches), e.g.
              `tf.data.TextLineDataset(files)` or a `TFRecordDataset`
              mapped to its text feature: one document per string;
            * a path (`str` or `os.PathLike`) to a text file (one document),
              a directory (every `*.txt` file below it, one document each,
              in sorted order) or a glob pattern (`"data/*.md"`);
            * a list of `pathlib.Path`s: those files;
            * a list of strings, or a dict whose values are strings: the
              documents themselves.

    Raises:
        ValueError: for a path that matches no file, or no document at all.
        TypeError: for any other kind of `source`.
    """
    if source is None:
        texts = reference_texts()
    elif _is_tf_dataset(source):
        texts = _dataset_texts(source)
    elif isinstance(source, (str, os.PathLike)):
        texts = [_read(path) for path in _expand_path(source)]
    elif isinstance(source, dict):
        texts = [str(source[key]) for key in sorted(source)]
    elif isinstance(source, (list, tuple)) and all(
            isinstance(item, pathlib.Path) for item in source) and source:
        texts = [_read(path) for path in source]
    elif isinstance(source, (list, tuple)) and all(
            isinstance(item, str) for item in source):
        texts = list(source)
    else:
        raise TypeError(
            "`source` must be None, a tf.data.Dataset of strings, a path, "
            "a list of pathlib.Path, a list of strings or a dict of strings. "
            f"Received: {source!r} of type {type(source).__name__}.")
    texts = [text for text in texts if text.strip()]
    if not texts:
        raise ValueError(f"No text found in source={source!r}.")
    return texts


def _is_tf_dataset(source):
    # Recognised without importing TensorFlow, which a tf.data.Dataset
    # brings with it.
    return any(cls.__module__.startswith("tensorflow") and cls.__name__ == (
        "DatasetV2") for cls in type(source).__mro__)


def _dataset_texts(dataset):
    texts = []
    for element in dataset.as_numpy_iterator():
        for value in np.ravel(element):
            texts.append(value.decode("utf-8") if isinstance(value, bytes)
                         else str(value))
    return texts


def _expand_path(source):
    path = pathlib.Path(source)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
    else:
        files = sorted(pathlib.Path(p) for p in glob.glob(
            str(source), recursive=True) if os.path.isfile(p))
    if not files:
        raise ValueError(
            f"No text file found at {str(source)!r}: pass an existing file, "
            "a directory holding *.txt files, or a glob pattern. To pass "
            "text itself, pass a list of strings.")
    return files


def _read(path):
    return pathlib.Path(path).read_text(encoding="utf-8", errors="replace")


# -- corpus -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TextCorpus:
    """Tokenised documents, split into training and validation.

    Attributes:
        tokenizer: the `WordTokenizer` (built from the training documents).
        train: the training documents, each `[num_tokens]` int32 ids.
        validation: the validation documents, likewise.
    """

    tokenizer: WordTokenizer
    train: tuple
    validation: tuple

    @property
    def vocabulary_size(self):
        return self.tokenizer.vocabulary_size


def corpus(source=None, vocabulary_size=2000, validation_fraction=0.1,
           seed=0, lowercase=True, tokenizer=None):
    """Loads, splits and tokenises a corpus.

    Whole documents go to validation, in a seeded random order, until they
    hold `validation_fraction` of the words (at least one document goes to
    each side).

    Args:
        source: the text, as for `load_texts` (None: CPython's reference
            documentation).
        vocabulary_size: the tokenizer's size, special tokens included.
        validation_fraction: the share of the text held out, in (0, 1).
        seed: the seed of the split.
        lowercase: whether the tokenizer lower-cases text.
        tokenizer: a `WordTokenizer` to use instead of building one (then
            `vocabulary_size` and `lowercase` are its own).

    Returns:
        A `TextCorpus`.
    """
    if source is None and tokenizer is None:
        return _reference_corpus(vocabulary_size, validation_fraction, seed,
                                 lowercase)
    return _build_corpus(load_texts(source), vocabulary_size,
                         validation_fraction, seed, lowercase, tokenizer)


@functools.lru_cache(maxsize=8)
def _reference_corpus(vocabulary_size, validation_fraction, seed, lowercase):
    return _build_corpus(reference_texts(), vocabulary_size,
                         validation_fraction, seed, lowercase, None)


def _build_corpus(texts, vocabulary_size, validation_fraction, seed,
                  lowercase, tokenizer):
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(
            "`validation_fraction` must be in (0, 1). Received: "
            f"validation_fraction={validation_fraction!r}.")
    if len(texts) < 2:
        raise ValueError(
            "A corpus needs at least 2 documents, one for training and one "
            f"for validation. Received {len(texts)}; split a long text into "
            "several documents (e.g. paragraphs) first.")
    order = np.random.default_rng(seed).permutation(len(texts))
    sizes = [len(text.split()) for text in texts]
    target = validation_fraction * sum(sizes)
    held_out, words = [], 0
    for index in order[:-1]:
        if words >= target:
            break
        held_out.append(index)
        words += sizes[index]
    held_out = set(held_out)
    train_texts = [t for i, t in enumerate(texts) if i not in held_out]
    val_texts = [t for i, t in enumerate(texts) if i in held_out]
    if tokenizer is None:
        tokenizer = WordTokenizer.from_texts(
            train_texts, vocabulary_size=vocabulary_size, lowercase=lowercase)
    return TextCorpus(
        tokenizer=tokenizer,
        train=tuple(tokenizer.encode(t) for t in train_texts),
        validation=tuple(tokenizer.encode(t) for t in val_texts))


# -- language-model windows -------------------------------------------------


def language_model_windows(documents, sequence_length):
    """Inputs and next-token targets, `[n, sequence_length]` int32 each.

    The documents are joined into one stream, each followed by `[SEP]`, and
    cut into consecutive windows of `sequence_length + 1` tokens that
    overlap by one (each window's last target is the next one's first
    input). The tail that does not fill a window is dropped.
    """
    check_positive("sequence_length", sequence_length)
    stream = np.concatenate([np.append(d, SEP_ID) for d in documents]).astype(
        "int32")
    count = (len(stream) - 1) // sequence_length
    if count < 1:
        raise ValueError(
            f"The text holds {len(stream)} tokens, too few for one window of "
            f"sequence_length={sequence_length}. Use shorter windows or more "
            "text.")
    starts = np.arange(count) * sequence_length
    windows = stream[starts[:, None] + np.arange(sequence_length + 1)]
    return windows[:, :-1], windows[:, 1:]


def unigram_perplexity(train_targets, validation_targets, vocabulary_size):
    """The perplexity on `validation_targets` of the unigram model of
    `train_targets` (token frequencies, add-one smoothed).

    A language model that learned anything from context beats it: its
    perplexity, `exp(validation loss)`, falls well below.
    """
    counts = np.bincount(np.ravel(train_targets).astype("int64"),
                         minlength=vocabulary_size).astype("float64") + 1.0
    log_probabilities = np.log(counts / counts.sum())
    targets = np.ravel(validation_targets).astype("int64")
    return float(math.exp(-log_probabilities[targets].mean()))


def language_model_data(batch_size, seed=0, sequence_length=64,
                        vocabulary_size=2000, validation_fraction=0.1,
                        source=None, shuffle=True):
    """The language-model data recipe: `(train, validation)` datasets.

    Each element is a batch `(token_ids, targets)`, both
    `[batch, sequence_length]` int32, `targets[:, t] = token_ids[:, t + 1]`
    in the text (see `language_model_windows`). Train with
    `keras.losses.SparseCategoricalCrossentropy(from_logits=True)`; the
    validation perplexity is `exp(val_loss)`.

    Args:
        batch_size: examples per batch. Training batches are all full (the
            last partial one is dropped); validation keeps every window.
        seed: seeds the document split and the shuffling.
        sequence_length: tokens per window.
        vocabulary_size, validation_fraction: as for `corpus`.
        source: the text, as for `load_texts` (None: CPython's reference
            documentation).
        shuffle: whether training windows are reshuffled every epoch.
    """
    check_positive("batch_size", batch_size)
    text = corpus(source, vocabulary_size, validation_fraction, seed)
    train = language_model_windows(text.train, sequence_length)
    validation = language_model_windows(text.validation, sequence_length)
    return (batched(train, batch_size, seed if shuffle else None,
                    drop_remainder=True),
            batched(validation, batch_size))


def language_model_baseline(seed=0, sequence_length=64, vocabulary_size=2000,
                            validation_fraction=0.1, source=None):
    """`unigram_perplexity` of the windows `language_model_data` gives for
    the same arguments: the perplexity a model must beat."""
    text = corpus(source, vocabulary_size, validation_fraction, seed)
    _, train_targets = language_model_windows(text.train, sequence_length)
    _, val_targets = language_model_windows(text.validation, sequence_length)
    return unigram_perplexity(train_targets, val_targets,
                              text.vocabulary_size)


def check_positive(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or (
            value < 1):
        raise ValueError(
            f"`{name}` must be a positive integer. Received: {name}={value!r}.")
