"""A quiet start for the launchers.

TensorFlow's C++ runtime logs a dozen notes as it is imported and starts
(oneDNN, CUDA drivers, CPU instructions, XLA service) before the first
line of a run. `TF_CPP_MIN_LOG_LEVEL` silences most, but only if it is set
before TensorFlow is imported; and the notes of its import itself are
written through absl before any level applies. A console script
(`hftatf-train`) or `python -m hftatf.tpu.train` imports `hftatf`, and so
TensorFlow, before the launcher's own module runs, so `hftatf/__init__.py`
calls `quiet_launcher_start()` before it imports anything else. It acts
only in a launcher's process, and never where the user set the level or
asked for TensorFlow's logs with `--verbose=3`: it sets the level, then
imports TensorFlow with its notes (`I...` lines) left out (only where Keras
will run on TensorFlow: on another backend hftatf imports no TensorFlow);
its warnings and errors still show. Library users' processes are left as
they are.
"""

import importlib
import importlib.util
import json
import os
import re
import sys
import tempfile

LAUNCHERS = {"hftatf-train": "hftatf.tpu.train",
             "hftatf-tune": "hftatf.tpu.tune"}

# Hides the runtime's INFO and WARNING lines; its errors still show, and
# so does everything logged from Python (the launcher's own warnings).
QUIET_LEVEL = "2"

# `--verbose` of the launchers that keeps TensorFlow's logging.
VERBOSE_TENSORFLOW = 3


def launcher_argv(argv=None, orig_argv=None):
    """The command line of this process if it runs a launcher (by its
    console script or `python -m`), else None."""
    argv = sys.argv if argv is None else argv
    orig_argv = getattr(sys, "orig_argv", []) if orig_argv is None else (
        orig_argv)
    if argv and os.path.basename(argv[0]) in LAUNCHERS:
        return list(argv)
    # Under `python -m`, `sys.argv[0]` is "-m" while the module's parent
    # packages are imported; the interpreter's own command line names it.
    for i, arg in enumerate(orig_argv[:-1]):
        if arg == "-m" and orig_argv[i + 1] in LAUNCHERS.values():
            return list(orig_argv[i + 1:])
    return None


def asks_for_tensorflow_logs(argv):
    """Whether `argv` gives `--verbose` at `VERBOSE_TENSORFLOW` or more."""
    for i, arg in enumerate(argv):
        value = None
        if arg.startswith("--verbose="):
            value = arg.partition("=")[2]
        elif arg == "--verbose" and i + 1 < len(argv):
            value = argv[i + 1]
        if value is not None and value.strip().isdigit() and (
                int(value) >= VERBOSE_TENSORFLOW):
            return True
    return False


def quiet_launcher_start(environ=None, argv=None, orig_argv=None):
    """Sets `TF_CPP_MIN_LOG_LEVEL` to `QUIET_LEVEL` in a launcher's
    process where neither its user nor its `--verbose` decides otherwise;
    returns whether it did."""
    environ = os.environ if environ is None else environ
    command = launcher_argv(argv, orig_argv)
    if command is None or "TF_CPP_MIN_LOG_LEVEL" in environ or (
            asks_for_tensorflow_logs(command)):
        return False
    environ["TF_CPP_MIN_LOG_LEVEL"] = QUIET_LEVEL
    if keras_backend_setting(environ) == "tensorflow" and (
            importlib.util.find_spec("tensorflow") is not None):
        _import_without_notes("tensorflow")
    return True


def keras_backend_setting(environ=None):
    """The Keras backend this process will run, read as Keras reads it
    (`KERAS_BACKEND`, else `backend` of `$KERAS_HOME/keras.json`, else
    TensorFlow) without importing Keras, which imports TensorFlow."""
    environ = os.environ if environ is None else environ
    if environ.get("KERAS_BACKEND"):
        return environ["KERAS_BACKEND"]
    home = environ.get("KERAS_HOME") or os.path.join(
        os.path.expanduser("~"), ".keras")
    try:
        with open(os.path.join(home, "keras.json")) as file:
            return json.load(file).get("backend", "tensorflow")
    except (OSError, ValueError, AttributeError):
        return "tensorflow"


# The runtime's notes: absl's INFO lines (`I1204 16:37:21.49 ...`), its
# word on logging before initialisation, and the continuation line of the
# CPU-instructions note.
_NOTE = re.compile(r"^(I\d{4} |WARNING: All log messages before "
                   r"absl::InitializeLog|To enable the following "
                   r"instructions)")


def without_notes(text):
    """`text` of stderr without the runtime's notes (`_NOTE`)."""
    return "".join(line for line in text.splitlines(keepends=True)
                   if not _NOTE.match(line))


def _import_without_notes(name):
    """Imports module `name` with what it writes to the process' stderr
    (file descriptor 2, where C++ libraries write) captured, and writes
    it back without the notes."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            importlib.import_module(name)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            sys.stderr.write(without_notes(
                captured.read().decode(errors="replace")))
            sys.stderr.flush()
