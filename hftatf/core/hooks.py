"""Functions that a lower layer calls and a higher one provides.

`FusedModel` (training) offers `unfuse`, `export_models` and
`from_exported` as methods, and `fuse_models` accepts exported paths, but
the code behind them (conversion, export) builds on training. Imports
point down only, so the higher module registers its function here when it
is imported (`import hftatf` imports them all), and the lower one calls it
by name.
"""

_PROVIDED = {}


def provides(name):
    """Decorator: registers the decorated function as the hook `name`."""
    def register(function):
        _PROVIDED[name] = function
        return function
    return register


def call(name, /, *args, **kwargs):
    """Calls the function registered as `name` (positional only: the
    function may take a `name` of its own)."""
    try:
        function = _PROVIDED[name]
    except KeyError:
        raise RuntimeError(
            f"hftatf's `{name}` is not loaded. Import hftatf itself "
            "(`import hftatf`), not only one of its modules.") from None
    return function(*args, **kwargs)
