"""Data recipes that need no download."""

import numpy as np


def digits(validation_fraction=0.2, seed=0):
    """scikit-learn's bundled handwritten digits: 1,797 8x8 images, 10 classes.

    Pixels are scaled to [0, 1]. The split is stratified-free but seeded.

    Returns:
        `((x_train, y_train), (x_val, y_val))`, images `[n, 8, 8]` float32,
        labels `[n]` int32.

    Raises:
        ImportError: scikit-learn is missing (`pip install hftatf[data]`).
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise ImportError(
            "The digits recipe needs scikit-learn: pip install 'hftatf[data]'"
        ) from error
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(
            "`validation_fraction` must be in (0, 1). Received: "
            f"{validation_fraction}.")
    data = load_digits()
    images = (data.images / 16.0).astype("float32")
    labels = data.target.astype("int32")
    order = np.random.default_rng(seed).permutation(len(labels))
    images, labels = images[order], labels[order]
    split = int(round(len(labels) * (1.0 - validation_fraction)))
    return (images[:split], labels[:split]), (images[split:], labels[split:])
