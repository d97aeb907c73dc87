"""ResNet-18 and ResNet-34 (basic residual blocks) as plain Keras builders.

He et al., "Deep Residual Learning for Image Recognition" (2015). The
network is a stem, four stages of basic blocks (two 3x3 convolutions and a
shortcut) and a classifier on globally pooled features. Two stems:

* `"cifar"`: one 3x3 convolution of stride 1, no max-pooling, for small
  images (32x32);
* `"imagenet"`: a 7x7 convolution of stride 2 and a 3x3 max-pooling of
  stride 2, for large images (224x224).

The builders return plain functional `keras.Model`s of stock layers, which
`hftatf.fuse(model, num_models)` turns into arrays.

    model = resnet18(input_shape=(32, 32, 3), num_classes=10, width=0.25)
    array = hftatf.fuse(model, num_models=4)
"""

import keras

from hftatf.models import data, recipes

# Basic blocks per stage.
RESNET_SPECS = {
    18: (2, 2, 2, 2),
    34: (3, 4, 6, 3),
}
# Channels and stride of the first block of each stage, at width 1.
STAGE_FILTERS = (64, 128, 256, 512)
STAGE_STRIDES = (1, 2, 2, 2)
STEMS = ("cifar", "imagenet")


def scaled_filters(filters, width):
    """`filters * width`, rounded, and at least 1."""
    return max(1, int(round(filters * width)))


def apply_conv_bn(x, filters, kernel_size, strides, name, bn_momentum,
                  bn_epsilon, activation="relu"):
    """Convolution (no bias: the normalization has an offset), batch
    normalization and, unless `activation` is None, an activation."""
    x = keras.layers.Conv2D(
        filters, kernel_size, strides=strides, padding="same",
        use_bias=False, kernel_initializer="he_normal", name=f"{name}_conv",
    )(x)
    x = keras.layers.BatchNormalization(
        momentum=bn_momentum, epsilon=bn_epsilon, name=f"{name}_bn")(x)
    if activation is not None:
        x = keras.layers.Activation(activation, name=f"{name}_relu")(x)
    return x


def apply_stem(x, stem, filters, name, bn_momentum, bn_epsilon):
    """The `"cifar"` (3x3/1) or `"imagenet"` (7x7/2 and max-pooling) stem."""
    if stem == "cifar":
        return apply_conv_bn(x, filters, 3, 1, name, bn_momentum, bn_epsilon)
    x = apply_conv_bn(x, filters, 7, 2, name, bn_momentum, bn_epsilon)
    return keras.layers.MaxPooling2D(
        3, strides=2, padding="same", name=f"{name}_pool")(x)


def apply_basic_block(x, filters, strides, name, bn_momentum, bn_epsilon):
    """Two 3x3 convolutions and a shortcut, added, then ReLU.

    The shortcut is the identity, or a strided 1x1 convolution with batch
    normalization where the block changes the resolution or the width.
    """
    shortcut = x
    if strides != 1 or x.shape[-1] != filters:
        shortcut = apply_conv_bn(x, filters, 1, strides, f"{name}_shortcut",
                                 bn_momentum, bn_epsilon, activation=None)
    x = apply_conv_bn(x, filters, 3, strides, f"{name}_1", bn_momentum,
                      bn_epsilon)
    x = apply_conv_bn(x, filters, 3, 1, f"{name}_2", bn_momentum, bn_epsilon,
                      activation=None)
    x = keras.layers.Add(name=f"{name}_add")([shortcut, x])
    return keras.layers.Activation("relu", name=f"{name}_out")(x)


def apply_stage(x, filters, blocks, strides, name, bn_momentum, bn_epsilon):
    """`blocks` basic blocks; the first one applies `strides`."""
    for index in range(blocks):
        x = apply_basic_block(x, filters, strides if index == 0 else 1,
                              f"{name}_block{index + 1}", bn_momentum,
                              bn_epsilon)
    return x


def build(depth=18, input_shape=(32, 32, 3), num_classes=10, stem="cifar",
          width=1.0, dropout=0.0, bn_momentum=0.9, bn_epsilon=1e-5,
          classifier_activation="softmax", name=None):
    """Returns a ResNet of basic blocks as a plain functional Keras model.

    Layout: input `[batch, height, width, channels]` (channels last);
    output `[batch, num_classes]`.

    Args:
        depth: 18 or 34 (the spec in `RESNET_SPECS`).
        input_shape: shape of one image, `(height, width, channels)`.
        num_classes: number of output classes.
        stem: `"cifar"` (3x3 convolution of stride 1, no pooling) or
            `"imagenet"` (7x7 convolution of stride 2, then 3x3 max-pooling
            of stride 2).
        width: multiplier of every stage's channels (64, 128, 256, 512 at
            1.0); e.g. 0.25 for a model small enough for a CPU.
        dropout: dropout rate before the classifier (0 for none).
        bn_momentum, bn_epsilon: of every BatchNormalization. The defaults
            are the reference (PyTorch) values: moving statistics that
            follow training quickly, which short runs need.
        classifier_activation: activation of the classifier; `"softmax"`
            for probabilities, None for logits.
        name: the model's name; defaults to `"resnet{depth}"`.

    Raises:
        ValueError: for an unknown `depth` or `stem`, a `width` that is not
            positive, or an `input_shape` that is not an image shape.
    """
    if depth not in RESNET_SPECS:
        raise ValueError(
            f"`depth` must be one of {sorted(RESNET_SPECS)}. Received: "
            f"depth={depth!r}.")
    if stem not in STEMS:
        raise ValueError(
            f"`stem` must be one of {STEMS}. Received: stem={stem!r}. Use "
            "'cifar' for small images such as 32x32.")
    if not width > 0:
        raise ValueError(
            f"`width` must be a positive multiplier. Received: width={width}.")
    data.check_image_shape(input_shape)
    inputs = keras.Input(shape=tuple(input_shape), name="images")
    x = apply_stem(inputs, stem, scaled_filters(STAGE_FILTERS[0], width),
                   "stem", bn_momentum, bn_epsilon)
    for index, (filters, blocks, strides) in enumerate(zip(
            STAGE_FILTERS, RESNET_SPECS[depth], STAGE_STRIDES)):
        x = apply_stage(x, scaled_filters(filters, width), blocks, strides,
                        f"stage{index + 1}", bn_momentum, bn_epsilon)
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    if dropout:
        x = keras.layers.Dropout(dropout, name="dropout")(x)
    outputs = keras.layers.Dense(num_classes, activation=classifier_activation,
                                 name="classifier")(x)
    return keras.Model(inputs, outputs, name=name or f"resnet{depth}")


def resnet18(**kwargs):
    """ResNet-18: `build(depth=18, **kwargs)`."""
    return build(depth=18, **kwargs)


def resnet34(**kwargs):
    """ResNet-34: `build(depth=34, **kwargs)`."""
    return build(depth=34, **kwargs)


for _name, _build in (("resnet18", resnet18), ("resnet34", resnet34)):
    recipes.register(recipes.Recipe(
        name=_name,
        build=_build,
        data=data.digit_images,
        loss="sparse_categorical_crossentropy",
        metrics=("accuracy",),
        optimizer="sgd",
        learning_rate=0.1,
        epochs=8,
        model_args={"input_shape": (32, 32, 3), "num_classes": 10,
                    "width": 0.125},
        data_args={"image_size": 32, "channels": 3},
        monitor="val_accuracy",
        monitor_mode="max",
    ))
