"""The fused programs `benchmarks.kernels` times, written in JAX as
hftatf's layers lower them, for three workloads: an MLP (dense layers, one
batched dot over the model axis), a ResNet-like convnet (convolutions
folded into channels, as one grouped convolution or B convolutions in one
program) and a BERT-tiny-sized encoder (attention). Activations are
`[batch, B, ...]`; the first layer of a shared input is one wide layer.

`check` holds each fused program to the B one-model programs it replaces.
"""

import jax
import jax.numpy as jnp
import numpy as np

WORKLOADS = ("mlp", "mlp_wide", "convnet", "transformer")

# One model of each workload: (batch size, widths or layers, classes).
MLP = {"batch": 64, "units": (64, 128, 64, 10)}
MLP_WIDE = {"batch": 512, "units": (1024, 4096, 4096, 10)}
# (filters, stride) of 3x3 convolutions on 32x32x3 images, ResNet-like.
CONVNET = {"batch": 128, "image": (32, 32, 3), "classes": 10,
           "layers": ((64, 1), (64, 1), (128, 2), (128, 1), (256, 2),
                      (256, 1))}
# A BERT-tiny-sized encoder on float sequence inputs.
TRANSFORMER = {"batch": 32, "length": 128, "width": 128, "heads": 2,
               "ffn": 512, "layers": 2, "classes": 2}


def _dense_params(rng, num_models, fan_in, units):
    scale = np.sqrt(2.0 / fan_in)
    return {"kernel": rng.normal(0, scale, (num_models, fan_in, units)),
            "bias": np.zeros((num_models, units))}


def _shared_dense(x, params):
    """`[batch, i]` read by every model -> `[batch, B, o]`: one wide dot."""
    kernel = params["kernel"]
    b, i, o = kernel.shape
    wide = jnp.reshape(jnp.moveaxis(kernel, 0, 1), (i, b * o))
    y = jnp.reshape(x @ wide, (x.shape[0], b, o))
    return y + params["bias"]


def _dense(x, params):
    """`[batch, B, ..., i]` -> `[batch, B, ..., o]`, model b's own kernel."""
    y = jnp.einsum("nb...i,bio->nb...o", x, params["kernel"])
    return y + jnp.reshape(params["bias"],
                           (1, y.shape[1]) + (1,) * (y.ndim - 3) + (-1,))


def _softmax_loss(logits, labels):
    """Sum over models of each model's mean cross-entropy: model b's
    gradient is its own."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, labels[:, None, None], axis=-1)
    return -jnp.sum(jnp.mean(picked, axis=0))


def mlp(rng, num_models, config, form):
    del form
    units = config["units"]
    params = [_dense_params(rng, num_models, i, o)
              for i, o in zip(units[:-1], units[1:])]

    def loss(params, x, y):
        h = _shared_dense(x, params[0])
        for layer in params[1:]:
            h = _dense(jax.nn.relu(h), layer)
        return _softmax_loss(h, y)

    x = rng.normal(size=(config["batch"], units[0]))
    y = rng.integers(0, units[-1], config["batch"])
    return params, loss, (x, y)


def _fold(x):
    """`[batch, B, h, w, c]` -> `[batch, h, w, B * c]`."""
    n, b, h, w, c = x.shape
    return jnp.reshape(jnp.moveaxis(x, 1, 3), (n, h, w, b * c))


def _unfold(x, num_models):
    n, h, w, bc = x.shape
    return jnp.moveaxis(jnp.reshape(x, (n, h, w, num_models, -1)), 3, 1)


def _conv(x, kernel, stride, groups=1):
    return jax.lax.conv_general_dilated(
        x, kernel, (stride, stride), "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
        feature_group_count=groups)


def _models_into_filters(kernel):
    """`[B, kh, kw, i, o]` -> `[kh, kw, i, B * o]`."""
    b, kh, kw, i, o = kernel.shape
    return jnp.reshape(jnp.moveaxis(kernel, 0, 3), (kh, kw, i, b * o))


def _fused_conv(x, kernel, stride, form):
    """`[batch, B, h, w, c]` convolved with model b's `kernel[b]`."""
    num_models = kernel.shape[0]
    if form == "grouped":
        outputs = _conv(_fold(x), _models_into_filters(kernel), stride,
                        groups=num_models)
        return _unfold(outputs, num_models)
    return jnp.stack([_conv(x[:, b], kernel[b], stride)
                      for b in range(num_models)], axis=1)


def convnet(rng, num_models, config, form):
    channels = config["image"][-1]
    params = []
    for filters, _ in config["layers"]:
        scale = np.sqrt(2.0 / (9 * channels))
        params.append({
            "kernel": rng.normal(0, scale,
                                 (num_models, 3, 3, channels, filters)),
            "bias": np.zeros((num_models, filters))})
        channels = filters
    head = _dense_params(rng, num_models, channels, config["classes"])
    strides = [stride for _, stride in config["layers"]]

    def loss(params, x, y):
        layers, head = params
        # The first layer reads the shared input: one wide convolution.
        first = layers[0]
        h = _unfold(_conv(x, _models_into_filters(first["kernel"]),
                          strides[0]), num_models)
        h = jax.nn.relu(h + first["bias"][None, :, None, None, :])
        for layer, stride in zip(layers[1:], strides[1:]):
            h = _fused_conv(h, layer["kernel"], stride, form)
            h = jax.nn.relu(h + layer["bias"][None, :, None, None, :])
        return _softmax_loss(_dense(jnp.mean(h, axis=(2, 3)), head), y)

    x = rng.normal(size=(config["batch"], *config["image"]))
    y = rng.integers(0, config["classes"], config["batch"])
    return (params, head), loss, (x, y)


