"""The one map from stock Keras layer classes to their fused forms."""

_FUSED_FORMS = {}


def register(*stock_classes):
    """Class decorator: registers the decorated class as the fused form of
    each of `stock_classes`.

    The fused form must provide `from_stock(layer, num_models)`. Lookup is by
    exact class: a subclass of a stock layer may change its computation, so
    it is not fused as its parent (it runs once per model, as every layer
    without a fused form of its own does: `fused_form`).
    """

    def decorator(fused_form):
        for stock_class in stock_classes:
            _FUSED_FORMS[stock_class] = fused_form
        return fused_form

    return decorator


def _refusal(layer):
    """Why the registered fused form of `layer` cannot take this instance
    (`fused_form.refusal(layer)`, e.g. an `RNN` of a cell of its own), or
    None."""
    refusal = getattr(_FUSED_FORMS[type(layer)], "refusal", None)
    return None if refusal is None else refusal(layer)


def refusal_of_registered_form(layer):
    """Why the fused form registered for `layer`'s class does not take
    this instance (see `_refusal`); None where it does or where none is
    registered."""
    return _refusal(layer) if type(layer) in _FUSED_FORMS else None


def _form(layer):
    """The fused form of `layer`: its registered one where that takes the
    instance, `FusedPerModel` (the layer once per model) for any other
    layer it can run, else None."""
    from hftatf.layers import per_model

    if type(layer) in _FUSED_FORMS and _refusal(layer) is None:
        return _FUSED_FORMS[type(layer)]
    if per_model.refusal(layer) is None:
        return per_model.FusedPerModel
    return None


def is_supported(layer):
    """Whether `hftatf.fuse` can fuse `layer`."""
    return _form(layer) is not None


def runs_per_model(layer):
    """Whether `layer`'s fused form runs it once per model
    (`hftatf.layers.FusedPerModel`) instead of fusing its computation."""
    from hftatf.layers.per_model import FusedPerModel

    return _form(layer) is FusedPerModel


def is_foldable(layer):
    """Whether `layer` is a weightless per-sample layer (fused by folding)."""
    from hftatf.layers.fold import FusedFold

    return _FUSED_FORMS.get(type(layer)) is FusedFold


def fused_form(layer):
    """Returns the fused class for `layer`, or raises ValueError.

    A layer without a registered fused form (or one whose registered form
    refuses it, like an `RNN` of a cell of its own) runs once per model
    (`hftatf.layers.FusedPerModel`); only a layer that cannot run so (it
    keeps state outside Keras variables) is refused."""
    from hftatf.layers import per_model

    form = _form(layer)
    if form is not None:
        return form
    raise ValueError(
        f"hftatf cannot fuse layer '{layer.name}' of class "
        f"{type(layer).__module__}.{type(layer).__name__}: "
        f"{per_model.refusal(layer)}")


def takes_shared_input(layer):
    """Whether the fused form of `layer` can take the input batch all
    models share (`fuse_layer(..., shared_input=True)`)."""
    return is_supported(layer) and getattr(
        _form(layer), "fuses_shared_input", lambda _: False)(layer)


def takes_models_first(layer):
    """Whether the fused form of `layer` can compute on activations with
    the models first (`fuse_layer(..., models_first=True)`)."""
    return is_supported(layer) and getattr(
        _form(layer), "takes_models_first", lambda _: False)(layer)


def prefers_models_first(layer):
    """Whether the fused form of `layer` computes faster with the models
    first, so that `hftatf.fuse` gives it that layout even from inputs
    without it (a class attribute of the form, or a class method of the
    stock layer where it depends on it)."""
    prefers = getattr(fused_form(layer), "prefers_models_first", False)
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
    from hftatf.layers import objects

    # The fused form is built from the stock layer's config: it finds the
    # functions and classes of a script's own that the layer holds.
    with objects.scope([layer]):
        return fused_form(layer).from_stock(layer, num_models, **kwargs)


def supported_layers():
    """The stock layer classes that `hftatf.fuse` can fuse."""
    return sorted(_FUSED_FORMS, key=lambda c: c.__name__)


def folded_layers():
    """The stock layer classes fused by folding the models into the batch
    (`hftatf.layers.FusedFold`)."""
    from hftatf.layers.fold import FusedFold

    return [c for c in supported_layers() if _FUSED_FORMS[c] is FusedFold]
