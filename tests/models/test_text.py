"""Text data without download: tokenizer, corpus split, language-model
windows, BERT masking (TensorFlow's and NumPy's), and users' own text."""

import itertools
import math
import pathlib

import keras
import numpy as np
import pytest

from hftatf.models import masked_lm, text


def first_batches(dataset, count=1):
    """The first `count` batches of one epoch, as NumPy; a PyDataset then
    moves to its next epoch, as after an epoch of fit."""
    taken = [keras.tree.map_structure(np.asarray, batch)
             for batch in itertools.islice(iter(dataset), count)]
    if hasattr(dataset, "on_epoch_end"):
        dataset.on_epoch_end()
    return taken

# -- tokenizer --------------------------------------------------------------


def test_tokenizer_vocabulary_is_deterministic_and_ranked():
    texts = ["b a a, c", "A b; b ... a"]
    tokenizer = text.WordTokenizer.from_texts(texts, vocabulary_size=9)
    # a: 4, b: 3, then ties (",", ";", "c", "...": 1) in sorted order.
    assert tokenizer.vocabulary == [
        *text.SPECIAL_TOKENS, "a", "b", ",", "..."]
    again = text.WordTokenizer.from_texts(list(reversed(texts)),
                                          vocabulary_size=9)
    assert again.vocabulary == tokenizer.vocabulary


def test_encode_decode_and_unknown_tokens():
    tokenizer = text.WordTokenizer(["the", "cat", "."])
    ids = tokenizer.encode("The cat sat.")
    assert ids.dtype == np.int32
    assert list(ids) == [5, 6, text.UNK_ID, 7]
    assert tokenizer.decode(np.append(ids, text.PAD_ID)) == (
        "the cat [UNK] .")
    assert text.WordTokenizer(["The"], lowercase=False).encode(
        "The the").tolist() == [5, text.UNK_ID]


def test_split_keeps_punctuation_runs_and_numbers():
    tokenizer = text.WordTokenizer([])
    assert tokenizer.split("x = 42 -----  __init__(y)") == [
        "x", "=", "42", "-----", "__", "init", "__", "(", "y", ")"]


def test_tokenizer_config_round_trip():
    tokenizer = text.WordTokenizer(["a", "b"], lowercase=False)
    again = text.WordTokenizer.from_config(tokenizer.get_config())
    assert again.vocabulary == tokenizer.vocabulary
    assert again.lowercase is False


@pytest.mark.parametrize("vocabulary, match", [
    (["a", "[MASK]"], "special tokens"),
    (["a", "b", "a"], "more than once"),
])
def test_bad_vocabulary_is_refused(vocabulary, match):
    with pytest.raises(ValueError, match=match):
        text.WordTokenizer(vocabulary)


def test_vocabulary_size_is_validated():
    with pytest.raises(ValueError, match="vocabulary_size"):
        text.WordTokenizer.from_texts(["a"], vocabulary_size=5)


# -- the reference corpus ---------------------------------------------------


def test_reference_corpus_split_is_by_document():
    documents = text.reference_texts()
    assert len(documents) > 50 and sum(map(len, documents)) > 300_000
    corpus = text.corpus(validation_fraction=0.1, seed=0)
    assert corpus.vocabulary_size == 2000
    assert len(corpus.train) + len(corpus.validation) == len(documents)
    train_tokens = sum(map(len, corpus.train))
    val_tokens = sum(map(len, corpus.validation))
    assert 0.05 < val_tokens / (train_tokens + val_tokens) < 0.3
    # Another seed holds out other documents.
    other = text.corpus(validation_fraction=0.1, seed=1)
    assert [len(d) for d in other.validation] != [
        len(d) for d in corpus.validation]


def test_vocabulary_comes_from_training_documents_only():
    texts = ["alpha beta", "alpha gamma", "delta delta"]
    corpus = text.corpus(texts, vocabulary_size=20, validation_fraction=0.3,
                         seed=0)
    assert len(corpus.train) == 2 and len(corpus.validation) == 1
    seen = {token for document in corpus.train
            for token in corpus.tokenizer.decode(document).split()}
    assert seen == set(corpus.tokenizer.vocabulary[5:])
    # Every document has a word of its own: validation meets [UNK].
    assert text.UNK_ID in corpus.validation[0]


# -- language-model windows -------------------------------------------------


