"""Tuning across machines: keras-tuner's chief/worker mode, with arrays.

keras-tuner distributes a search with one oracle process (the chief) and
any number of worker processes that ask it for trials over gRPC. Every
process runs the same script; environment variables give each its role:

- `KERASTUNER_TUNER_ID`: `"chief"` for the oracle, a unique id per worker;
- `KERASTUNER_ORACLE_IP`, `KERASTUNER_ORACLE_PORT`: the chief's address.

A `FusedTuner` worker asks for up to `num_models` trials at a time and
trains them as arrays, so a cluster of W workers trains up to
W x `num_models` trials at once. The project directory must be shared by
all processes (a network file system, or one machine) for Hyperband to
continue a trial that another worker trained and for `get_best_models()`.

`launch` starts a chief and workers as local processes: several
accelerators of one machine (one worker per device, chosen by
`worker_env`), or a test on loopback.
"""

import os
import socket
import subprocess
import time

__all__ = ["ORACLE_IP", "ORACLE_PORT", "TUNER_ID", "environment",
           "free_port", "launch", "role"]

TUNER_ID = "KERASTUNER_TUNER_ID"
ORACLE_IP = "KERASTUNER_ORACLE_IP"
ORACLE_PORT = "KERASTUNER_ORACLE_PORT"


def environment(tuner_id, ip, port):
    """The environment variables that make a process `tuner_id` ("chief",
    or a worker's unique id) of the search whose oracle serves at
    `ip:port`."""
    tuner_id = str(tuner_id)
    if not tuner_id or any(c.isspace() for c in tuner_id):
        raise ValueError(
            "A tuner id must be a non-empty string without spaces. "
            f"Received: {tuner_id!r}.")
    return {TUNER_ID: tuner_id, ORACLE_IP: str(ip), ORACLE_PORT: str(port)}


def role(environ=None):
    """`"chief"`, `"worker"`, or None when this process is not part of a
    distributed search (keras-tuner's reading of the variables)."""
    environ = os.environ if environ is None else environ
    if ORACLE_IP not in environ:
        return None
    return "chief" if "chief" in environ.get(TUNER_ID, "") else "worker"


def free_port(host="127.0.0.1"):
    """A TCP port on `host` that is free now (for a local chief)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def launch(command, num_workers, ip="127.0.0.1", port=None, env=None,
           worker_env=None, log_dir=None, timeout=None, cwd=None):
    """Runs `command` as the chief and `num_workers` workers of one search,
    as local processes, and waits for them.

    Args:
        command: the program and its arguments (a list), run by every
            process, e.g. `[sys.executable, "search.py"]`.
        num_workers: the number of worker processes (>= 1).
        ip: the address the chief serves on.
        port: the chief's port; a free one by default.
        env: the environment of every process (default: this one's).
        worker_env: None, or a callable `index -> dict` of extra variables
            for worker `index`, e.g. `lambda i: {"CUDA_VISIBLE_DEVICES":
            str(i)}` for one worker per GPU.
        log_dir: None to let the processes print here, or a directory for
            one `<tuner id>.log` file per process.
        timeout: seconds after which every process is stopped and a
            TimeoutError raised; None to wait as long as it takes.
        cwd: the processes' working directory.

    Returns:
        `{tuner id: exit code}` for the chief and every worker.

    Raises:
        RuntimeError: if a process fails (the others are stopped: a chief
            would wait for a failed worker's trials forever, and workers
            for a failed chief).
    """
    if isinstance(num_workers, bool) or not isinstance(
            num_workers, int) or num_workers < 1:
        raise ValueError(
            "`num_workers` must be an int >= 1. Received: "
            f"num_workers={num_workers!r}.")
    if isinstance(command, str):
        raise TypeError(
            "`command` must be a list of arguments, e.g. [sys.executable, "
            f"'search.py']. Received the string {command!r}.")
    port = port or free_port(ip)
    base = dict(os.environ if env is None else env)
    ids = ["chief"] + [f"worker{i}" for i in range(num_workers)]
    processes, logs = {}, []
    try:
        for index, tuner_id in enumerate(ids):
            process_env = {**base, **environment(tuner_id, ip, port)}
            if tuner_id != "chief" and worker_env is not None:
                process_env.update(
                    {k: str(v) for k, v in worker_env(index - 1).items()})
            output = None
            if log_dir is not None:
                os.makedirs(log_dir, exist_ok=True)
                output = open(os.path.join(log_dir, f"{tuner_id}.log"), "w")
                logs.append(output)
            processes[tuner_id] = subprocess.Popen(
                list(command), env=process_env, cwd=cwd, stdout=output,
                stderr=subprocess.STDOUT if output else None)
        return _wait(processes, timeout)
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
        for output in logs:
            output.close()


def _wait(processes, timeout):
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        codes = {name: p.poll() for name, p in processes.items()}
        failed = [name for name, code in codes.items()
                  if code not in (None, 0)]
        if failed:
            raise RuntimeError(
                f"Tuning process {failed[0]} exited with code "
                f"{codes[failed[0]]}; the other processes were stopped.")
        if all(code is not None for code in codes.values()):
            return codes
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(
                f"The search did not finish within {timeout} s; its "
                "processes were stopped.")
        time.sleep(0.2)
