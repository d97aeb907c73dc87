"""Launchers: train an array of zoo models from the command line on a CPU,
GPUs, a TPU VM or a TPU pod slice (`hftatf-train`; see tpu/README.md).

Installed as `hftatf.tpu`: `train` (flags, the run), `config` (the
validated `Config`), `data` (distributed input pipelines), `results`
(history files), `header`, `plots` and `page` (what a run prints and
writes besides: its header, plots and `report.html`).
"""
