"""Operations on the models of an array: freezing, selecting, reading and
setting one model's weights, rebuilding the stock architecture."""

import copy

import keras
import numpy as np
from keras import ops

from hftatf import optimizers as fused_optimizers
from hftatf.core import compat
from hftatf.graph import (
    config_layers,
    graph_layers,
    is_graph_model,
    weighted_layers,
)
from hftatf.layers import layer_state, objects, per_model
from hftatf.layers.fold import FusedFold


def trainable_flags(model):
    """`{path: flags}` of the graph `model` (an array or a stock model):
    for each nested functional or Sequential model its own `[trainable]`
    flag, and for each layer with weights its `trainable` flags and those
    of the layers inside it (`layer_state.trainable_flags`; of the stock
    layer that a layer run per model holds). Paths are those of
    `hftatf.graph.graph_layers`."""
    found = {}
    for path, layer in graph_layers(model):
        if is_graph_model(layer):
            found[path] = [layer.trainable]
        elif layer.weights:
            found[path] = layer_state.trainable_flags(
                layer.layer if isinstance(layer, per_model.FusedPerModel)
                else layer)
    return found


def set_trainable_flags(model, flags):
    """Gives the layers of the graph `model` the `trainable_flags` of
    another of its architecture (those at paths `flags` lacks are left
    alone). A nested model's flag is set before those of the layers inside
    it, which it hands down to. A layer whose inner layers differ in number
    from those its flags came from (a fused layer's own) takes its own flag
    only."""
    for path, layer in graph_layers(model):
        given = flags.get(path)
        if given is None:
            continue
        layer_state.set_trainable_flags(layer, given, strict=False)


def weight_states(model):
    """`{path: state}` of the graph `model`'s layers with weights that
    have a `layer_state.weight_state` (LoRA inside them, weights frozen
    apart from their layer), paths as `trainable_flags`'. A layer run per
    model gives its stock layer's, which its copies hold."""
    found = {}
    for path, layer in weighted_layers(model):
        if isinstance(layer, per_model.FusedPerModel):
            layer = layer.layer
        state = layer_state.weight_state(layer)
        if state is not None:
            found[path] = state
    return found


def set_weight_states(model, states):
    """Gives the layers of the graph `model` the `weight_states` of another
    of its architecture, stock or fused (a layer run per model excepted:
    it gives its copies its stock layer's as it builds them)."""
    layers = dict(weighted_layers(model))
    for path, state in states.items():
        layer = layers.get(path)
        if layer is not None and not isinstance(layer,
                                                per_model.FusedPerModel):
            layer_state.set_weight_state(layer, state)


def _stock_layer(layer):
    """The stock layer inside a folded one (`FusedFold`), else `layer`."""
    return layer.layer if isinstance(layer, FusedFold) else layer


def saved_states(model):
    """`{path: state}` of the graph `model`'s layers that keep what Keras
    saves as assets (`layer_state.keeps_assets`: a lookup's vocabulary,
    which its config leaves out where `adapt` learned it); a folded layer
    gives its stock layer's. Paths as `trainable_flags`'."""
    return {path: layer_state.saved_state(_stock_layer(layer))
            for path, layer in graph_layers(model)
            if not is_graph_model(layer)
            and layer_state.keeps_assets(_stock_layer(layer))}


def load_saved_states(model, states):
    """Gives the layers of the graph `model` the `saved_states` of another
    of its architecture, stock or fused."""
    layers = dict(graph_layers(model))
    for path, state in states.items():
        if path in layers:
            layer_state.load_saved_state(_stock_layer(layers[path]), state)


def _restore_layer_names(model, config):
    """Gives the layers of the graph `model`, deserialized from `config`,
    the names the config lists them under (nested models too): a layer of
    your own whose config leaves its name out, or whose constructor does
    not hand it to Keras, comes back under another name, which its weights
    could not be matched by (`hftatf.graph.weighted_layers`)."""
    entries = config["config"].get("layers")
    if entries is None:
        # A model whose config holds its constructor's arguments names its
        # layers itself (`hftatf.fuse._name_entries`).
        return
    layers = config_layers(model)
    if [type(layer).__name__ for layer in layers] != [
            entry["class_name"] for entry in entries]:
        return
    for layer, entry in zip(layers, entries):
        name = entry.get("name", entry["config"].get("name"))
        if name is not None and layer.name != name:
            layer.name = name
        if is_graph_model(layer):
            _restore_layer_names(layer, entry)


