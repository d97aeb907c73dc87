"""Installs hftatf, with the model zoo and launchers under its namespace."""

import pathlib
import re

import setuptools

HERE = pathlib.Path(__file__).parent
VERSION = re.search(
    r'__version__ = "([^"]+)"',
    (HERE / "hftatf" / "core" / "version.py").read_text(),
).group(1)

setuptools.setup(
    name="hftatf",
    version=VERSION,
    description=(
        "Horizontally fused training arrays for Keras 3 (TensorFlow, JAX): "
        "train B same-architecture models as one fused model."
    ),
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    # `models/` and `tpu/` live at the top of the repository but install as
    # `hftatf.models` and `hftatf.tpu`, never as top-level packages.
    packages=["hftatf", *(f"hftatf.{name}" for name in
                          setuptools.find_packages("hftatf")),
              "hftatf.models", "hftatf.tpu"],
    package_dir={
        "hftatf": "hftatf",
        "hftatf.models": "models",
        "hftatf.tpu": "tpu",
    },
    # TensorFlow is the default backend (`pip install hftatf` is the
    # TensorFlow install); the `jax` extra adds Keras's JAX backend.
    install_requires=[
        "tensorflow>=2.21,<2.22",
        "keras>=3.15,<4",
        "absl-py>=2.1",
        "numpy>=1.26",
    ],
    extras_require={
        # Keras's JAX backend (KERAS_BACKEND=jax); on a GPU, JAX's own CUDA
        # wheels (`jax[cuda12]`) instead.
        "jax": ["jax>=0.4.30"],
        # The launcher's main job: its data and its plots.
        "data": ["scikit-learn>=1.4", "matplotlib>=3.8"],
        "plot": ["matplotlib>=3.8"],
        # `benchmarks.kernels` times the fused XLA programs through JAX.
        "bench": ["matplotlib>=3.8", "jax>=0.4.30"],
        # `hftatf-train --config_file` reads YAML with it.
        "tpu": ["pyyaml>=5.1"],
        # `hftatf.tuning`: keras-tuner tuners that train arrays.
        "tune": ["keras-tuner>=1.4,<2", "pyyaml>=5.1"],
        "dev": ["pytest>=8", "pytest-xdist>=3.5,<4", "ruff>=0.6",
                "scikit-learn>=1.4", "matplotlib>=3.8", "pyyaml>=5.1",
                "keras-tuner>=1.4,<2", "jax>=0.4.30"],
    },
    entry_points={
        "console_scripts": ["hftatf-train = hftatf.tpu.train:run",
                            "hftatf-tune = hftatf.tpu.tune:run"],
    },
)