def test_language_model_windows_are_shifted_and_consecutive():
    documents = [np.arange(10, 17), np.arange(20, 24)]
    inputs, targets = text.language_model_windows(documents, 4)
    stream = [*range(10, 17), text.SEP_ID, *range(20, 24), text.SEP_ID]
    assert inputs.shape == targets.shape == (3, 4)
    np.testing.assert_array_equal(inputs.ravel(), stream[:12])
    np.testing.assert_array_equal(targets.ravel(), stream[1:13])


def test_language_model_data_batches():
    train, validation = text.language_model_data(8, sequence_length=16,
                                                 vocabulary_size=500)
    (inputs, targets), = first_batches(train)
    assert inputs.shape == targets.shape == (8, 16)
    assert inputs.dtype == np.int32
    np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
    assert targets.max() < 500
    first = [np.asarray(b[0]) for b in validation]
    second = [np.asarray(b[0]) for b in validation]
    np.testing.assert_array_equal(np.concatenate(first),
                                  np.concatenate(second))


def test_unigram_perplexity():
    # Uniform training counts over 4 ids: perplexity 4 on anything.
    train = np.array([0, 1, 2, 3] * 5)
    assert math.isclose(text.unigram_perplexity(train, [2, 3, 0], 4), 4.0)
    # Add-one smoothing: counts 9+1, 0+1 -> p = 10/11, 1/11.
    expected = math.exp(-(math.log(10 / 11) + math.log(1 / 11)) / 2)
    assert math.isclose(text.unigram_perplexity([0] * 9, [0, 1], 2),
                        expected)


def test_baseline_of_the_reference_corpus():
    baseline = text.language_model_baseline(sequence_length=32,
                                            vocabulary_size=1000)
    assert 50 < baseline < 1000


# -- masked language model --------------------------------------------------


def test_masked_lm_examples_are_sentence_pairs():
    documents = [np.arange(10, 21)]
    tokens, segments = masked_lm.masked_lm_examples(documents, 8)
    # Pieces of 5: [10..14] -> halves of 3 and 2; [15..19]; [20] dropped.
    assert tokens.shape == (2, 8)
    np.testing.assert_array_equal(tokens[0], [text.CLS_ID, 10, 11, 12,
                                              text.SEP_ID, 13, 14,
                                              text.SEP_ID])
    np.testing.assert_array_equal(segments[0], [0, 0, 0, 0, 0, 1, 1, 1])
    short, short_segments = masked_lm.masked_lm_examples([np.arange(10, 14)], 8)
    np.testing.assert_array_equal(short[0], [text.CLS_ID, 10, 11,
                                             text.SEP_ID, 12, 13,
                                             text.SEP_ID, text.PAD_ID])
    np.testing.assert_array_equal(short_segments[0], [0, 0, 0, 0, 1, 1, 1, 0])


def tensorflow_masks(ids, seed):
    pytest.importorskip("tensorflow")
    return tuple(keras.ops.convert_to_numpy(t) for t in masked_lm.mask_tokens(
        ids, [seed, 4], 1000))


def numpy_masks(ids, seed):
    return masked_lm.mask_token_array(ids, np.random.default_rng(seed), 1000)


@pytest.mark.parametrize("masks", [tensorflow_masks, numpy_masks])
def test_mask_tokens_follows_bert(masks):
    rng = np.random.default_rng(0)
    ids = rng.integers(5, 1000, (400, 128)).astype("int32")
    ids[:, 0] = text.CLS_ID
    ids[:, 64] = text.SEP_ID
    ids[:, 100:] = text.PAD_ID
    masked, labels = masks(ids, 3)
    chosen = labels != text.IGNORED_LABEL
    np.testing.assert_array_equal(labels[chosen], ids[chosen])
    assert not chosen[:, [0, 64]].any() and not chosen[:, 100:].any()
    np.testing.assert_array_equal(masked[~chosen], ids[~chosen])
    maskable = 400 * 97
    assert abs(chosen.sum() / maskable - 0.15) < 0.01
    as_mask = (masked == text.MASK_ID)[chosen].mean()
    kept = (masked == ids)[chosen].mean()
    replaced = 1.0 - as_mask - kept
    assert abs(as_mask - 0.8) < 0.02
    # Random replacements may draw the original id (1 in 995).
    assert abs(kept - 0.1) < 0.015 and abs(replaced - 0.1) < 0.015
    random_ids = masked[chosen & (masked != text.MASK_ID) & (masked != ids)]
    assert random_ids.min() >= len(text.SPECIAL_TOKENS)
    np.testing.assert_array_equal(masks(ids, 3)[0], masked)


