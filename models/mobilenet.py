"""MobileNetV2 and MobileNetV3 (small and large) as plain Keras builders.

Sandler et al., "MobileNetV2: Inverted Residuals and Linear Bottlenecks"
(2018); Howard et al., "Searching for MobileNetV3" (2019). Both stack
inverted residual blocks: a 1x1 expansion, a depthwise convolution, an
optional squeeze-and-excitation (V3) and a linear 1x1 projection, with a
residual connection where shapes allow. V3 uses hard-swish in its later
blocks and a hard-sigmoid gate in squeeze-and-excitation.

The architectures (channels, expansions, kernels, strides) are the spec
tables below, those of `keras.applications` (same weight shapes for the
same `alpha`). Inputs as small as 32x32 work: `stem_strides=1` keeps more
resolution for them.

    model = mobilenet_v3_small(input_shape=(32, 32, 3), alpha=0.5)
    array = hftatf.fuse(model, num_models=4)
"""

import keras

from hftatf.models import data, recipes

# MobileNetV2 stages: (expansion, filters, repeats, first stride).
MOBILENET_V2_SPEC = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)

# MobileNetV3 blocks: (expansion, filters, kernel, stride, squeeze-excite,
# activation).
MOBILENET_V3_SPECS = {
    "small": (
        (1, 16, 3, 2, True, "relu"),
        (72 / 16, 24, 3, 2, False, "relu"),
        (88 / 24, 24, 3, 1, False, "relu"),
        (4, 40, 5, 2, True, "hard_swish"),
        (6, 40, 5, 1, True, "hard_swish"),
        (6, 40, 5, 1, True, "hard_swish"),
        (3, 48, 5, 1, True, "hard_swish"),
        (3, 48, 5, 1, True, "hard_swish"),
        (6, 96, 5, 2, True, "hard_swish"),
        (6, 96, 5, 1, True, "hard_swish"),
        (6, 96, 5, 1, True, "hard_swish"),
    ),
    "large": (
        (1, 16, 3, 1, False, "relu"),
        (4, 24, 3, 2, False, "relu"),
        (3, 24, 3, 1, False, "relu"),
        (3, 40, 5, 2, True, "relu"),
        (3, 40, 5, 1, True, "relu"),
        (3, 40, 5, 1, True, "relu"),
        (6, 80, 3, 2, False, "hard_swish"),
        (2.5, 80, 3, 1, False, "hard_swish"),
        (2.3, 80, 3, 1, False, "hard_swish"),
        (2.3, 80, 3, 1, False, "hard_swish"),
        (6, 112, 3, 1, True, "hard_swish"),
        (6, 112, 3, 1, True, "hard_swish"),
        (6, 160, 5, 2, True, "hard_swish"),
        (6, 160, 5, 1, True, "hard_swish"),
        (6, 160, 5, 1, True, "hard_swish"),
    ),
}
# Width of the last (pre-classifier) layer, at alpha <= 1.
MOBILENET_V3_HEAD = {"small": 1024, "large": 1280}
MOBILENET_V2_HEAD = 1280
SQUEEZE_RATIO = 0.25


