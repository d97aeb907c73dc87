"""FusedModel: an array of B models trained, evaluated and served as one.

The class holds what Keras's `Model` holds: building, calling, compiling
and the public API. Its training is split by concern over
`hftatf.training` (the backend's step, label routing, per-model losses and
metrics, divergence, surgery) and `hftatf.passes`, which it mixes in.
"""

import json

import keras

from hftatf import backup, passes, progress, report
from hftatf import optimizers as fused_optimizers
from hftatf import summary as array_summary
from hftatf.api import hftatf_export
from hftatf.core import compat, hooks
from hftatf.core.compat import (
    compute_output_spec,
    no_automatic_dependency_tracking,
)
from hftatf.core.logs import check_stock_callbacks
from hftatf.core.validation import check_backend, check_num_models
from hftatf.layers import convolutional, layer_state, per_model
from hftatf.training import divergence, losses, routing, surgery
from hftatf.training.divergence import ModelStatus
from hftatf.training.surgery import (
    set_trainable_flags,
    set_weight_states,
    trainable_flags,
    weight_states,
)
from hftatf.training.trainer import Trainer


def _backups_last(callbacks):
    """`callbacks` with the backups (stock and `hftatf.backup`) last, so
    that each saves what the others did at an epoch's end (a model that
    early stopping froze); each `hftatf.backup.BackupAndRestore` is given
    the others, whose state it backs up."""
    is_backup = (keras.callbacks.BackupAndRestore, backup.BackupAndRestore)
    others = [c for c in callbacks if not isinstance(c, is_backup)]
    backups = [c for c in callbacks if isinstance(c, is_backup)]
    for callback in backups:
        if isinstance(callback, backup.BackupAndRestore):
            callback.callbacks = others
    return others + backups


