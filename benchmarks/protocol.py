"""What a benchmark worker process prints for its parent (`run`) and how
the parent sums measurements up, kept apart from the worker so that the
parent imports no Keras."""

import statistics

# The last line of a worker's output: this prefix, then its result as JSON.
RESULT_PREFIX = "RESULT "
# A concurrent worker's line once it has compiled and waits to start.
READY = "READY"


def summarize(values):
    """`(median, min, max)` of a non-empty list."""
    return statistics.median(values), min(values), max(values)