def with_num_models(config, old, new):
    """`config` with every `num_models` equal to `old` set to `new`."""
    if isinstance(config, dict):
        return {key: (new if key == "num_models" and value == old
                      else with_num_models(value, old, new))
                for key, value in config.items()}
    if isinstance(config, (list, tuple)):
        return type(config)(with_num_models(v, old, new) for v in config)
    return config


def _copy_model_slices(sources, targets, indices, num_models):
    """Copies each source variable into its target: the model slices
    `indices` of `[B, ...]` variables, whole for variables without a model
    axis (e.g. a step counter)."""
    for source, target in zip(sources, targets):
        value = ops.convert_to_numpy(source)
        if value.ndim and value.shape[0] == num_models:
            value = value[indices]
        if tuple(target.shape) != value.shape:
            raise ValueError(
                f"Cannot copy '{source.path}' of shape "
                f"{tuple(source.shape)} into '{target.path}' of shape "
                f"{tuple(target.shape)}.")
        target.assign(value)


class Surgery:
    """Mixin of `FusedModel`: the models of an array, one at a time.

    Reads `num_models`, `_status` (which models train), `_source_json` (the
    stock architecture) and the compiled optimizer.
    """

    def freeze_models(self, indices):
        """Stops training the models `indices`: from the next step their
        weights, optimizer slots and step counts stay as they are."""
        self._set_active(indices, 0.0)

    def unfreeze_models(self, indices):
        """Resumes training the models `indices` (not diverged ones)."""
        indices = self._check_indices(indices)
        diverged = [i for i in indices if self.diverged_models[i]]
        if diverged:
            raise ValueError(
                f"Models {diverged} diverged; their weights hold no useful "
                "state to resume from. Restore weights first with "
                "set_model_weights, then unfreeze.")
        self._set_active(indices, 1.0)

    def _set_active(self, indices, value):
        indices = self._check_indices(indices)
        active = ops.convert_to_numpy(self._status.active).copy()
        active[indices] = value
        self._status.active.assign(active)

    def _check_indices(self, indices):
        # One index (a NumPy one too: `np.argmin(losses)`) or several.
        if np.ndim(indices) == 0:
            indices = [np.asarray(indices).item()]
        indices = list(indices)
        for index in indices:
            if isinstance(index, bool) or not isinstance(
                    index, (int, np.integer)) or not (
                    0 <= index < self.num_models):
                raise ValueError(
                    f"Model indices must be integers in [0, "
                    f"{self.num_models}). Received: {indices!r}.")
        return [int(i) for i in indices]

    def _rebuilt(self, count):
        """A new array of this architecture with `count` models (fresh
        weights)."""
        config = with_num_models(self.get_config(), self.num_models, count)
        with self._stock_classes(config):
            return type(self).from_config(config)

    def select(self, indices):
        """Returns a smaller array holding only the models `indices`.

        Each kept model keeps everything that makes it what it is: weights
        (moving statistics included), and, if the array is compiled, its
        optimizer state (slots, step count, per-model hyper-parameters and
        schedules) and whether it is frozen or diverged. Training the new
        array continues each kept model exactly as the old array would have,
        so a tuner can drop losers without retraining the winners.

        Args:
            indices: the models to keep, in the new array's order.
        """
        indices = self._check_indices(indices)
        if not indices:
            raise ValueError("select() needs at least one model index.")
        array = self._rebuilt(len(indices))
        old_weights, new_weights = self.weights, array.weights
        if len(old_weights) != len(new_weights):
            raise ValueError(
                f"Cannot select from array '{self.name}': rebuilding it gave "
                f"{len(new_weights)} weights instead of {len(old_weights)}.")
        B = self.num_models
        _copy_model_slices(old_weights, new_weights, indices, B)
        _copy_model_slices(self._status.variables, array._status.variables,
                           indices, B)
        if self.compiled and self.optimizer is not None:
            optimizer = fused_optimizers.select(self.optimizer, indices)
            compile_config = dict(compat.compile_config(self))
            compile_config["optimizer"] = optimizer
            passes_of = compile_config.get("models_per_pass")
            if isinstance(passes_of, int):
                # A pass holds at most the models the array keeps.
                compile_config["models_per_pass"] = min(passes_of,
                                                        len(indices))
            array.compile(**compile_config)
            if self.optimizer.built:
                optimizer.build(array.trainable_variables)
                _copy_model_slices(self.optimizer.variables,
                                   optimizer.variables, indices, B)
        return array

    def get_model_weights(self, index):
        """Model `index`'s slice of every weight, in `self.weights` order
        (which may differ from a stock model's `get_weights()` order:
        `stock_layer_paths`)."""
        (index,) = self._check_indices(index)
        return [ops.convert_to_numpy(w)[index] for w in self.weights]

    def set_model_weights(self, index, weights):
        """Sets model `index`'s slice of every weight (as returned by
        `get_model_weights`); the other models are left untouched."""
        (index,) = self._check_indices(index)
        if len(weights) != len(self.weights):
            raise ValueError(
                f"The array holds {len(self.weights)} weights; received "
                f"{len(weights)}.")
        for variable, value in zip(self.weights, weights):
            stacked = ops.convert_to_numpy(variable).copy()
            if tuple(np.shape(value)) != stacked.shape[1:]:
                raise ValueError(
                    f"Weight '{variable.path}' has per-model shape "
                    f"{stacked.shape[1:]}; received {np.shape(value)}.")
            stacked[index] = value
            variable.assign(stacked)

    def stock_layer_paths(self):
        """The paths (`hftatf.graph.weighted_layers`) of the array's layers
        with weights, in the order a stock model of its architecture lists
        them, which may differ from the array's: Keras orders a model's
        layers by depth, raw operations counted. The array's own order
        where it has no stock architecture."""
        if getattr(self, "_stock_paths", None) is None:
            source = (self if self._source_json is None
                      else self.stock_model(safe_mode=False))
            # Untracked by Keras: it is no state of the array's.
            object.__setattr__(self, "_stock_paths", tuple(
                path for path, _ in weighted_layers(source)))
        return list(self._stock_paths)

    def stock_model(self, safe_mode=True):
        """A new stock model of the architecture this array was fused from
        (fresh weights). The functions and classes of a script's own that
        its layers hold are found even where they are not registered with
        Keras (`hftatf.layers.objects`)."""
        return self._stock_models(1, safe_mode=safe_mode)[0]

    def _stock_models(self, count, safe_mode=True):
        """`count` new stock models, as `stock_model`: the array's layers
        are searched for the objects they hold once for all of them."""
        if self._source_json is None:
            raise ValueError(
                f"Array '{self.name}' was not made by hftatf.fuse or "
                "hftatf.fuse_models, so it has no stock architecture.")
        # Two copies: `_stock_classes` rewrites `source`'s lambdas.
        source, names = self.source_config, self.source_config
        flags = trainable_flags(self)
        states = weight_states(self)
        assets = saved_states(self)
        models = []
        with self._stock_classes(source):
            for _ in range(count):
                # Deserializing consumes the config: each model gets a copy.
                model = keras.saving.deserialize_keras_object(
                    copy.deepcopy(source), safe_mode=safe_mode)
                _restore_layer_names(model, names)
                set_trainable_flags(model, flags)
                set_weight_states(model, states)
                load_saved_states(model, assets)
                models.append(model)
        return models

    def _stock_classes(self, config):
        """A scope in which the functions and classes of a script's own
        that this array's layers hold deserialize from `config` (a
        serialized model, whose Python lambdas it rewrites to be found
        too: `hftatf.layers.objects`)."""
        layers = list(compat.inner_layers(self))
        return keras.saving.CustomObjectScope({
            **objects.live_objects(layers),
            **objects.live_lambdas(config, layers)})
