"""Entry point of the Bazel py_test targets: runs pytest on the given file."""

import sys

import pytest

if __name__ == "__main__":
    # The runfiles tree is read-only for the test, so no .pytest_cache.
    sys.exit(pytest.main(["-p", "no:cacheprovider", *sys.argv[1:]]))
