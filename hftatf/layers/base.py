"""The base class of fused layers with weights, and per-model weight helpers.

A fused layer is its stock Keras layer vectorised over the model axis:
activations are `[batch, B, ...]`, and every weight is `[B, *stock shape]`, in
the order of the stock layer's `get_weights()`. Model `b` computes what the
stock layer computes with weights `w[b]` on input `x[:, b]`.
"""

import math

import keras
import tensorflow as tf
from keras import ops
from tensorflow.python.ops import control_flow_util

from hftatf.validation import check_num_models, model_axis_of


def model_initializers(initializer, num_models):
    """Returns one initializer per model slice, each drawing its own values.

    Stock initializers seeded with an integer (or unseeded, which Keras turns
    into a fixed default seed) draw the same values on every call, so the
    slices get distinct seeds: `seed + b` for an integer seed (model 0 starts
    exactly as the stock layer with that seed would), a fresh default seed
    per slice when unseeded. Initializers without a seed are called per slice
    as they are; so is one seeded with a `SeedGenerator`, which advances.
    """
    initializer = keras.initializers.get(initializer)
    get_config = getattr(initializer, "get_config", None)
    config = get_config() if get_config is not None else {}
    if "seed" not in config or isinstance(config["seed"], dict):
        return [initializer] * num_models
    seed = config["seed"]
    cls = type(initializer)
    return [
        cls.from_config({**config, "seed": None if seed is None else seed + b})
        for b in range(num_models)
    ]


def keep_stock_initializers(fused, layer):
    """Gives the `fused` form built from the stock `layer`'s config the
    stock layer's initializer objects (its cell's too), and returns it.

    Keras serializes some initializers without their arguments
    (`Identity`'s `gain`), so a layer rebuilt from a config could draw
    other initial values than its stock twin."""
    pairs = [(layer, fused),
             (getattr(layer, "cell", None), getattr(fused, "cell", None))]
    for source, target in pairs:
        if source is None or target is None:
            continue
        for name, value in vars(source).items():
            if (isinstance(value, keras.initializers.Initializer)
                    and isinstance(vars(target).get(name),
                                   keras.initializers.Initializer)):
                setattr(target, name, value)
    return fused


class StackedInitializer:
    """Initializes a `[B, *shape]` weight slice by slice.

    Each slice is initialised as a stock layer would initialise its own
    weight of shape `shape`, so fan-in and fan-out never count `B`.
    """

    def __init__(self, initializer, num_models):
        self.initializers = model_initializers(initializer, num_models)

    def __call__(self, shape, dtype=None):
        per_model = tuple(shape[1:])
        return ops.stack([init(per_model, dtype=dtype)
                          for init in self.initializers])


class Modelwise:
    """Applies a stock per-weight function to each model slice and stacks.

    A stock regularizer gives a `[B]` loss (the array's training step adds
    entry `b` to model `b`'s loss, so each model is penalised exactly as its
    stock twin); a stock constraint (e.g. `MaxNorm(axis=0)`) gives the
    `[B, ...]` constrained weight, each slice constrained on its own axes.
    """

    def __init__(self, function, num_models):
        self.function = function
        self.num_models = num_models

    def __call__(self, weight):
        return ops.stack([self.function(weight[b])
                          for b in range(self.num_models)])


def compiling_with_xla():
    """Whether the computation being traced will be compiled by XLA (inside
    a `tf.function(jit_compile=True)`, as Keras builds for
    `jit_compile=True`). Layers use it to pick the formulation XLA compiles
    well, where TensorFlow's own kernels prefer another."""
    return control_flow_util.GraphOrParentsInXlaContext(
        tf.compat.v1.get_default_graph())


_ACCELERATORS = ("GPU", "TPU")


def runs_on_accelerator():
    """Whether the computation being traced runs on a GPU or TPU.

    The device rule of the layers' kernel choices:
    1. under a `tf.distribute` strategy, whether the strategy's worker
       devices are GPUs or TPUs;
    2. otherwise, on a machine where TensorFlow sees no GPU or TPU, never
       (and nothing is placed to find out: free in eager layer calls too);
    3. otherwise, the device the call is placed on: a `tf.device` scope
       while tracing a graph, the device an eager op runs on when eager;
       with no placement requested (a graph traced outside any device
       scope), the accelerator TensorFlow then places the computation on.
    """
    if tf.distribute.has_strategy():
        return any(_is_accelerator(device) for device
                   in tf.distribute.get_strategy().extended.worker_devices)
    if not has_accelerator():
        return False
    # An eager op reports the device it ran on, a graph op the device its
    # scope requests ("" when no scope does).
    placed = tf.identity(tf.zeros(())).device
    return not placed or _is_accelerator(placed)


