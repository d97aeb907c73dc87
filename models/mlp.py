"""Multi-layer perceptron classifiers."""

import keras

from hftatf.models import data, recipes


def build(input_shape, hidden_units=(128, 64), num_classes=10,
          activation="relu", dropout=0.0, name="mlp"):
    """Returns a plain functional MLP classifier (softmax outputs).

    Args:
        input_shape: shape of one sample, e.g. `(8, 8)` or `(64,)`; inputs of
            rank above one are flattened.
        hidden_units: width of each hidden Dense layer.
        num_classes: number of output classes.
        activation: activation of the hidden layers.
        dropout: dropout rate after each hidden layer (0 for none).
        name: the model's name.
    """
    if isinstance(hidden_units, (str, bytes)) or not all(
            isinstance(units, int) and not isinstance(units, bool)
            for units in hidden_units):
        raise ValueError(
            "`hidden_units` must be a sequence of layer widths (integers), "
            f"e.g. (128, 64). Received: hidden_units={hidden_units!r}.")
    inputs = keras.Input(shape=tuple(input_shape), name="features")
    x = inputs
    if len(input_shape) > 1:
        x = keras.layers.Flatten(name="flatten")(x)
    for i, units in enumerate(hidden_units):
        x = keras.layers.Dense(units, activation=activation,
                               name=f"hidden_{i}")(x)
        if dropout:
            x = keras.layers.Dropout(dropout, name=f"dropout_{i}")(x)
    outputs = keras.layers.Dense(num_classes, activation="softmax",
                                 name="classifier")(x)
    return keras.Model(inputs, outputs, name=name)


recipes.register(recipes.Recipe(
    name="mlp",
    build=build,
    data=data.digit_images,
    loss="sparse_categorical_crossentropy",
    metrics=("accuracy",),
    optimizer="sgd",
    learning_rate=0.1,
    epochs=30,
    model_args={"input_shape": (8, 8, 1), "hidden_units": (128, 64)},
    data_args={"image_size": None, "channels": 1},
    monitor="val_accuracy",
    monitor_mode="max",
))
