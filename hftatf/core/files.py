"""The files that callbacks write, at local or remote paths.

As stock Keras callbacks do, a remote path (`gs://bucket/...`, any
`scheme://`) is read and written through TensorFlow's `tf.io.gfile`, which
needs TensorFlow; a local path with Python's own calls, which need nothing
more on any Keras backend.
"""

import os
import pathlib
import re
import tempfile

from hftatf.core.optional import tensorflow

_REMOTE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_remote(path):
    return bool(_REMOTE.match(os.fspath(path)))


def _gfile(path):
    return tensorflow(f"Writing to the remote path {str(path)!r}").io.gfile


def exists(path):
    return _gfile(path).exists(path) if is_remote(path) else (
        os.path.exists(path))


def open_file(path, mode):
    """`path` opened in text `mode`, lines written as they are given."""
    if is_remote(path):
        return _gfile(path).GFile(path, mode)
    return open(path, mode, newline="")


def makedirs(path):
    if is_remote(path):
        _gfile(path).makedirs(path)
    else:
        os.makedirs(path, exist_ok=True)


def replace(source, target):
    """Renames `source` to `target`, replacing a file there."""
    if is_remote(source) or is_remote(target):
        _gfile(source).rename(source, target, overwrite=True)
    else:
        os.replace(source, target)


def remove(path):
    if is_remote(path):
        _gfile(path).remove(path)
    else:
        os.remove(path)


def unwritable_directory_error(path, keep=True):
    """The `OSError` that making the local directory `path` and writing a
    file in it raises, or None where both work. With `keep=False` the
    directories made to find out are removed again."""
    path = pathlib.Path(path)
    missing = [p for p in (path, *path.parents) if not p.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        return error
    finally:
        if not keep:
            for made in missing:
                if made.is_dir():
                    made.rmdir()
    return None