def _is_accelerator(device):
    return tf.DeviceSpec.from_string(device).device_type in _ACCELERATORS


def has_accelerator():
    """Whether TensorFlow sees a logical GPU or TPU (where it places a
    computation that requests no device)."""
    return any(tf.config.list_logical_devices(kind) for kind in _ACCELERATORS)


# Batched products of at most this many multiply-adds run on TensorFlow's
# Eigen kernel on a CPU (see `batch_matmul`).
SMALL_PRODUCT = 2**19


def batch_matmul(a, b, adjoint_a=False, adjoint_b=False):
    """`a @ b` for `a` `[..., M, K]` and `b` `[..., K, N]`, each operand
    transposed first where its adjoint flag is set (real dtypes only). The
    leading (batch) axes broadcast as in `tf.linalg.matmul`.

    The batched products of small arrays are small: a one-unit logit of 2
    models, `[2, 64, 1024] @ [2, 1024, 1]`, is 131,072 multiply-adds.
    TensorFlow's oneDNN batched matmul (`BatchMatMulV2` on a CPU) spends
    about 0.1 ms on every call before it multiplies (`[2, 1, 1] @ [2, 1,
    1]`: 0.12-0.15 ms of wall time), where its Eigen kernel
    (`BatchMatMulV3`) takes 0.02-0.04 ms. Measured op by op, the Eigen
    kernel was the faster in every product of up to 2**19 multiply-adds
    (25 shapes, 2 and 8 models), the oneDNN one from about 8 million
    (`[8, 256, 64] @ [8, 64, 64]`: 0.27 against 0.29 ms; `[8, 256, 1024]
    @ [8, 1024, 64]`: 1.4 against 3.6 ms), except for matrix-vector
    products (`N = 1`), which it computes more slowly at every size
    (`[8, 4096, 1024] @ [8, 1024, 1]`: 8.3 against 5.4 ms). So on a CPU,
    outside XLA, a float32 product of known size up to `SMALL_PRODUCT`
    multiply-adds, or with `N = 1`, runs on the Eigen kernel, and so do
    its gradients by the same rule for their own sizes: the logit above
    with its gradients took 0.11-0.14 ms instead of 0.29-0.32 ms (0.72
    instead of 0.97-1.0 ms with 16 models). Everything else (XLA, GPUs and
    TPUs, other dtypes, unknown batch axes, larger or unknown sizes) is
    `tf.linalg.matmul`.
    """
    # Tensors: a variable read inside a custom gradient would need a
    # gradient of its own.
    a, b = tf.convert_to_tensor(a), tf.convert_to_tensor(b)
    if not _eigen_product(a, b, adjoint_a, adjoint_b):
        return tf.linalg.matmul(a, b, adjoint_a=adjoint_a,
                                adjoint_b=adjoint_b)

    @tf.custom_gradient
    def product(a, b):
        def gradient(upstream):
            # As TensorFlow differentiates `BatchMatMulV3`.
            if adjoint_a:
                grad_a = batch_matmul(b, upstream, adjoint_a=adjoint_b,
                                      adjoint_b=True)
            else:
                grad_a = batch_matmul(upstream, b, adjoint_b=not adjoint_b)
            if adjoint_b:
                grad_b = batch_matmul(upstream, a, adjoint_a=True,
                                      adjoint_b=adjoint_a)
            else:
                grad_b = batch_matmul(a, upstream, adjoint_a=not adjoint_a)
            return (_sum_broadcast(grad_a, a.shape),
                    _sum_broadcast(grad_b, b.shape))

        return tf.raw_ops.BatchMatMulV3(x=a, y=b, Tout=a.dtype,
                                        adj_x=adjoint_a,
                                        adj_y=adjoint_b), gradient

    return product(a, b)


