"""Which form a stock layer takes in an array, and building it.

In order: the fused form registered for its class (`registry`), where
that form takes the instance; else the layer once per model
(`FusedPerModel`), where it can run so; else a refusal that says why. A
form states its kind as a class attribute: `"fused"` (its own
computation), `"fold"` (the stock layer on the models folded into the
batch, `FusedFold`) or `"per_model"`.
"""

from hftatf.layers import objects, per_model, registry
from hftatf.layers.fold import FusedFold
from hftatf.layers.per_model import FusedPerModel

__all__ = ["FusedFold", "FusedPerModel"]


def _form(layer):
    """The form of `layer` (see the module docstring), or None."""
    registered = registry.registered_form(layer)
    if registered is not None and (
            registry.refusal_of_registered_form(layer) is None):
        return registered
    if per_model.refusal(layer) is None:
        return FusedPerModel
    return None


def is_supported(layer):
    """Whether `hftatf.fuse` can fuse `layer`."""
    return _form(layer) is not None


def runs_per_model(layer):
    """Whether `layer`'s fused form runs it once per model
    (`hftatf.layers.FusedPerModel`) instead of fusing its computation."""
    form = _form(layer)
    return form is not None and form.kind == FusedPerModel.kind


def is_foldable(layer):
    """Whether `layer` is a weightless per-sample layer (fused by folding)."""
    registered = registry.registered_form(layer)
    return registered is not None and registered.kind == FusedFold.kind


def fused_form(layer):
    """Returns the fused class for `layer`, or raises ValueError.

    A layer without a registered fused form (or one whose registered form
    refuses it, like an `RNN` of a cell of its own) runs once per model
    (`hftatf.layers.FusedPerModel`); only a layer that cannot run so (it
    keeps state outside Keras variables) is refused."""
    form = _form(layer)
    if form is not None:
        return form
    # Its own form's reason where it has one: it says what would make the
    # layer fuse.
    reason = (registry.refusal_of_registered_form(layer)
              or per_model.refusal(layer))
    raise ValueError(
        f"hftatf cannot fuse layer '{layer.name}' of class "
        f"{type(layer).__module__}.{type(layer).__name__}: "
        f"{reason.rstrip('.')}.")


def takes_shared_input(layer):
    """Whether the fused form of `layer` can take the input batch all
    models share (`fuse_layer(..., shared_input=True)`)."""
    return is_supported(layer) and _form(layer).fuses_shared_input(layer)


def takes_models_first(layer):
    """Whether the fused form of `layer` can compute on activations with
    the models first (`fuse_layer(..., models_first=True)`)."""
    return is_supported(layer) and _form(layer).takes_models_first(layer)


def prefers_models_first(layer):
    """Whether the fused form of `layer` computes faster with the models
    first, so that `hftatf.fuse` gives it that layout even from inputs
    without it (a class attribute of the form, or a class method of the
    stock layer where it depends on it)."""
    prefers = fused_form(layer).prefers_models_first
    return bool(prefers(layer) if callable(prefers) else prefers)


def fuse_layer(layer, num_models, shared_input=False, models_first=False):
    """Returns the fused form of the stock `layer` (weights not copied).

    With `shared_input`, the fused layer takes the input batch all models
    share (`[batch, ...]`, no model axis); only layers that
    `takes_shared_input` can. With `models_first`, its activations have the
    models first (`[B, batch, ...]`; outputs only, with `shared_input`);
    only layers that `takes_models_first` can.
    """
    if shared_input and not takes_shared_input(layer):
        raise ValueError(
            f"Layer '{layer.name}' ({type(layer).__name__}) has no fused form "
            "that takes a shared input.")
    if models_first and not takes_models_first(layer):
        raise ValueError(
            f"Layer '{layer.name}' ({type(layer).__name__}) has no fused form "
            "that computes with the models first.")
    kwargs = {}
    if shared_input:
        kwargs["shared_input"] = True
    if models_first:
        kwargs["models_first"] = True
    # The fused form is built from the stock layer's config: it finds the
    # functions and classes of a script's own that the layer holds.
    with objects.scope([layer]):
        return fused_form(layer).from_stock(layer, num_models, **kwargs)


def supported_layers():
    """The stock layer classes that `hftatf.fuse` can fuse."""
    return registry.supported_layers()


def folded_layers():
    """The stock layer classes fused by folding the models into the batch
    (`hftatf.layers.FusedFold`)."""
    return registry.registered_classes(FusedFold.kind)
