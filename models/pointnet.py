"""PointNet classification and part segmentation as plain Keras builders.

Qi et al., "PointNet: Deep Learning on Point Sets for 3D Classification and
Segmentation" (2017). Every point goes through the same MLP (a Dense layer
applied to each point: the paper's 1x1 convolutions); a max over points
gives a global feature that does not depend on the points' order. Two
transform nets (T-Nets) predict a 3x3 matrix that aligns the input points
and a 64x64 matrix that aligns the point features. Each transform matrix A
is kept close to orthogonal by a loss `weight * ||I - A A^T||^2` (mean over
the batch), which `OrthogonalityRegularizer` adds as the activity
regularizer of the Dense layer that outputs A. Being an ordinary Keras
loss of that layer, it is part of each model's own loss in an array.

    model = pointnet(num_classes=6, width=0.25)
    array = hftatf.fuse(model, num_models=4)
"""

import keras
import numpy as np
from keras import ops

from hftatf.api import hftatf_export
from hftatf.models import data, recipes

# Widths at width 1.0, from the paper.
INPUT_MLP = (64, 64)  # per point, after the input transform
FEATURE_MLP = (64, 128, 1024)  # per point, after the feature transform
TNET_MLP = (64, 128, 1024)  # per point, inside a transform net
TNET_HEAD = (512, 256)  # on the pooled feature, inside a transform net
CLASSIFIER_HEAD = (512, 256)
SEGMENTATION_HEAD = (512, 256, 128, 128)


@hftatf_export
class OrthogonalityRegularizer(keras.regularizers.Regularizer):
    """Penalises transform matrices for not being orthogonal.

    For a batch of flattened `k x k` matrices `x` (`[batch, k * k]`),
    returns `weight * sum_i ||I - A_i A_i^T||_F^2`. As a layer's
    `activity_regularizer`, Keras divides it by the batch size: the loss is
    the batch mean.

    It is registered for Keras serialization under `hftatf`: a saved
    PointNet's `.keras` file loads once `hftatf.models.pointnet` is imported
    (or with `custom_objects`); its SavedModel needs no hftatf.

    Args:
        num_features: `k`, the side of the matrices.
        weight: the factor of the penalty (0.001 in the paper).
    """

    def __init__(self, num_features, weight=0.001):
        if not isinstance(num_features, int) or num_features < 1:
            raise ValueError(
                "`num_features` must be a positive integer. Received: "
                f"num_features={num_features!r}.")
        if weight < 0:
            raise ValueError(
                f"`weight` must be non-negative. Received: weight={weight}.")
        self.num_features = num_features
        self.weight = float(weight)

    def __call__(self, x):
        k = self.num_features
        matrices = ops.reshape(x, (-1, k, k))
        products = ops.matmul(matrices, ops.transpose(matrices, (0, 2, 1)))
        identity = ops.eye(k, dtype=products.dtype)
        return self.weight * ops.sum(ops.square(identity - products))

    def get_config(self):
        return {"num_features": self.num_features, "weight": self.weight}


def scaled(widths, width):
    """Every entry of `widths` times `width`, rounded, at least 1."""
    return tuple(max(1, int(round(w * width))) for w in widths)


def apply_dense_bn(x, units, name, bn_momentum):
    """Dense (no bias: the normalization has an offset), batch normalization
    and ReLU. On `[batch, points, channels]` it is the paper's shared MLP
    layer: the same weights for every point."""
    x = keras.layers.Dense(units, use_bias=False, name=f"{name}_dense")(x)
    x = keras.layers.BatchNormalization(momentum=bn_momentum,
                                        name=f"{name}_bn")(x)
    return keras.layers.Activation("relu", name=f"{name}_relu")(x)


def apply_mlp(x, widths, name, bn_momentum):
    """`apply_dense_bn` for each of `widths`."""
    for index, units in enumerate(widths):
        x = apply_dense_bn(x, units, f"{name}{index + 1}", bn_momentum)
    return x


def apply_transform_net(x, num_features, width, name, bn_momentum,
                        orthogonality_weight):
    """A T-Net: predicts a `[batch, k, k]` matrix from the points `x`.

    A shared MLP, a max over points, two Dense layers and a Dense layer to
    `k * k` values initialised to the identity matrix, regularised towards
    orthogonality (`OrthogonalityRegularizer`, if the weight is positive).
    """
    x = apply_mlp(x, scaled(TNET_MLP, width), f"{name}_mlp", bn_momentum)
    x = keras.layers.GlobalMaxPooling1D(name=f"{name}_pool")(x)
    x = apply_mlp(x, scaled(TNET_HEAD, width), f"{name}_fc", bn_momentum)
    k = num_features
    regularizer = (OrthogonalityRegularizer(k, orthogonality_weight)
                   if orthogonality_weight else None)
    x = keras.layers.Dense(
        k * k, kernel_initializer="zeros",
        bias_initializer=keras.initializers.Constant(
            np.eye(k, dtype="float32").reshape(-1)),
        activity_regularizer=regularizer, name=f"{name}_matrix")(x)
    return keras.layers.Reshape((k, k), name=f"{name}_reshape")(x)


def apply_transform(x, width, name, bn_momentum, orthogonality_weight):
    """Multiplies every point (row of `x`, `[batch, points, k]`) by the
    matrix a T-Net predicts from `x`."""
    matrix = apply_transform_net(x, x.shape[-1], width, f"{name}_net",
                                 bn_momentum, orthogonality_weight)
    return keras.layers.Dot(axes=(2, 1), name=f"{name}_apply")([x, matrix])


