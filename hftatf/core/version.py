"""hftatf's version (`hftatf.__version__`), in a module of its own so that
the modules that record it (export metadata) need not import the package
that imports them."""

__version__ = "0.1.0"
