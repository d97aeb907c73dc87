"""Checks on user input shared by layers, optimizers and models."""

import numbers


def check_num_models(num_models):
    """Returns `num_models` as an int, or raises a ValueError that says why."""
    if isinstance(num_models, bool) or not isinstance(
        num_models, numbers.Integral
    ):
        raise TypeError(
            "`num_models` must be a positive integer (the number of models in "
            f"the array). Received: num_models={num_models!r} of type "
            f"{type(num_models).__name__}."
        )
    if num_models < 1:
        raise ValueError(
            "`num_models` must be a positive integer (the number of models in "
            f"the array). Received: num_models={num_models}. Use "
            "num_models=1 for a single model."
        )
    return int(num_models)


def shared(name, value):
    """Returns `value`, an argument that every model of an array shares (a
    flag, a count); raises a ValueError for a sequence, which elsewhere in
    hftatf means one value per model."""
    if isinstance(value, (list, tuple)) or (
            hasattr(value, "shape") and len(value.shape) > 0):
        raise ValueError(
            f"`{name}` is shared by all models of an array: give one value, "
            f"not one per model. Received: {name}={value!r}. Models that "
            f"need different `{name}` train in arrays of their own.")
    return value


def check_model_axis(layer_name, num_models, shape, axis=1):
    """Raises a ValueError unless axis `axis` of `shape` (1, or 0 for
    activations with the models first) is a model axis of B."""
    if len(shape) < 2 or shape[axis] not in (None, num_models):
        layout = ("[num_models, batch, ...]" if axis == 0
                  else "[batch, num_models, ...]")
        raise ValueError(
            f"Layer '{layer_name}' of an array of {num_models} models expects "
            f"inputs of shape {layout} with "
            f"num_models={num_models} on axis {axis}. Received input shape "
            f"{tuple(shape)}."
        )
