"""The backend trainer `FusedModel` mixes in, chosen once by
`keras.backend.backend()`, as `keras/src/models/model.py` chooses its own.
"""

import keras

if keras.backend.backend() == "tensorflow":
    from hftatf.training.tensorflow_trainer import (
        TensorFlowTrainer as Trainer,
    )
elif keras.backend.backend() == "jax":
    from hftatf.training.jax_trainer import JAXTrainer as Trainer
else:
    from hftatf.training.unsupported_trainer import (
        UnsupportedBackendTrainer as Trainer,
    )

__all__ = ["Trainer"]
