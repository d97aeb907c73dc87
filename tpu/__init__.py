"""Launchers: train an array of zoo models from the command line on a CPU,
GPUs, a TPU VM or a TPU pod slice (`hftatf-train`; see tpu/README.md).

Installed as `hftatf.tpu`: `train` (flags, the run), `config` (the
validated `Config`), `data` (distributed input pipelines), `results`
(per-model table, CSV and loss curves).
"""