def _eigen_product(a, b, adjoint_a, adjoint_b):
    """Whether `batch_matmul` runs the Eigen kernel (see there)."""
    if (a.dtype != tf.float32 or b.dtype != tf.float32
            or a.shape.rank is None or a.shape.rank < 3
            or a.shape.rank != b.shape.rank):
        return False
    batch = _broadcast_batch(a.shape[:-2], b.shape[:-2])
    if batch is None:
        return False
    rows, inner = a.shape[-2:]
    if adjoint_a:
        rows, inner = inner, rows
    columns = b.shape[-2] if adjoint_b else b.shape[-1]
    if compiling_with_xla() or runs_on_accelerator():
        return False
    if columns == 1:
        return True
    sizes = (*batch, rows, inner, columns)
    return None not in sizes and math.prod(sizes) <= SMALL_PRODUCT


def _broadcast_batch(batch_a, batch_b):
    """The broadcast of two batch shapes of the same rank, each axis equal
    or 1 in one of them; None where an axis is unknown or they do not
    broadcast."""
    batch = []
    for size_a, size_b in zip(batch_a, batch_b):
        if size_a is None or size_b is None:
            return None
        if size_a != size_b and 1 not in (size_a, size_b):
            return None
        batch.append(max(size_a, size_b))
    return batch


def _sum_broadcast(gradient, shape):
    """`gradient` of a batched product's output, summed over the batch axes
    that the operand of `shape` broadcast over."""
    axes = [axis for axis, size in enumerate(shape[:-2])
            if size == 1 and gradient.shape[axis] != 1]
    if not axes:
        return gradient
    return tf.reduce_sum(gradient, axis=axes, keepdims=True)


def repeat_for_models(tensor, num_models):
    """A shared `[batch, ...]` tensor (an input or its mask) as every
    model's: `[batch, B, ...]`."""
    return ops.repeat(ops.expand_dims(tensor, 1), num_models, axis=1)


def stacked_pieces(tensor, num_models, axis):
    """The B per-model tensors that `tensor` was stacked from on the model
    `axis`, in a traced graph; None where it was made otherwise (or
    eagerly, where tensors keep no record of their op).

    A per-model computation (B stock convolutions on a CPU) stacks its
    results into one `[B, ...]` tensor for the array's next layer. Where
    that layer computes per model too (the next convolution, an
    activation, a normalization), it takes the pieces themselves: the
    stacked copy then has no reader and TensorFlow never computes it, and
    the backward pass needs no stacked gradient either. On a CPU each
    stack is a copy of the activations (and one of their gradients).
    """
    if num_models == 1 or not isinstance(tensor, tf.Tensor) or (
            tf.executing_eagerly()):
        return None
    op = getattr(tensor, "op", None)
    if op is None or op.type != "Pack" or len(op.inputs) != num_models:
        return None
    stacked_axis = op.get_attr("axis")
    if stacked_axis < 0:
        if tensor.shape.rank is None:
            return None
        stacked_axis += tensor.shape.rank
    return list(op.inputs) if stacked_axis == axis else None


def model_pieces(tensor, num_models, axis):
    """The B per-model tensors of `tensor` (the model axis `axis` dropped):
    those it was stacked from where it was (`stacked_pieces`), its slices
    otherwise. Slices along the leading axis are views; along another
    axis, copies."""
    pieces = stacked_pieces(tensor, num_models, axis)
    if pieces is not None:
        return pieces
    if num_models == 1:
        return [ops.squeeze(tensor, axis)]
    return ops.unstack(tensor, num_models, axis=axis)


def carry_logits(output, sources, transform):
    """`output`, which is `transform(sources)` for a list of tensors
    `sources` rearranged (stacked, reshaped, transposed), with the logits
    Keras caches on softmax and sigmoid outputs carried over:
    `transform([s._keras_logits for s in sources])`, where every source
    has them. Keras's crossentropy reads them instead of the
    probabilities, for exactness where the probabilities saturate; a
    rearrangement would lose them."""
    logits = [getattr(s, "_keras_logits", None) for s in sources]
    if sources and all(t is not None for t in logits):
        keep_logits(output, transform(logits))
    return output


def keep_logits(tensor, logits):
    """Attaches `logits` to `tensor` as Keras caches them on softmax and
    sigmoid outputs (where the tensor type takes attributes)."""
    try:
        tensor._keras_logits = logits
    except AttributeError:
        pass