def apply_backbone(points, width, bn_momentum, orthogonality_weight):
    """Input transform, MLP, feature transform, MLP, max over points.

    Returns `(point_features, global_features)`: the aligned per-point
    features `[batch, points, 64 * width]` and the pooled
    `[batch, 1024 * width]`.
    """
    x = apply_transform(points, width, "input_transform", bn_momentum,
                        orthogonality_weight)
    x = apply_mlp(x, scaled(INPUT_MLP, width), "input_mlp", bn_momentum)
    point_features = apply_transform(x, width, "feature_transform",
                                     bn_momentum, orthogonality_weight)
    x = apply_mlp(point_features, scaled(FEATURE_MLP, width), "feature_mlp",
                  bn_momentum)
    global_features = keras.layers.GlobalMaxPooling1D(name="pool")(x)
    return point_features, global_features


def pointnet(num_points=None, num_classes=40, width=1.0, dropout=0.3,
             orthogonality_weight=0.001, bn_momentum=0.9,
             classifier_activation="softmax", name="pointnet"):
    """Returns PointNet for classification as a plain functional Keras model.

    Layout: input `[batch, num_points, 3]` (xyz); output
    `[batch, num_classes]`.

    Args:
        num_points: points per cloud, or None for any number.
        num_classes: number of classes.
        width: multiplier of every layer's width (64 ... 1024 at 1.0);
            e.g. 0.25 for a model small enough for a CPU.
        dropout: dropout rate in the classifier (0.3 in the paper).
        orthogonality_weight: factor of the transforms' orthogonality loss;
            0 for none.
        bn_momentum: of every BatchNormalization.
        classifier_activation: `"softmax"`, or None for logits.
        name: the model's name.
    """
    _check_arguments(width, num_points, required=False)
    points = keras.Input(shape=(num_points, 3), name="points")
    _, x = apply_backbone(points, width, bn_momentum, orthogonality_weight)
    for index, units in enumerate(scaled(CLASSIFIER_HEAD, width)):
        x = apply_dense_bn(x, units, f"head{index + 1}", bn_momentum)
        if dropout:
            x = keras.layers.Dropout(dropout, name=f"head{index + 1}_drop")(x)
    outputs = keras.layers.Dense(num_classes, activation=classifier_activation,
                                 name="classifier")(x)
    return keras.Model(points, outputs, name=name)


def pointnet_segmentation(num_points, num_parts, width=1.0,
                          orthogonality_weight=0.001, bn_momentum=0.9,
                          classifier_activation="softmax",
                          name="pointnet_seg"):
    """Returns PointNet for part segmentation as a plain functional model.

    Every point's aligned features are concatenated with the cloud's global
    feature and classified by a shared MLP (the paper's segmentation
    network).

    Layout: input `[batch, num_points, 3]`; output
    `[batch, num_points, num_parts]`.

    Args:
        num_points: points per cloud (the global feature is repeated that
            many times).
        num_parts: number of part labels.
        width, orthogonality_weight, bn_momentum, classifier_activation,
            name: as for `pointnet`.
    """
    _check_arguments(width, num_points, required=True)
    points = keras.Input(shape=(num_points, 3), name="points")
    point_features, global_features = apply_backbone(
        points, width, bn_momentum, orthogonality_weight)
    repeated = keras.layers.RepeatVector(num_points, name="repeat")(
        global_features)
    x = keras.layers.Concatenate(name="concat")([point_features, repeated])
    x = apply_mlp(x, scaled(SEGMENTATION_HEAD, width), "seg", bn_momentum)
    outputs = keras.layers.Dense(num_parts, activation=classifier_activation,
                                 name="classifier")(x)
    return keras.Model(points, outputs, name=name)


def _check_arguments(width, num_points, required):
    if not width > 0:
        raise ValueError(
            f"`width` must be a positive multiplier. Received: width={width}.")
    if num_points is None and not required:
        return
    if not isinstance(num_points, int) or num_points < 1:
        raise ValueError(
            "`num_points` must be a positive integer"
            + ("" if required else " or None") +
            f". Received: num_points={num_points!r}.")


_SHAPES_DEFAULTS = {"num_points": 256, "samples_per_shape": 100}
# Both tasks train on the parametric shapes with the same recipe.
_SHAPES_RECIPE = dict(
    data=data.shapes,
    loss="sparse_categorical_crossentropy",
    metrics=("accuracy",),
    optimizer="adam",
    learning_rate=1e-3,
    epochs=20,
    monitor="val_accuracy",
    monitor_mode="max",
)
recipes.register(recipes.Recipe(
    name="pointnet",
    build=pointnet,
    model_args={"num_points": 256, "num_classes": len(data.SHAPES),
                "width": 0.25},
    data_args=dict(_SHAPES_DEFAULTS),
    **_SHAPES_RECIPE,
))
recipes.register(recipes.Recipe(
    name="pointnet_seg",
    build=pointnet_segmentation,
    model_args={"num_points": 256, "num_parts": data.num_parts(),
                "width": 0.25},
    data_args={**_SHAPES_DEFAULTS, "segmentation": True},
    **_SHAPES_RECIPE,
))
