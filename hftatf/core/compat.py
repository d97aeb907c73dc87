"""Every access to private Keras and TensorFlow API, in one place.

A Keras or TensorFlow minor release may rename or remove any of these:
this module is where to look when one does. Each entry says which public
API is missing and the versions it was checked on (Keras 3.15, TensorFlow
2.21, JAX 0.10 unless it says otherwise). Other hftatf modules import
private names from here, never from `keras.src` or `tensorflow.python`.
"""
