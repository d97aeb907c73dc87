"""The one map from stock Keras layer classes to their fused forms."""

_FUSED_FORMS = {}


def register(*stock_classes):
    """Class decorator: registers the decorated class as the fused form of
    each of `stock_classes`.

    The fused form must provide `from_stock(layer, num_models)`. Lookup is by
    exact class: a subclass of a stock layer may change its computation, so
    it is not fused as its parent.
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


def is_supported(layer):
    """Whether `hftatf.fuse` can fuse `layer`."""
    return type(layer) in _FUSED_FORMS and _refusal(layer) is None


def is_foldable(layer):
    """Whether `layer` is a weightless per-sample layer (fused by folding)."""
    from hftatf.layers.fold import FusedFold

    return _FUSED_FORMS.get(type(layer)) is FusedFold


def fused_form(layer):
    """Returns the fused class for the stock `layer`, or raises ValueError."""
    try:
        form = _FUSED_FORMS[type(layer)]
    except KeyError:
        supported = ", ".join(sorted(c.__name__ for c in _FUSED_FORMS))
        name = type(layer).__name__
        hint = ""
        if layer.built and not layer.weights:
            hint = (f" A layer without weights that computes each sample on "
                    f"its own fuses by folding the models into the batch: "
                    f"hftatf.layers.registry.register({name})("
                    "hftatf.layers.FusedFold); one that treats the batch as "
                    "a whole (mixing its samples, or drawing once per "
                    "batch) with hftatf.layers.FusedPerModel instead.")
        raise ValueError(
            f"hftatf cannot fuse layer '{layer.name}' of class "
            f"{type(layer).__module__}.{name}: it has no fused "
            f"form. Supported layers: {supported}. Write this part of the "
            "model with hftatf.layers directly, or register a fused form "
            f"with hftatf.layers.registry.register.{hint}"
        ) from None
    refusal = _refusal(layer)
    if refusal is not None:
        raise ValueError(
            f"hftatf cannot fuse layer '{layer.name}' of class "
            f"{type(layer).__module__}.{type(layer).__name__}: {refusal}")
    return form


def takes_shared_input(layer):
    """Whether the fused form of `layer` can take the input batch all
    models share (`fuse_layer(..., shared_input=True)`)."""
    return is_supported(layer) and getattr(
        _FUSED_FORMS[type(layer)], "fuses_shared_input", lambda _: False)(
            layer)


def takes_models_first(layer):
    """Whether the fused form of `layer` can compute on activations with
    the models first (`fuse_layer(..., models_first=True)`)."""
    return is_supported(layer) and getattr(
        _FUSED_FORMS[type(layer)], "takes_models_first", lambda _: False)(
            layer)


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
    return fused_form(layer).from_stock(layer, num_models, **kwargs)


def supported_layers():
    """The stock layer classes that `hftatf.fuse` can fuse."""
    return sorted(_FUSED_FORMS, key=lambda c: c.__name__)


def folded_layers():
    """The stock layer classes fused by folding the models into the batch
    (`hftatf.layers.FusedFold`)."""
    from hftatf.layers.fold import FusedFold

    return [c for c in supported_layers() if _FUSED_FORMS[c] is FusedFold]
