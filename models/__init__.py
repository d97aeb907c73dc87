"""Model zoo: plain Keras builders that `hftatf.fuse` turns into arrays.

Installed as `hftatf.models`.
"""