def mask_has_model_axis(tensor, mask):
    """Whether the mask Keras keeps on an array's output `tensor`
    (`[batch, B, ..., features]`) is per model (`[batch, B, ...]`), rather
    than shared by the models (`[batch, ...]`)."""
    return len(mask.shape) == len(tensor.shape) - 1


def rearranged(transform, tensor):
    """`transform(tensor)` for a layout change (reshape, transpose, ...),
    keeping the logits Keras caches on softmax and sigmoid outputs."""
    return carry_logits(transform(tensor), [tensor],
                        lambda logits: transform(logits[0]))


def stack_models(pieces, axis):
    """Inverse of `model_pieces`: the per-model tensors, stacked on the
    model `axis` (read back as pieces by the next per-model layer)."""
    def stack(tensors):
        if len(tensors) == 1:
            return ops.expand_dims(tensors[0], axis)
        return ops.stack(tensors, axis=axis)

    return carry_logits(stack(pieces), pieces, stack)


def map_pieces(function, tensor, num_models, axis):
    """`function` (element-wise, or per sample) on `tensor`: on each of
    its pieces where it was stacked from them (`stacked_pieces`), then
    stacked again; on `tensor` itself otherwise."""
    pieces = stacked_pieces(tensor, num_models, axis)
    if pieces is None:
        return function(tensor)
    return stack_models([function(piece) for piece in pieces], axis)


# The smallest row of biases whose gradient `add_bias_by_rows` sums by a
# product. The gradient of a bias added to 4,096 rows, in processor time on
# a 2-core CPU: 8-18 us either way for rows of 1-16 elements (a product 16
# us against a sum 8 us for 1), then 28 against 94-118 us for rows of 32
# (a convolution's `[64, 8, 8, 32]`), 157 against 208 us for 64, 523
# against 1,080 us for 256.
MIN_BIAS_ROW = 16


def bias_rows(outputs, bias, models=0):
    """How many axes of `outputs` after its first `models` (0, or 1: the
    model axis) `bias` broadcasts over as rows: `bias` is `[*m, 1, ..., 1,
    *t]`, `outputs` `[*m, *rows, *t]`, of the same rank. 0 where `bias` is
    laid out otherwise, where `t` has fewer than `MIN_BIAS_ROW` elements
    (a sum over rows of a few elements is one contiguous reduction, which
    TensorFlow computes faster than the product), and under XLA, whose
    reductions need no help."""
    if compiling_with_xla() or len(bias.shape) != len(outputs.shape):
        return 0
    rows = models
    while rows < len(bias.shape) and bias.shape[rows] == 1:
        rows += 1
    if tuple(bias.shape[rows:]) != tuple(outputs.shape[rows:]) or tuple(
            bias.shape[:models]) != tuple(outputs.shape[:models]) or (
            math.prod(bias.shape[rows:]) < MIN_BIAS_ROW):
        return 0
    return rows - models


def add_bias_by_rows(outputs, bias, models=0):
    """`outputs + bias` (an `AddV2`; `bias` of the rank of `outputs`, whose
    first `models` axes it shares). Where `bias_rows` finds rows, the
    bias's gradient is summed over them as one product by a row of ones
    (batched over the model axis where `models` is 1); elsewhere the
    gradient is TensorFlow's own.

    On a CPU, TensorFlow's `Sum` over the leading or middle axes is slow:
    for the feed-forward bias of a BERT-mini array of 8 with the models
    first (`[8, 64 * 64, 1024]`), 31 ms of processor time against 11 ms
    reducing axis 0 of the batch-first layout; for the bias of a
    per-model convolution (`[64, 8, 8, 32]`, DCGAN's discriminator), about
    0.1 ms each, which a stock layer's `BiasAdd` gradient saves by fusing
    with the filter's gradient. Per-model layers add their biases
    without `BiasAdd` (see `_FusedConvolution._per_model`), and sum their
    gradients here instead."""
    if not bias_rows(outputs, bias, models):
        return outputs + bias

    @ops.custom_gradient
    def add(outputs, bias):
        def gradient(upstream):
            size = math.prod(bias.shape[models:])
            rows = ops.reshape(upstream, (*bias.shape[:models], -1, size))
            ones = ops.ones((*(1,) * models, 1, ops.shape(rows)[-2]),
                            upstream.dtype)
            summed = (batch_matmul(ones, rows) if models
                      else ops.matmul(ones, rows))
            return upstream, ops.reshape(summed, bias.shape)

        return outputs + bias, gradient

    return add(outputs, bias)