def convnet_flops(config, num_models):
    """FLOPs of one training step (forward, and gradients of inputs and
    kernels: three times the forward products), counted by hand: XLA on a
    GPU runs convolutions as library calls its cost analysis leaves out."""
    height, width, channels = config["image"]
    total = 0
    for filters, stride in config["layers"]:
        height, width = -(-height // stride), -(-width // stride)
        total += 2 * height * width * 9 * channels * filters
        channels = filters
    total += 2 * channels * config["classes"]
    return 3 * total * config["batch"] * num_models


def _layer_norm(x, epsilon=1e-6):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    variance = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(variance + epsilon)


def transformer(rng, num_models, config, form):
    del form
    width, heads, ffn = config["width"], config["heads"], config["ffn"]
    head_width = width // heads
    layers = []
    for _ in range(config["layers"]):
        layer = {name: _dense_params(rng, num_models, width, width)
                 for name in ("query", "key", "value", "output")}
        layer["up"] = _dense_params(rng, num_models, width, ffn)
        layer["down"] = _dense_params(rng, num_models, ffn, width)
        layers.append(layer)
    head = _dense_params(rng, num_models, width, config["classes"])

    def attention(h, layer):
        n, b, s, _ = h.shape
        q, k, v = (jnp.reshape(_dense(h, layer[name]),
                               (n, b, s, heads, head_width))
                   for name in ("query", "key", "value"))
        scores = jnp.einsum("nbqhd,nbkhd->nbhqk", q, k) / np.sqrt(head_width)
        mixed = jnp.einsum("nbhqk,nbkhd->nbqhd", jax.nn.softmax(scores), v)
        return _dense(jnp.reshape(mixed, (n, b, s, width)), layer["output"])

    def loss(params, x, y):
        layers, head = params
        h = jnp.broadcast_to(x[:, None], (x.shape[0], num_models, *x.shape[1:]))
        for layer in layers:
            h = _layer_norm(h + attention(h, layer))
            h = _layer_norm(
                h + _dense(jax.nn.gelu(_dense(h, layer["up"])), layer["down"]))
        return _softmax_loss(_dense(jnp.mean(h, axis=2), head), y)

    x = rng.normal(size=(config["batch"], config["length"], width))
    y = rng.integers(0, config["classes"], config["batch"])
    return (layers, head), loss, (x, y)


BUILDERS = {"mlp": (mlp, MLP), "mlp_wide": (mlp, MLP_WIDE),
            "convnet": (convnet, CONVNET),
            "transformer": (transformer, TRANSFORMER)}
# `--quick`: shapes a CPU steps in milliseconds.
QUICK = {"mlp_wide": {"batch": 64, "units": (256, 512, 512, 10)},
         "convnet": {"batch": 16, "image": (16, 16, 3),
                     "layers": ((16, 1), (32, 2), (32, 1))},
         "transformer": {"batch": 8, "length": 32, "width": 64, "ffn": 128,
                         "layers": 1}}
FORMS = {"convnet": ("grouped", "per_model")}


def to_device(tree):
    """Parameters or a batch as device arrays, floats as float32."""
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32)
                        if np.asarray(a).dtype.kind == "f" else jnp.asarray(a),
                        tree)


def _full_precision():
    """Float32 matrix products at full precision (not TF32) while checking."""
    return jax.default_matmul_precision("highest")


def check(workload, form, num_models=3, seed=0):
    """Largest relative difference (in norm) between the fused program's
    loss and each model's gradients and those of the model's one-model
    program on its slice of the parameters, at full float32 precision."""
    build, config = BUILDERS[workload]
    params, fused_loss, batch = build(np.random.default_rng(seed),
                                      num_models, config, form)
    _, one_loss, _ = build(np.random.default_rng(seed), 1, config, form)
    params, batch = to_device(params), to_device(batch)
    worst = 0.0
    with _full_precision():
        # Compiled, as op-by-op dispatch on a GPU compiles every op alone.
        value, grads = jax.jit(jax.value_and_grad(fused_loss))(params, *batch)
        one_step = jax.jit(jax.value_and_grad(one_loss))
        total = 0.0
        for b in range(num_models):
            mine = jax.tree.map(lambda a, b=b: a[b:b + 1], params)
            one_value, one_grads = one_step(mine, *batch)
            total += one_value
            got = np.concatenate([np.ravel(g[b:b + 1])
                                  for g in jax.tree.leaves(grads)])
            want = np.concatenate([np.ravel(g)
                                   for g in jax.tree.leaves(one_grads)])
            worst = max(worst, float(np.linalg.norm(got - want)
                                     / np.linalg.norm(want)))
        worst = max(worst, abs(float(value) - float(total)) / abs(float(total)))
    return worst