def make_divisible(value, divisor=8):
    """`value` rounded to a multiple of `divisor` (at least `divisor`),
    never more than 10% below `value`: the channel rule of the papers."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * value:
        rounded += divisor
    return rounded


def apply_conv_bn(x, filters, kernel_size, strides, name, bn_momentum,
                  bn_epsilon, activation=None):
    """Convolution without bias, batch normalization, optional activation."""
    x = keras.layers.Conv2D(filters, kernel_size, strides=strides,
                            padding="same", use_bias=False, name=name)(x)
    x = keras.layers.BatchNormalization(
        momentum=bn_momentum, epsilon=bn_epsilon, name=f"{name}_bn")(x)
    if activation is not None:
        x = keras.layers.Activation(activation, name=f"{name}_act")(x)
    return x


def apply_squeeze_excite(x, squeeze_filters, name):
    """Squeeze-and-excitation: channels gated by a hard sigmoid of a
    two-layer bottleneck over their global average."""
    gate = keras.layers.GlobalAveragePooling2D(
        keepdims=True, name=f"{name}_squeeze")(x)
    gate = keras.layers.Conv2D(squeeze_filters, 1, activation="relu",
                               name=f"{name}_reduce")(gate)
    gate = keras.layers.Conv2D(x.shape[-1], 1, activation="hard_sigmoid",
                               name=f"{name}_expand")(gate)
    return keras.layers.Multiply(name=f"{name}_excite")([x, gate])


def apply_inverted_residual(x, expanded_filters, filters, kernel_size,
                            strides, squeeze_filters, activation, name,
                            bn_momentum, bn_epsilon):
    """An inverted residual block.

    1x1 expansion to `expanded_filters` (left out when it would not change
    the width), depthwise `kernel_size` convolution of stride `strides`,
    squeeze-and-excitation to `squeeze_filters` (None for none), linear 1x1
    projection to `filters`, and a residual connection when the block keeps
    the shape.
    """
    shortcut = x
    in_filters = x.shape[-1]
    if expanded_filters != in_filters:
        x = apply_conv_bn(x, expanded_filters, 1, 1, f"{name}_expand",
                          bn_momentum, bn_epsilon, activation)
    x = keras.layers.DepthwiseConv2D(kernel_size, strides=strides,
                                     padding="same", use_bias=False,
                                     name=f"{name}_depthwise")(x)
    x = keras.layers.BatchNormalization(
        momentum=bn_momentum, epsilon=bn_epsilon,
        name=f"{name}_depthwise_bn")(x)
    x = keras.layers.Activation(activation, name=f"{name}_depthwise_act")(x)
    if squeeze_filters:
        x = apply_squeeze_excite(x, squeeze_filters, f"{name}_se")
    x = apply_conv_bn(x, filters, 1, 1, f"{name}_project", bn_momentum,
                      bn_epsilon)
    if strides == 1 and in_filters == filters:
        x = keras.layers.Add(name=f"{name}_add")([shortcut, x])
    return x


def apply_classifier(x, num_classes, dropout, classifier_activation,
                     hidden=None, hidden_activation=None):
    """Global average pooling, an optional hidden Dense layer (MobileNetV3),
    dropout and the classifier."""
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    if hidden:
        x = keras.layers.Dense(hidden, activation=hidden_activation,
                               name="head")(x)
    if dropout:
        x = keras.layers.Dropout(dropout, name="dropout")(x)
    return keras.layers.Dense(num_classes, activation=classifier_activation,
                              name="classifier")(x)


def mobilenet_v2(input_shape=(224, 224, 3), num_classes=1000, alpha=1.0,
                 stem_strides=2, dropout=0.0, bn_momentum=0.9,
                 bn_epsilon=1e-3, classifier_activation="softmax",
                 name="mobilenet_v2"):
    """Returns MobileNetV2 as a plain functional Keras model.

    Layout: input `[batch, height, width, channels]`; output
    `[batch, num_classes]`.

    Args:
        input_shape: shape of one image, `(height, width, channels)`; 32x32
            and up.
        num_classes: number of output classes.
        alpha: width multiplier of every layer (the last one only grows,
            for `alpha > 1`), e.g. 0.35, 0.5, 1.0.
        stem_strides: stride of the first convolution: 2 as in the paper,
            1 to keep the resolution of small images.
        dropout: dropout rate before the classifier (0 for none).
        bn_momentum, bn_epsilon: of every BatchNormalization. The momentum
            lets moving statistics follow training quickly, which short
            runs from scratch need.
        classifier_activation: `"softmax"`, or None for logits.
        name: the model's name.
    """
    _check_arguments(input_shape, alpha, stem_strides)
    inputs = keras.Input(shape=tuple(input_shape), name="images")
    x = apply_conv_bn(inputs, make_divisible(32 * alpha), 3, stem_strides,
                      "stem", bn_momentum, bn_epsilon, "relu6")
    for stage, (expansion, filters, repeats, strides) in enumerate(
            MOBILENET_V2_SPEC):
        for index in range(repeats):
            in_filters = x.shape[-1]
            x = apply_inverted_residual(
                x, in_filters * expansion, make_divisible(int(filters * alpha)),
                3, strides if index == 0 else 1, None, "relu6",
                f"stage{stage + 1}_block{index + 1}", bn_momentum,
                bn_epsilon)
    head = make_divisible(MOBILENET_V2_HEAD * max(alpha, 1.0))
    x = apply_conv_bn(x, head, 1, 1, "top", bn_momentum, bn_epsilon, "relu6")
    outputs = apply_classifier(x, num_classes, dropout, classifier_activation)
    return keras.Model(inputs, outputs, name=name)


def mobilenet_v3(size="large", input_shape=(224, 224, 3), num_classes=1000,
                 alpha=1.0, stem_strides=2, dropout=0.2, bn_momentum=0.9,
                 bn_epsilon=1e-3, classifier_activation="softmax",
                 name=None):
    """Returns MobileNetV3 (`"small"` or `"large"`) as a plain functional
    Keras model.

    Layout: input `[batch, height, width, channels]`; output
    `[batch, num_classes]`.

    Args:
        size: `"small"` or `"large"` (the spec in `MOBILENET_V3_SPECS`).
        input_shape, num_classes, alpha, stem_strides, bn_momentum,
            bn_epsilon, classifier_activation: as for `mobilenet_v2` (the
            16-channel stem is not scaled by `alpha`, as in the paper).
        dropout: dropout rate before the classifier (0 for none).
        name: the model's name; defaults to `"mobilenet_v3_{size}"`.
    """
    if size not in MOBILENET_V3_SPECS:
        raise ValueError(
            f"`size` must be one of {sorted(MOBILENET_V3_SPECS)}. Received: "
            f"size={size!r}.")
    _check_arguments(input_shape, alpha, stem_strides)
    inputs = keras.Input(shape=tuple(input_shape), name="images")
    x = apply_conv_bn(inputs, 16, 3, stem_strides, "stem", bn_momentum,
                      bn_epsilon, "hard_swish")
    for index, (expansion, filters, kernel_size, strides, squeeze,
                activation) in enumerate(MOBILENET_V3_SPECS[size]):
        expanded = make_divisible(x.shape[-1] * expansion)
        x = apply_inverted_residual(
            x, expanded, make_divisible(filters * alpha), kernel_size,
            strides, make_divisible(expanded * SQUEEZE_RATIO) if squeeze
            else None, activation, f"block{index + 1}", bn_momentum,
            bn_epsilon)
    x = apply_conv_bn(x, make_divisible(x.shape[-1] * 6), 1, 1, "top",
                      bn_momentum, bn_epsilon, "hard_swish")
    head = MOBILENET_V3_HEAD[size]
    if alpha > 1.0:
        head = make_divisible(head * alpha)
    outputs = apply_classifier(x, num_classes, dropout, classifier_activation,
                               hidden=head, hidden_activation="hard_swish")
    return keras.Model(inputs, outputs, name=name or f"mobilenet_v3_{size}")


def mobilenet_v3_small(**kwargs):
    """MobileNetV3-Small: `mobilenet_v3("small", **kwargs)`."""
    return mobilenet_v3("small", **kwargs)


def mobilenet_v3_large(**kwargs):
    """MobileNetV3-Large: `mobilenet_v3("large", **kwargs)`."""
    return mobilenet_v3("large", **kwargs)


def _check_arguments(input_shape, alpha, stem_strides):
    data.check_image_shape(input_shape)
    if not alpha > 0:
        raise ValueError(
            f"`alpha` must be a positive width multiplier. Received: "
            f"alpha={alpha}.")
    if stem_strides not in (1, 2):
        raise ValueError(
            "`stem_strides` must be 1 (small images) or 2. Received: "
            f"stem_strides={stem_strides!r}.")


_RECIPE_DEFAULTS = {
    "data": data.digit_images,
    "loss": "sparse_categorical_crossentropy",
    "metrics": ("accuracy",),
    "optimizer": "adam",
    "learning_rate": 2e-3,
    "epochs": 10,
    "data_args": {"image_size": 32, "channels": 3},
    "monitor": "val_accuracy",
    "monitor_mode": "max",
}
_MODEL_ARGS = {"input_shape": (32, 32, 3), "num_classes": 10, "alpha": 0.35,
               "stem_strides": 1}
recipes.register(recipes.Recipe(
    name="mobilenet_v2", build=mobilenet_v2, model_args=_MODEL_ARGS,
    **_RECIPE_DEFAULTS))
for _size, _build in (("small", mobilenet_v3_small),
                      ("large", mobilenet_v3_large)):
    recipes.register(recipes.Recipe(
        name=f"mobilenet_v3_{_size}", build=_build,
        model_args={**_MODEL_ARGS, "dropout": 0.0}, **_RECIPE_DEFAULTS))
