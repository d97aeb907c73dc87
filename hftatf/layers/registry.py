"""The one map from stock Keras layer classes to their fused forms.

Each fused form registers itself next to its class (`register`); which
form a given layer takes, fused, folded or once per model, is decided in
`hftatf.layers.resolve`.
"""

from hftatf.layers.base import FusedForm

_FUSED_FORMS = {}


def register(*stock_classes):
    """Class decorator: registers the decorated class as the fused form of
    each of `stock_classes`.

    The fused form must provide `from_stock(layer, num_models)`. Lookup is by
    exact class: a subclass of a stock layer may change its computation, so
    it is not fused as its parent (it runs once per model, as every layer
    without a fused form of its own does: `hftatf.layers.resolve`).
    """

    def decorator(form):
        if not (isinstance(form, type) and issubclass(form, FusedForm)):
            raise TypeError(
                "hftatf.layers.registry.register takes a fused form: a "
                "subclass of hftatf.layers.FusedLayer (or of FusedFold, "
                f"FusedPerModel). Received: {form!r}. Derive the class from "
                "FusedLayer.")
        for stock_class in stock_classes:
            _FUSED_FORMS[stock_class] = form
        return form

    return decorator


def registered_form(layer):
    """The fused form registered for `layer`'s exact class, or None."""
    return _FUSED_FORMS.get(type(layer))


def refusal_of_registered_form(layer):
    """Why the fused form registered for `layer`'s class does not take
    this instance (`fused_form.refusal(layer)`, e.g. an `RNN` of a cell of
    its own); None where it does or where none is registered."""
    form = registered_form(layer)
    refusal = getattr(form, "refusal", None)
    return None if refusal is None else refusal(layer)


def supported_layers():
    """The stock layer classes that have a registered fused form."""
    return sorted(_FUSED_FORMS, key=lambda c: c.__name__)


def registered_classes(kind):
    """The stock layer classes whose registered form is of `kind` (see
    `hftatf.layers.base.FusedLayer.kind`)."""
    return [c for c in supported_layers() if _FUSED_FORMS[c].kind == kind]