@hftatf_export
class FusedModel(Trainer, routing.LabelRouting, losses.PerModelLosses,
                  divergence.Divergence, passes.PassPlanning,
                  surgery.Surgery, keras.Model):
    """An array of `num_models` same-architecture models trained as one.

    Layout: every output is `[batch, B, ...]` (model `b`'s output is
    `y[:, b]`). Each input is either shared by all models (`[batch, ...]`)
    or given per model (`[batch, B, ...]`). Labels may be shared
    (`[batch, ...]`) or per model (`[batch, B, ...]`), and so may sample
    weights (`[batch, B, ...]` is per model when the labels are).

    Training: each model's loss is exactly the loss a stock Keras model would
    compute on its own outputs (its mean over the batch, its regularization
    losses); the array minimises their sum, so each model's gradient is its
    own. Logs carry `loss` (the mean over models) and `loss_0` ...
    `loss_{B-1}`, and likewise every metric (`accuracy`, `accuracy_0`, ...),
    so stock callbacks and the progress bar read them.

    Build one with `hftatf.fuse(model, num_models)` or
    `hftatf.fuse_models(models)`; or construct it like a functional model
    from `hftatf.layers`: `FusedModel(inputs, outputs, num_models=B)`.

    Args:
        inputs, outputs: as for a functional `keras.Model`.
        num_models: the number of models `B`.
        shared_inputs: one bool per input (or one for all): whether that
            input is shared by all models. Defaults to True for inputs of
            rank one less than the model's per-model inputs would have.
        source: the serialized stock model this array was fused from (set by
            `hftatf.fuse`); lets `unfuse` and saving rebuild it.
        **kwargs: `name`, `trainable`, as for `keras.Model`.
    """

    def __init__(self, inputs, outputs, num_models, shared_inputs=True,
                 source=None, **kwargs):
        super().__init__(inputs=inputs, outputs=outputs, **kwargs)
        check_backend()
        self.num_models = check_num_models(num_models)
        if isinstance(shared_inputs, bool):
            shared_inputs = [shared_inputs] * len(self.inputs)
        if len(shared_inputs) != len(self.inputs):
            raise ValueError(
                f"`shared_inputs` needs one bool per input ({len(self.inputs)}"
                f" inputs). Received: shared_inputs={shared_inputs!r}."
            )
        self._shared_inputs = tuple(bool(s) for s in shared_inputs)
        # Kept as text so that Keras' attribute tracking leaves it alone.
        self._source_json = None if source is None else json.dumps(source)
        self._per_model_labels = None
        self._model_losses = None
        self._model_metrics = None
        self._model_loss_tracker = None
        self._class_weight = None
        self._replica_jit_compile = False
        self._compiled_forward = None
        self._models_per_pass = None
        self._resolved_models_per_pass = None
        self._pass_models = passes.PassModels()
        self._status = ModelStatus(self.num_models)
        self._bad_batch = divergence.BatchProblems()
        self._reported_divergence = set()
        # The `layout` given to `hftatf.fuse`.
        self._layout = "auto"

    @property
    def shared_inputs(self):
        """One bool per input: whether all models share that input."""
        return self._shared_inputs

    @property
    def source_config(self):
        """The serialized stock model this array was fused from, or None."""
        return None if self._source_json is None else json.loads(
            self._source_json)

    # -- calling ------------------------------------------------------------

    @property
    def input_spec(self):
        # Inputs are checked in `call`, with messages about the model axis.
        return None

    @input_spec.setter
    def input_spec(self, value):
        pass

    def call(self, inputs, training=None, mask=None):
        for tensor, reference, shared in zip(
                self._flat_inputs(inputs), self.inputs, self._shared_inputs):
            self._check_input(tensor, reference, shared)
        return super().call(inputs, training=training, mask=mask)

    def _flat_inputs(self, inputs):
        """The input tensors in the order of `self.inputs`: a dict given
        to a model of listed inputs is matched by input names, as Keras
        matches it."""
        if isinstance(inputs, dict) and not isinstance(
                compat.inputs_structure(self), dict):
            names = [tensor.name for tensor in self.inputs]
            if set(names) <= set(inputs):
                return [inputs[name] for name in names]
        return keras.tree.flatten(inputs)

    def _check_input(self, tensor, reference, shared):
        shape, expected = tuple(tensor.shape), tuple(reference.shape)
        if len(shape) == len(expected) and routing.same_shape(shape[1:],
                                                       expected[1:]):
            return
        name = reference.name
        B = self.num_models
        if shared:
            hint = (
                " It looks like one batch per model; fuse with "
                "shared_inputs=False to give each model its own input."
                if len(shape) == len(expected) + 1 and shape[1] == B else "")
            raise ValueError(
                f"Input '{name}' is shared by the {B} models of the array and "
                f"must have shape {expected} ([batch, ...] as for the stock "
                f"model). Received shape {shape}.{hint}")
        hint = (
            " It looks like one batch for all models; fuse with "
            "shared_inputs=True to share an input."
            if len(shape) == len(expected) - 1 else "")
        raise ValueError(
            f"Input '{name}' takes one batch per model: it must have shape "
            f"{expected}, i.e. [batch, num_models={B}, ...] with the model "
            f"axis at 1. Received shape {shape}.{hint}")

    # -- compiling ----------------------------------------------------------

    # As Keras's own `compile`: the trackers it makes replace the previous
    # compile's, instead of joining them in the tracked `_metrics`.
    @no_automatic_dependency_tracking
    def compile(self, optimizer="rmsprop", loss=None, loss_weights=None,
                metrics=None, weighted_metrics=None, run_eagerly=False,
                steps_per_execution=1, jit_compile="auto",
                per_model_labels=None, auto_scale_loss=True,
                models_per_pass="auto"):
        """Configures the array for training, as `keras.Model.compile`.

        Args:
            optimizer: a fused optimizer (`hftatf.optimizers.Adam(...)`), its
                name, or a stock Keras optimizer of the same name (converted:
                every model gets its hyper-parameters).
            loss, loss_weights, metrics, weighted_metrics: as in Keras; every
                model gets its own loss and its own copy of every metric.
            run_eagerly, steps_per_execution: as in Keras.
            jit_compile: as in Keras, except that `"auto"` turns XLA on
                wherever the model supports it, CPU included (fused arrays
                gain from it there too), but for models with convolutions
                on a CPU (XLA's CPU convolutions are slower than
                TensorFlow's and slow to compile). Under a distribution
                strategy, where
                Keras compiles no step with XLA, `"auto"` and True compile
                each replica's forward and backward pass (on TPU the whole
                replica step is compiled anyway).
            per_model_labels: None to tell shared labels (`[batch, ...]`)
                from per-model labels (`[batch, B, ...]`) by their shape;
                True or False to say which.
            auto_scale_loss: as in Keras.
            models_per_pass: how many models one forward and backward pass
                of the training step computes; the step runs
                `ceil(B / models_per_pass)` passes one after the other and
                then one optimizer step, and every model trains exactly as
                in one pass (see `hftatf.passes`). None: all models in one
                pass. `"auto"`: one pass, except on a CPU in a step compiled
                with XLA or for an array without convolutions, where a pass
                holds as many models as fit their activations in the
                cache share of the cores it runs on (at most 4 MiB per
                core; at least one model): there arrays of large
                models train faster one model at a time
                (benchmarks/README.md). Evaluation and prediction always
                run in one pass.
        """
        check_backend()
        models_per_pass = passes.check_models_per_pass(
            models_per_pass, self.num_models)
        losses.check_reduced(loss)
        optimizer = fused_optimizers.get(optimizer)
        if (auto_scale_loss and self.dtype_policy.name == "mixed_float16"
                and not isinstance(optimizer,
                                   keras.optimizers.LossScaleOptimizer)):
            # What stock compile does, with per-model scales: a stock
            # LossScaleOptimizer would skip every model when one overflows.
            optimizer = fused_optimizers.LossScaleOptimizer(
                optimizer, name="loss_scale_optimizer")
        optimizer.num_models = self.num_models
        replica_jit = self._uses_replica_jit(jit_compile, run_eagerly)
        super().compile(
            optimizer=optimizer, loss=loss, loss_weights=loss_weights,
            metrics=None, weighted_metrics=None, run_eagerly=run_eagerly,
            steps_per_execution=steps_per_execution,
            # A strategy's whole step does not compile (nor does a stock
            # model's): each replica's pass is compiled instead.
            jit_compile=False if replica_jit else jit_compile,
            auto_scale_loss=auto_scale_loss)
        # Each model's loss is its own `CompileLoss` (`compile_model_losses`).
        # Keras's would never be built, and Keras traces a model whose
        # compiled loss is unbuilt again at every `fit`, `evaluate` and
        # `train_on_batch` call to build it.
        self._compile_loss = None
        self._per_model_labels = per_model_labels
        self._user_loss = loss
        if (models_per_pass not in (None, "auto")
                and models_per_pass < self.num_models
                and self._weights_assigned_in_training()):
            layer = next(layer for layer in compat.inner_layers(self)
                         if getattr(layer, "assigns_weights_in_training",
                                    False))
            raise ValueError(
                f"Array '{self.name}' trains in one pass: its layer "
                f"'{layer.name}' ({type(layer).__name__}) assigns trainable "
                "weights in its forward pass, which passes of fewer models "
                "cannot carry. Received: "
                f"models_per_pass={models_per_pass!r}; use None or 'auto'.")
        self._models_per_pass = models_per_pass
        self._resolved_models_per_pass = None
        self._replica_jit_compile = replica_jit
        self._compiled_forward = None
        self.compile_model_losses(loss, loss_weights, metrics,
                                  weighted_metrics)
        compat.compile_config(self).update(
            metrics=metrics, weighted_metrics=weighted_metrics,
            per_model_labels=per_model_labels, jit_compile=jit_compile)
        if models_per_pass != "auto":
            # Only where set: subclasses with training steps of their own
            # (and compile signatures without it) reload their configs.
            compat.compile_config(self)["models_per_pass"] = models_per_pass

    def _symbolic_build(self, iterator=None, data_batch=None):
        # State must exist before the step is traced (on TensorFlow, a
        # step that creates variables is traced twice): build the
        # per-model losses and metrics as Keras builds its own. One batch
        # serves both (taking a second from `iterator` would begin a
        # `PyDataset`'s epoch twice).
        metrics = [] if self._model_metrics is None else [self._model_metrics]
        unbuilt = [m for m in metrics + (self._model_losses or [])
                   if not m.built]
        if data_batch is None and unbuilt:
            data_batch = self._batch_for_building(iterator)
        super()._symbolic_build(iterator=iterator, data_batch=data_batch)
        if not unbuilt or data_batch is None:
            return

        def symbolic(value):
            if value is None:
                return None
            return keras.KerasTensor(
                value.shape, keras.backend.standardize_dtype(value.dtype))

        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(
            keras.tree.map_structure(symbolic, data_batch))
        y_pred = compute_output_spec(self, x, training=False)
        compute_output_spec(
            self._build_model_state, x, y, y_pred, sample_weight)

    def compile_from_config(self, config):
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if self.built and not self.optimizer.built:
            self.optimizer.build(self.trainable_variables)

    def _weights_assigned_in_training(self):
        """The trainable weights that a forward pass in training assigns
        (a spectral normalization's kernel), in no particular order."""
        return [variable for layer in compat.inner_layers(self)
                if getattr(layer, "assigns_weights_in_training", False)
                for variable in layer.trainable_weights]

    def _has_convolutions(self):
        layers = list(compat.inner_layers(self))
        return any(convolutional.is_convolution(layer) for layer in layers) or (
            any(layer_state.is_stock_convolution(inner)
                for inner in per_model.layers_inside(layers)))

    def fit(self, *args, class_weight=None, **kwargs):
        """As `keras.Model.fit`. `class_weight` weighs each model's samples
        by the class of that model's own label (shared or per model)."""
        check_backend()
        if class_weight is not None and kwargs.get("sample_weight") is not None:
            raise ValueError(
                "`class_weight` and `sample_weight` cannot both be given, as "
                "in Keras: fold the class weights into the sample weights.")
        self._use_class_weight(class_weight)
        callbacks = progress.with_progress_bar(
            kwargs.pop("callbacks", None), kwargs.get("verbose", "auto"))
        check_stock_callbacks(callbacks)
        if isinstance(callbacks, keras.callbacks.CallbackList):
            callbacks.append(divergence.DivergenceReport())
            callbacks.callbacks[:] = _backups_last(callbacks.callbacks)
        else:
            callbacks = _backups_last([*(callbacks or []),
                                       divergence.DivergenceReport()])
        return super().fit(*args, callbacks=callbacks, **kwargs)

    def evaluate(self, *args, callbacks=None, **kwargs):
        """As `keras.Model.evaluate`, with the array's progress bar
        (`hftatf.progress`)."""
        callbacks = progress.with_progress_bar(
            callbacks, kwargs.get("verbose", "auto"))
        return super().evaluate(*args, callbacks=callbacks, **kwargs)

    def summary(self, *args, fused=False, **kwargs):
        """Prints the layers of the model this array was fused from, with
        one model's shapes and parameter count, and the number of models
        (`hftatf.summary`); `fused=True`: the array's own fused layers,
        `[B, ...]` weights and `[batch, B, ...]` shapes, as
        `keras.Model.summary` prints them. Other arguments are those of
        `keras.Model.summary`."""
        if fused:
            return super().summary(*args, **kwargs)
        return array_summary.print_summary(self, *args, **kwargs)

    @property
    def compiles_with_xla(self):
        """Whether training runs compiled by XLA: the whole step
        (`jit_compile`), or under a strategy each replica's forward and
        backward pass."""
        return bool(self.jit_compile is True or self._replica_jit_compile)

    def rank_models(self, monitor="val_loss", mode="auto", history=None):
        """The models best first by `monitor` in the last `fit`'s history
        (or `history`): `[(model index, value), ...]`, as the launcher's
        table ranks them; see `hftatf.report.rank_models`."""
        return report.rank_models(self, monitor, mode, history)

    def train_on_batch(self, x, y=None, sample_weight=None,
                       class_weight=None, return_dict=False):
        """As `keras.Model.train_on_batch`, with `class_weight` as in
        `fit` (read from each model's own labels)."""
        self._use_class_weight(class_weight)
        # Flags an interrupted `fit` left are not this batch's.
        self._bad_batch.reset_state()
        logs = super().train_on_batch(x, y, sample_weight=sample_weight,
                                      return_dict=return_dict)
        self.check_batch("the batch given to train_on_batch")
        return logs

    def unfuse(self, compile=True):
        """Returns the B models as plain Keras models with their weights,
        compiled as they train in the array (optimizer state included);
        see `hftatf.fuse.unfuse`."""
        return hooks.call("unfuse", self, compile=compile)

    def export_models(self, directory, history=None, format=None,
                      verbose="auto"):
        """Writes each model as `.keras`, SavedModel, checkpoint (those the
        backend writes, by default) and metadata; see
        `hftatf.export.export_models`."""
        return hooks.call("export_models", self, directory, history=history,
                          format=format, verbose=verbose)

    @classmethod
    def from_exported(cls, directory, **fuse_kwargs):
        """The array written by `export_models`, to resume tuning or to
        serve; see `hftatf.export.from_exported`."""
        return hooks.call("from_exported", directory, model_class=cls,
                          **fuse_kwargs)

    # -- serialization ------------------------------------------------------

    def get_config(self):
        if self._source_json is None:
            config = super().get_config()
        else:
            config = {"name": self.name, "trainable": self.trainable,
                      "source": self.source_config}
            # Flags set since fusing are not in the source's config.
            config["trainable_flags"] = trainable_flags(self)
            states = weight_states(self)
            if states:
                config["weight_states"] = states
        config.update(num_models=self.num_models,
                      shared_inputs=list(self._shared_inputs))
        if self._source_json is not None and self._layout != "auto":
            config["layout"] = self._layout
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        num_models = config.pop("num_models")
        shared_inputs = config.pop("shared_inputs", True)
        source = config.pop("source", None)
        layout = config.pop("layout", "auto")
        # `inner_trainable`: the flags inside layers run per model, as
        # files saved before `trainable_flags` hold them.
        flags = config.pop("trainable_flags", None) or config.pop(
            "inner_trainable", {})
        states = config.pop("weight_states", {})
        if source is not None:
            # The stock architecture as saved (deserializing consumes it):
            # the stock model rebuilt here holds no assets yet (a lookup's
            # vocabulary, whose size its config would then lose).
            source_json = json.dumps(source)
            stock = keras.saving.deserialize_keras_object(
                source, custom_objects=custom_objects)
            set_trainable_flags(stock, flags)
            set_weight_states(stock, states)
            array = hooks.call(
                "fuse", stock, num_models, shared_inputs=shared_inputs,
                name=config.get("name"), model_class=cls, layout=layout)
            array._source_json = source_json
            # Set only where off: on JAX, setting it turns every inner
            # layer's flag back on.
            if not config.get("trainable", True):
                array.trainable = False
            return array
        graph = keras.Model.from_config(config, custom_objects=custom_objects)
        return cls(graph.inputs, graph.outputs, num_models=num_models,
                   shared_inputs=shared_inputs, name=graph.name)

