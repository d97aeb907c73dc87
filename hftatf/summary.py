"""`FusedModel.summary`: the array as its user built it.

An array's own layers are fused ones, with `[B, ...]` weights, `[batch,
B, ...]` activations and, in places, layout layers of their own. What its
user wants to see is the model they fused: its layers, one model's shapes
and one model's parameter count, and how many models the array holds.
`summary(fused=True)` shows the fused layout instead.
"""

import keras


def print_summary(array, line_length=None, positions=None, print_fn=None,
                  expand_nested=False, show_trainable=False,
                  layer_range=None):
    """Prints the stock architecture of `array` (`array.stock_model()`):
    its layers with one model's output shapes and parameter counts, under
    a line that says how many models the array holds and over a line with
    the parameters of one model and of the array. The arguments are those
    of `keras.Model.summary`.

    Raises:
        ValueError: for an array that was not made by `hftatf.fuse` or
            `hftatf.fuse_models` (it has no stock architecture: use
            `summary(fused=True)`).
    """
    if array.source_config is None:
        raise ValueError(
            f"Array '{array.name}' was built from hftatf.layers directly, "
            "so it has no stock architecture to show per model. Call "
            "`summary(fused=True)` for its fused layers.")
    stock = array.stock_model()
    captured = []
    stock.summary(line_length=line_length, positions=positions,
                  print_fn=captured.append, expand_nested=expand_nested,
                  show_trainable=show_trainable, layer_range=layer_range)
    total = int(sum(keras.ops.size(w) for w in array.weights))
    text = "".join(captured).rstrip("\n").split("\n", 1)[-1]
    for kind in ("Total", "Trainable", "Non-trainable"):
        text = text.replace(f" {kind} params: ", f" {kind} params per model: ")
    print_fn = print_fn or print
    print_fn(f'Array "{array.name}": {array.num_models} models of '
             f'"{stock.name}", each as below (one model\'s shapes and '
             "parameters; summary(fused=True) shows the fused layers).")
    print_fn(text)
    print_fn(f" Params of the array's {array.num_models} models: {total:,}")