def broadcast_to_models(values, ndim):
    """Reshapes a `[B]` vector to `[B, 1, ..., 1]` of rank `ndim`."""
    return ops.reshape(values, (-1,) + (1,) * (ndim - 1))


def as_one_sample(values, like):
    """Per-model values that broadcast against `like` (`[batch, B, ...]`),
    given as `[1, B, ...]` or `[B, ...]`, broadcast to one sample of it:
    `[B, *like.shape[2:]]`.

    Added to or multiplied with `like`, they then broadcast over the batch
    axis alone, which TensorFlow's CPU kernels run as one row broadcast
    and whose gradient is a reduction over the leading axis, then one over
    a tensor the size of a sample. A `[1, B, 1, ..., n]` operand takes the
    general broadcasting path, and its gradient reduces the batch and inner
    axes at once: for a bias of a BERT-mini array of 8 (`[64, 8, 64, 256]`
    activations), 23.6 ms of processor time against 3.9 ms. The values are
    unchanged: each model still adds (or scales by) its own. Values that
    vary along the batch axis (a layer normalising over it) are returned as
    they are.
    """
    if len(values.shape) == len(like.shape):
        if values.shape[0] != 1:
            return values
        values = ops.squeeze(values, 0)
    return ops.broadcast_to(values, ops.shape(like)[1:])


class ModelActivityRegularization:
    """Mixin of fused layers: the stock layer's activity regularizer,
    applied to each model's slice of every output.

    Keras applies a layer's `activity_regularizer` to its whole output and
    divides by the batch size: on a fused output that would be one loss
    for all models, shared out evenly. Here model `b`'s output slice is
    penalised on its own and divided by the batch size, as its stock twin
    does, and the layer adds a `[B]` loss (entry `b` model `b`'s). The
    class sets `model_activity_regularizer` (never the stock
    `activity_regularizer`), `num_models` and `model_axis`.
    """

    model_activity_regularizer = None

    def with_activity_config(self, config):
        """`config` with the activity regularizer, where there is one."""
        if self.model_activity_regularizer is not None:
            config["activity_regularizer"] = keras.regularizers.serialize(
                self.model_activity_regularizer)
        return config

    def __call__(self, *args, **kwargs):
        outputs = super().__call__(*args, **kwargs)
        if self.model_activity_regularizer is not None:
            for output in keras.tree.flatten(outputs):
                if ops.is_tensor(output):
                    self.add_loss(self._activity_loss(output))
        return outputs

    def _activity_loss(self, output):
        regularizer = self.model_activity_regularizer
        losses = ops.stack([
            regularizer(ops.take(output, b, axis=self.model_axis))
            for b in range(self.num_models)])
        batch_size = ops.cast(ops.shape(output)[1 - self.model_axis],
                              losses.dtype)
        return ops.divide_no_nan(losses, batch_size)