def test_mask_rate_is_validated():
    with pytest.raises(ValueError, match="mask_rate"):
        masked_lm.mask_tokens(np.ones((2, 3)), [0, 0], 10, mask_rate=1.5)
    with pytest.raises(ValueError, match="mask_rate"):
        masked_lm.mask_token_array(np.ones((2, 3)), np.random.default_rng(),
                                   10, mask_rate=0.0)
    with pytest.raises(ValueError, match="mask_rate"):
        masked_lm.masked_lm_data(4, mask_rate=1.0)


def test_masked_lm_data_masks_training_anew_and_validation_alike():
    train, validation = masked_lm.masked_lm_data(4, sequence_length=16,
                                                 vocabulary_size=500,
                                                 shuffle=False)
    (inputs, labels), = first_batches(train)
    assert set(inputs) == {"token_ids", "segment_ids"}
    assert inputs["token_ids"].shape == labels.shape == (4, 16)
    assert np.all(inputs["token_ids"][:, 0] == text.CLS_ID)
    epoch_1 = first_batches(train)[0][1]
    epoch_2 = first_batches(train)[0][1]
    assert not np.array_equal(epoch_1, epoch_2)
    np.testing.assert_array_equal(first_batches(validation)[0][1],
                                  first_batches(validation)[0][1])


def test_validation_masks_follow_the_seed_alone():
    # An exported model evaluated in another process sees the masks it was
    # validated on in training, whatever TensorFlow's global seed was.
    def validation_labels(global_seed, seed=0):
        if global_seed is not None:
            keras.utils.set_random_seed(global_seed)
        _, validation = masked_lm.masked_lm_data(
            4, seed=seed, sequence_length=16, vocabulary_size=500)
        return [labels for _, labels in first_batches(validation, 3)]

    first = validation_labels(None)
    for other in (validation_labels(0), validation_labels(123)):
        for ours, theirs in zip(first, other):
            np.testing.assert_array_equal(ours, theirs)
    assert not all(np.array_equal(ours, theirs) for ours, theirs in zip(
        first, validation_labels(None, seed=1)))


# -- users' own text --------------------------------------------------------


def test_load_texts_from_strings_dicts_and_datasets():
    assert text.load_texts(["one", " ", "two"]) == ["one", "two"]
    assert text.load_texts({"b": "second", "a": "first"}) == [
        "first", "second"]
    tf = pytest.importorskip("tensorflow")
    dataset = tf.data.Dataset.from_tensor_slices(["x y", "z", "w"]).batch(2)
    assert text.load_texts(dataset) == ["x y", "z", "w"]


def test_load_texts_from_files(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("second file")
    (tmp_path / "sub" / "a.txt").write_text("first file")
    (tmp_path / "notes.md").write_text("markdown")
    assert text.load_texts(tmp_path) == ["second file", "first file"]
    assert text.load_texts(str(tmp_path / "*.md")) == ["markdown"]
    assert text.load_texts(tmp_path / "b.txt") == ["second file"]
    assert text.load_texts([pathlib.Path(tmp_path / "notes.md")]) == [
        "markdown"]


def test_load_texts_errors(tmp_path):
    with pytest.raises(ValueError, match="No text file found"):
        text.load_texts(str(tmp_path / "missing*.txt"))
    with pytest.raises(TypeError, match="tf.data.Dataset of strings"):
        text.load_texts(42)
    with pytest.raises(ValueError, match="No text found"):
        text.load_texts(["", "  "])


def test_recipes_take_users_text(tmp_path):
    for index in range(3):
        (tmp_path / f"{index}.txt").write_text(
            " ".join(f"word{i % 7}" for i in range(200 + index)))
    train, validation = text.language_model_data(
        4, sequence_length=8, vocabulary_size=20, validation_fraction=0.3,
        source=tmp_path)
    (inputs, _), = first_batches(train)
    assert inputs.shape == (4, 8) and inputs.max() < 20
    train, _ = masked_lm.masked_lm_data(
        4, sequence_length=8, vocabulary_size=20, validation_fraction=0.3,
        source=tmp_path)
    assert first_batches(train)[0][1].shape == (4, 8)
