"""The worker processes of `python -m benchmarks.run`: one task in a fresh
process (`benchmarks.worker`), or B of them started together, and their
results read from what they print (`benchmarks.protocol`).
"""

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks import protocol

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _command(spec):
    return [sys.executable, "-m", "benchmarks.worker", json.dumps(spec)]


def _environment():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


class WorkerError(RuntimeError):
    """A benchmark worker process that ended without a result."""


def _parse_result(stdout, stderr, spec):
    for line in reversed(stdout.splitlines()):
        if line.startswith(protocol.RESULT_PREFIX):
            return json.loads(line[len(protocol.RESULT_PREFIX):])
    raise WorkerError(
        f"Benchmark worker {spec['task']} for {spec['model']} (B="
        f"{spec.get('num_models')}) failed:\n{stderr[-4000:]}")


def run_worker(spec, timeout):
    """Runs one task in a fresh process; returns its result dict."""
    done = subprocess.run(_command(spec), capture_output=True, text=True,
                          cwd=ROOT, env=_environment(), timeout=timeout)
    return _parse_result(done.stdout, done.stderr, spec)


def run_concurrent(spec, num_models, timeout):
    """B `single` workers at once: all warm up, then all start together.

    Returns the per-process results. Raises `subprocess.TimeoutExpired`
    when the whole measurement, warm-up included, takes over `timeout`
    seconds.
    """
    processes, logs = [], []
    deadline = time.monotonic() + timeout
    # Waiting for READY blocks on a pipe: past the deadline this kills the
    # workers, which ends the wait.
    expired = threading.Event()
    alarm = threading.Timer(timeout, _expire, (expired, processes))
    try:
        for index in range(num_models):
            log = tempfile.TemporaryFile(mode="w+")
            logs.append(log)
            processes.append(subprocess.Popen(
                _command({**spec, "task": "single",
                          "seed": spec["seed"] + index}),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                text=True, cwd=ROOT, env=_environment()))
        alarm.start()
        for process, log in zip(processes, logs):
            line = process.stdout.readline()
            while line and line.strip() != protocol.READY:
                line = process.stdout.readline()
            if expired.is_set():
                raise subprocess.TimeoutExpired(_command(spec), timeout)
            if not line:
                log.seek(0)
                raise WorkerError(
                    f"A concurrent worker for {spec['model']} exited "
                    f"before it was ready:\n{log.read()[-4000:]}")
        alarm.cancel()
        for process in processes:
            process.stdin.write("go\n")
            process.stdin.flush()
        results = []
        for process, log in zip(processes, logs):
            stdout, _ = process.communicate(
                timeout=max(0.0, deadline - time.monotonic()))
            log.seek(0)
            results.append(_parse_result(stdout, log.read(), spec))
        return results
    finally:
        alarm.cancel()
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for log in logs:
            log.close()


def _expire(expired, processes):
    expired.set()
    for process in processes:
        if process.poll() is None:
            process.kill()