class FusedLayer(ModelActivityRegularization, keras.layers.Layer):
    """Base class of fused layers that hold weights.

    Subclasses take `num_models` plus exactly the arguments of their stock
    layer, create weights with `add_model_weight`, and compute on activations
    whose axis 1 is the model axis: `[batch, B, ...]`. Those that set
    `supports_models_first` also compute on activations with the models
    first, `[B, batch, ...]`, when built with `models_first=True`: the
    layout `hftatf.fuse` keeps between the per-model convolutions of a CPU
    array, where taking each model's slice of `[batch, B, ...]` is a copy
    and of `[B, batch, ...]` is not.

    State and the model axis: weights and non-trainable statistics always
    carry it (`[B, ...]`); regularizers, constraints and the activity
    regularizer are applied per model slice, and regularization losses are
    `[B]` vectors (entry `b` belongs to model `b`).

    Args:
        num_models: the number of models `B` in the array.
        activity_regularizer: as in the stock layer; applied to each model's
            output slice and divided by the batch size, like Keras does.
        models_first: whether activations have the models first,
            `[B, batch, ...]`, instead of `[batch, B, ...]`; only for layers
            that set `supports_models_first`.
        **kwargs: the stock `keras.layers.Layer` arguments (`name`, `dtype`,
            `trainable`, ...).
    """

    supports_models_first = False
    # Whether the layer computes faster with the models first, so that
    # `hftatf.fuse` gives it that layout even from inputs without it.
    prefers_models_first = False

    def __init__(self, num_models, activity_regularizer=None,
                 models_first=False, **kwargs):
        super().__init__(**kwargs)
        self.num_models = check_num_models(num_models)
        self.model_activity_regularizer = keras.regularizers.get(
            activity_regularizer
        )
        if models_first and not self.supports_models_first:
            raise ValueError(
                f"{type(self).__name__} computes only on [batch, num_models, "
                "...] activations. Received: models_first=True.")
        self.models_first = bool(models_first)

    @property
    def model_axis(self):
        """The model axis of this layer's activations: 0 with the models
        first, else 1."""
        return model_axis_of(self.models_first)

    @classmethod
    def takes_models_first(cls, layer):
        """Whether the fused form of the stock `layer` can compute with the
        models first (`models_first=True`). Fused layers that can
        override `supports_models_first` (and this, where it depends on the
        stock layer's arguments)."""
        del layer
        return cls.supports_models_first

    @classmethod
    def from_stock(cls, layer, num_models, **kwargs):
        """Builds the fused form of the stock `layer` (weights not copied);
        `kwargs` are arguments of the fused form only (`shared_input`)."""
        try:
            return keep_stock_initializers(cls.from_config(
                {**layer.get_config(), "num_models": num_models, **kwargs}),
                layer)
        except TypeError as error:
            # Keras's `from_config` wraps the fused form's refusal of a
            # stock argument (a ValueError naming it) in a TypeError that
            # prints the whole config first: raise the refusal itself.
            if isinstance(error.__context__, ValueError):
                raise ValueError(
                    f"hftatf cannot fuse layer '{layer.name}' "
                    f"({type(layer).__name__}): {error.__context__}"
                ) from None
            raise

    @classmethod
    def fuses_shared_input(cls, layer):
        """Whether the fused form of the stock `layer` can take one input
        batch shared by all models (`shared_input=True`): the B models are
        then one wide stock layer, and no copy of the input per model is
        made. Fused layers that can override this."""
        del layer
        return False

    def add_model_weight(self, shape, name, initializer, regularizer=None,
                         constraint=None, trainable=True, dtype=None,
                         autocast=True):
        """Adds a `[B, *shape]` weight, each slice initialised separately.

        `autocast` as in `add_weight`: False for weights the stock layer
        reads in their own dtype under a mixed precision policy."""
        return self.add_weight(
            shape=(self.num_models, *shape),
            name=name,
            initializer=StackedInitializer(initializer, self.num_models),
            regularizer=(
                Modelwise(keras.regularizers.get(regularizer), self.num_models)
                if regularizer is not None else None
            ),
            constraint=(
                Modelwise(keras.constraints.get(constraint), self.num_models)
                if constraint is not None else None
            ),
            trainable=trainable,
            dtype=dtype,
            autocast=autocast,
        )

    def get_model_weights(self, index):
        """Returns model `index`'s weights, in the stock layer's order."""
        return [w[index] for w in self.get_weights()]

    def set_model_weights(self, index, weights):
        """Sets model `index`'s weights from a stock layer's `get_weights()`."""
        variables = self.weights
        if len(weights) != len(variables):
            raise ValueError(
                f"Layer '{self.name}' holds {len(variables)} weights per "
                f"model; received {len(weights)}."
            )
        for variable, value in zip(variables, weights):
            if tuple(value.shape) != tuple(variable.shape[1:]):
                raise ValueError(
                    f"Weight '{variable.path}' of layer '{self.name}' has "
                    f"per-model shape {tuple(variable.shape[1:])}; received "
                    f"shape {tuple(value.shape)}."
                )
            stacked = keras.ops.convert_to_numpy(variable).copy()
            stacked[index] = value
            variable.assign(stacked)


    def get_config(self):
        config = super().get_config()
        config["num_models"] = self.num_models
        if self.models_first:
            config["models_first"] = True
        config["activity_regularizer"] = keras.regularizers.serialize(
            self.model_activity_regularizer
        )
        return config
