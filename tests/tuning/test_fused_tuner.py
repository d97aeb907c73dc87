"""FusedTuner against stock keras-tuner on digits: the same trials, scores
and best model; grouping by architecture; reuse; Hyperband compaction."""

import keras
import keras_tuner
import numpy as np
import pytest
from testing import assert_close

import hftatf
from hftatf import tuning
from hftatf.models import data
from hftatf.tuning import arrays

(X, Y), (X_VAL, Y_VAL) = data.digits()
X, Y, X_VAL, Y_VAL = X[:480], Y[:480], X_VAL[:160], Y_VAL[:160]
EPOCHS = 3
# In one test process (`--dist loadgroup`): the searches are a module
# fixture of a minute.
pytestmark = pytest.mark.xdist_group("searches")

MAX_TRIALS = 6


def build(hp):
    # The same initial weights for every trial, in both searches.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((8, 8)),
        keras.layers.Flatten(),
        keras.layers.Dense(hp.Choice("units", [16, 32]), activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile(
        optimizer=keras.optimizers.Adam(
            hp.Float("learning_rate", 1e-3, 0.3, sampling="log")),
        loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


class SerialRandomSearch(keras_tuner.RandomSearch):
    """Stock RandomSearch. Its `run_trial` imports tensorboard to set up
    TensorBoard callbacks, and this search has none: skipping that step
    keeps the reference runnable without the tensorboard package."""

    def _configure_tensorboard_dir(self, callbacks, trial, execution=0):
        pass


class RecordingRandomSearch(tuning.FusedRandomSearch):
    """Remembers which array trained each trial."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.arrays = {}
        self.compiled = set()  # the arrays' `jit_compile`

    def on_epoch_begin(self, trial, model, epoch, logs=None):
        if epoch == 0:
            self.arrays[trial.trial_id] = (id(model), model.num_models)
            self.compiled.add(model.jit_compile)


def fit_kwargs():
    # Stock EarlyStopping (converted per model for arrays) stops some trials
    # early: min_delta is large for these losses.
    return dict(epochs=EPOCHS, validation_data=(X_VAL, Y_VAL), verbose=0,
                shuffle=False, callbacks=[keras.callbacks.EarlyStopping(
                    monitor="val_loss", min_delta=0.3, patience=0)])


@pytest.fixture(scope="module")
def searches(tmp_path_factory):
    directory = tmp_path_factory.mktemp("searches")
    common = dict(objective="val_accuracy", max_trials=MAX_TRIALS, seed=3,
                  directory=str(directory))
    serial = SerialRandomSearch(build, project_name="serial", **common)
    serial.search(X, Y, **fit_kwargs())
    fused = RecordingRandomSearch(build, project_name="fused", num_models=4,
                                  **common)
    fused.search(X, Y, **fit_kwargs())
    return serial, fused


def trials(tuner):
    return sorted(tuner.oracle.trials.values(), key=lambda t: t.trial_id)


def test_same_configurations_in_the_same_order(searches):
    serial, fused = searches
    assert len(trials(fused)) == MAX_TRIALS
    for stock, ours in zip(trials(serial), trials(fused)):
        assert ours.trial_id == stock.trial_id
        assert ours.hyperparameters.values == stock.hyperparameters.values
        assert ours.status == stock.status == "COMPLETED"


def test_same_scores_steps_and_metrics(searches):
    serial, fused = searches
    stopped_early = 0
    for stock, ours in zip(trials(serial), trials(fused)):
        assert ours.best_step == stock.best_step, stock.trial_id
        stopped_early += stock.best_step < EPOCHS - 1
        # The objective (a validation accuracy) is exactly the stock one.
        np.testing.assert_allclose(ours.score, stock.score, atol=1e-6)
        for name in ("loss", "accuracy", "val_loss", "val_accuracy"):
            # Losses after up to 45 Adam steps: float32 rounding of the
            # fused einsum against the stock matmul compounds to 1e-5
            # relative (measured 9e-6); a wrong learning rate or start
            # differs by 1e-2 or more.
            np.testing.assert_allclose(
                ours.metrics.get_last_value(name),
                stock.metrics.get_last_value(name), rtol=5e-5, atol=1e-6,
                err_msg=f"trial {stock.trial_id} {name}")
    # Early stopping cut some trials short, and their histories end where
    # the stock trials' end.
    assert stopped_early


# Stock keras-tuner saves optimizer variables with its checkpoints and
# warns when it loads them into a new model's unbuilt optimizer.
@pytest.mark.filterwarnings("ignore:Skipping variable loading")
def test_same_best_trial_and_best_model(searches):
    serial, fused = searches
    best = fused.oracle.get_best_trials(1)[0]
    assert best.trial_id == serial.oracle.get_best_trials(1)[0].trial_id
    assert fused.get_best_hyperparameters()[0].values == (
        serial.get_best_hyperparameters()[0].values)
    ours, stock = fused.get_best_models()[0], serial.get_best_models()[0]
    assert not isinstance(ours, hftatf.FusedModel)
    # The same rounding as above (measured 3e-5 on probabilities).
    np.testing.assert_allclose(ours.predict(X_VAL, verbose=0),
                               stock.predict(X_VAL, verbose=0), atol=1e-4)


def test_trials_of_different_widths_train_in_different_arrays(searches):
    _, fused = searches
    units = {t.trial_id: t.hyperparameters["units"] for t in trials(fused)}
    by_array = {}
    for trial_id, (array, _) in fused.arrays.items():
        by_array.setdefault(array, set()).add(units[trial_id])
    assert all(len(widths) == 1 for widths in by_array.values())
    assert set(units.values()) == {16, 32}
    # The first round (4 trials) trained one array per width.
    first_round = [fused.arrays[t][0] for t in sorted(units)[:4]]
    assert len(set(first_round)) == len({units[t]
                                         for t in sorted(units)[:4]})


def test_later_rounds_reuse_an_array_built_for_the_whole_round(searches):
    _, fused = searches
    assert {size for _, size in fused.arrays.values()} == {4}
    ids = sorted(fused.arrays)
    first, second = ids[:4], ids[4:]
    assert {fused.arrays[t][0] for t in second} <= {
        fused.arrays[t][0] for t in first}


def test_arrays_compile_with_xla_on_jax_and_not_on_a_tensorflow_cpu(
        searches):
    # On JAX a step without XLA would run op by op; on TensorFlow on a
    # CPU, XLA's compile costs a short trial more than it saves.
    _, fused = searches
    assert fused.compiled == {keras.backend.backend() == "jax"}


def test_auto_size_and_fit_hyperparameters(monkeypatch, tmp_path):
    probed = []

    def fake_auto_num_models(model, x, y, **kwargs):
        probed.append(kwargs["batch_size"])
        return 3

    monkeypatch.setattr(tuning.sizing, "auto_num_models",
                        fake_auto_num_models)
    tuner = RecordingRandomSearch(
        build, objective="val_accuracy", max_trials=4, seed=5,
        num_models="auto", pad_arrays=False, directory=str(tmp_path),
        trial_fit_kwargs=lambda hp: {
            "batch_size": hp.Choice("batch_size", [16, 32])})
    tuner.search(X[:64], Y[:64], epochs=1, verbose=0,
                 validation_data=(X_VAL[:32], Y_VAL[:32]))
    done = trials(tuner)
    # Probed with the batch size of the trial that opened a round.
    assert probed and set(probed) <= {16, 32}
    # Rounds of 3 trials (the probed size), then 1.
    sizes = [tuner.arrays[t.trial_id][1] for t in done]
    assert sum(size for _, size in {tuner.arrays[t.trial_id]
                                    for t in done[:3]}) == 3
    assert sizes[3] == 1
    # A fit hyper-parameter splits arrays like a width does.
    assert {t.hyperparameters["batch_size"] for t in done} == {16, 32}
    groups = {}
    for trial in done:
        groups.setdefault(tuner.arrays[trial.trial_id][0], set()).add(
            (trial.hyperparameters["batch_size"],
             trial.hyperparameters["units"]))
    assert all(len(group) == 1 for group in groups.values())


def test_hyperband_winners_continue_their_models(monkeypatch, tmp_path):
    selected = []
    select = hftatf.FusedModel.select

    def spy_select(array, indices):
        selected.append(indices)
        return select(array, indices)

    carried = []
    continue_models = arrays.continue_models

    def spy_continue(sources, models, optimizers, jit_compile="auto"):
        before = [(s[0].get_model_weights(s[1]),
                   np.asarray(s[0].optimizer.model_iterations)[s[1]])
                  for s in sources]
        array = continue_models(sources, models, optimizers, jit_compile)
        carried.append((before, array, [
            (array.get_model_weights(b),
             np.asarray(array.optimizer.model_iterations)[b])
            for b in range(len(sources))]))
        return array

    monkeypatch.setattr(hftatf.FusedModel, "select", spy_select)
    monkeypatch.setattr(arrays, "continue_models", spy_continue)
    tuner = tuning.FusedHyperband(
        build, objective="val_accuracy", max_epochs=2, factor=2, seed=2,
        num_models=4, directory=str(tmp_path))
    tuner.search(X[:240], Y[:240], validation_data=(X_VAL, Y_VAL),
                 verbose=0)
    done = trials(tuner)
    continuing = [t for t in done if "tuner/trial_id" in
                  t.hyperparameters.values]
    assert continuing and all(t.status == "COMPLETED" for t in done)
    # Losers dropped with select; winners carried with weights, optimizer
    # slots and step counts, not restarted.
    assert selected and carried
    for before, _, after in carried:
        for (weights, steps), (new_weights, new_steps) in zip(before, after):
            assert steps > 0 and new_steps == steps
            for old, new in zip(weights, new_weights):
                np.testing.assert_array_equal(new, old)
    for trial in continuing:
        past = tuner.oracle.get_trial(
            trial.hyperparameters.values["tuner/trial_id"])
        # One more epoch on a continued model beats the past trial's
        # first epoch by far more than noise.
        assert trial.metrics.get_last_value("loss") < (
            past.metrics.get_last_value("loss"))
    model = tuner.get_best_models()[0]
    assert model.predict(X_VAL[:2], verbose=0).shape == (2, 10)


@pytest.mark.slow
def test_hyperband_without_kept_arrays_loads_the_saved_weights(tmp_path):
    tuner = tuning.FusedHyperband(
        build, objective="val_accuracy", max_epochs=2, factor=2, seed=2,
        num_models=4, keep_arrays=0, directory=str(tmp_path))
    tuner.search(X[:96], Y[:96], validation_data=(X_VAL[:32], Y_VAL[:32]),
                 verbose=0)
    done = trials(tuner)
    assert any("tuner/trial_id" in t.hyperparameters.values for t in done)
    assert all(t.status == "COMPLETED" for t in done)


def test_trial_whose_model_cannot_train_fails_as_in_stock(tmp_path,
                                                          capsys):
    def uncompiled(hp):
        hp.Float("learning_rate", 1e-3, 1e-1)
        return keras.Sequential([keras.Input((8, 8)), keras.layers.Flatten(),
                                 keras.layers.Dense(10)])

    tuner = tuning.FusedRandomSearch(uncompiled, objective="val_loss",
                                     max_trials=1, directory=str(tmp_path))
    tuner.search(X[:32], Y[:32], epochs=1, verbose=0)
    (trial,) = trials(tuner)
    assert trial.status == "FAILED"
    assert "not compiled" in trial.message
    # Printed too, as stock keras-tuner prints it (keras_tuner.config.DEBUG).
    assert "not compiled" in capsys.readouterr().err


def momentum_build(hp):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8, 8)), keras.layers.Flatten(),
                              keras.layers.Dense(10, activation="softmax")])
    momentum = hp.Choice("momentum", [0.0, 0.9])
    model.compile(optimizer=keras.optimizers.SGD(
        hp.Choice("learning_rate", [0.1, 0.01]), momentum=momentum),
        loss="sparse_categorical_crossentropy")
    return model


def test_later_round_with_momentum_gets_an_array_with_its_slots(tmp_path):
    oracle = keras_tuner.oracles.GridSearchOracle(objective="val_loss")
    tuner = tuning.FusedTuner(oracle, momentum_build, num_models=2,
                              directory=str(tmp_path))
    tuner.search(X[:64], Y[:64], epochs=1, verbose=0,
                 validation_data=(X_VAL[:32], Y_VAL[:32]))
    done = trials(tuner)
    # The first round's array has no momentum slots; the second round's
    # trials, of the same group, need them.
    assert [t.hyperparameters["momentum"] for t in done] == [0, 0, 0.9, 0.9]
    assert all(t.status == "COMPLETED" for t in done), [
        t.message for t in done]


def test_objective_the_trials_never_log_is_a_clear_error(tmp_path):
    tuner = tuning.FusedRandomSearch(
        build, objective=keras_tuner.Objective("val_acc", "max"),
        max_trials=1, num_models=1, directory=str(tmp_path))
    with pytest.raises(ValueError, match="'val_acc' is not among.*"
                       "val_accuracy"):
        tuner.search(X[:32], Y[:32], epochs=1, verbose=0,
                     validation_data=(X_VAL[:32], Y_VAL[:32]))


class CustomFit(keras_tuner.HyperModel):
    def build(self, hp):
        return build(hp)

    def fit(self, hp, model, *args, **kwargs):
        return model.fit(*args, batch_size=hp.Int("b", 8, 16), **kwargs)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"hypermodel": None}, ValueError, "hypermodel"),
    ({"hypermodel": CustomFit()}, TypeError, "trial_fit_kwargs"),
    ({"num_models": 0}, ValueError, "num_models"),
    ({"num_models": "many"}, ValueError, "num_models"),
    ({"trial_fit_kwargs": {"batch_size": 8}}, TypeError, "callable"),
    ({"keep_arrays": -1}, ValueError, "keep_arrays"),
    ({"num_models": 2, "executions_per_trial": 3}, ValueError,
     "num_models=2 is below executions_per_trial=3"),
])
def test_bad_arguments_are_clear_errors(kwargs, error, message, tmp_path):
    kwargs = {"hypermodel": build, **kwargs}
    with pytest.raises(error, match=message):
        tuning.FusedRandomSearch(objective="val_loss", max_trials=1,
                                 directory=str(tmp_path), **kwargs)


def test_a_tuner_overriding_run_trial_is_refused(tmp_path):
    # keras-tuner's way to tune fit arguments; a fused search would never
    # call it, and the batch size it samples would silently not be tuned.
    class BatchSizeSearch(tuning.FusedRandomSearch):
        def run_trial(self, trial, *args, **kwargs):
            kwargs["batch_size"] = trial.hyperparameters.Choice(
                "batch_size", [16, 32])
            return super().run_trial(trial, *args, **kwargs)

    with pytest.raises(TypeError, match="overrides `run_trial`.*"
                       "trial_fit_kwargs"):
        BatchSizeSearch(build, objective="val_loss", max_trials=1,
                        directory=str(tmp_path))


def test_fused_tuners_are_their_stock_tuners():
    assert issubclass(tuning.FusedRandomSearch, keras_tuner.RandomSearch)
    assert issubclass(tuning.FusedHyperband, keras_tuner.Hyperband)
    assert issubclass(tuning.FusedBayesianOptimization,
                      keras_tuner.BayesianOptimization)
    for cls in (tuning.FusedRandomSearch, tuning.FusedHyperband,
                tuning.FusedBayesianOptimization):
        assert issubclass(cls, tuning.FusedTuner)
        assert cls.run_trial is tuning.FusedTuner.run_trial


def test_bayesian_optimization_trains_rounds_of_arrays(tmp_path):
    search = tuning.FusedBayesianOptimization(
        build, objective="val_accuracy", max_trials=3, num_initial_points=2,
        seed=1, num_models=2, directory=str(tmp_path))
    search.search(X[:64], Y[:64], epochs=1, verbose=0,
                  validation_data=(X_VAL[:32], Y_VAL[:32]))
    done = trials(search)
    assert len(done) == 3 and all(t.status == "COMPLETED" for t in done)


def test_run_trial_trains_one_trial_as_stock_run_trial_does(tmp_path):
    tuner = tuning.FusedRandomSearch(build, objective="val_accuracy",
                                     max_trials=1, directory=str(tmp_path))
    trial = tuner.oracle.create_trial("tuner0")
    (history,) = tuner.run_trial(trial, X[:64], Y[:64], epochs=2,
                                 validation_data=(X_VAL[:32], Y_VAL[:32]),
                                 verbose=0)
    assert len(history.history["val_accuracy"]) == 2
    model = tuner.load_model(trial)
    assert model.predict(X_VAL[:2], verbose=0).shape == (2, 10)


def diverging_build(hp):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((8,)), keras.layers.Dense(8, activation="relu"),
        keras.layers.Dense(3, activation="softmax")])
    model.compile(
        # At 1e30 stock Keras diverges on every backend (at 1e8 on
        # TensorFlow only: JAX's clipped cross-entropy stays finite).
        optimizer=keras.optimizers.SGD(hp.Choice("learning_rate",
                                                 [1e30, 1e-2])),
        loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def linear_classes(rng, count, weights):
    x = rng.normal(size=(count, 8)).astype("float32")
    noise = 0.5 * rng.normal(size=(count, 3))
    return x, np.argmax(x @ weights + noise, axis=1)


def test_a_diverged_trial_scores_nan_and_fails(tmp_path):
    # Frozen at its last finite weights, the diverged model would still
    # score an accuracy and complete (it did before the recorder logged
    # NaN); stock keras-tuner picks the converging trial.
    rng = np.random.default_rng(0)
    weights = rng.normal(size=(8, 3))
    (x, y), validation = [linear_classes(rng, n, weights) for n in (256, 96)]
    oracle = keras_tuner.oracles.GridSearchOracle(
        objective="val_accuracy", max_trials=2)
    tuner = tuning.FusedTuner(oracle, diverging_build, num_models=2,
                              directory=str(tmp_path))
    tuner.search(x, y, epochs=3, batch_size=32, verbose=0, shuffle=False,
                 validation_data=validation)
    done = {t.hyperparameters.values["learning_rate"]: t
            for t in trials(tuner)}
    assert done[1e30].status == "FAILED"
    assert np.isnan(done[1e30].metrics.get_last_value("val_accuracy"))
    assert done[1e-2].status == "COMPLETED"
    (best,) = tuner.get_best_hyperparameters()
    assert best.values["learning_rate"] == 1e-2


def test_a_diverged_model_continues_from_its_saved_best_epoch(tmp_path):
    tuner = tuning.FusedHyperband(
        diverging_build, objective="val_accuracy", max_epochs=2,
        factor=2, num_models=2, directory=str(tmp_path))
    array = hftatf.fuse(diverging_build(keras_tuner.HyperParameters()), 2)
    array.compile(hftatf.optimizers.SGD(1e-2),
                  loss="sparse_categorical_crossentropy")
    array.set_model_weights(1, [np.full_like(w, np.nan)
                                for w in array.get_model_weights(1)])
    x, y = linear_classes(np.random.default_rng(0), 8, np.ones((8, 3)))
    array.train_on_batch(x, y)
    assert list(array.diverged_models) == [False, True]
    tuner._arrays[id(array)] = array
    tuner._trained.update({("a", 0): (id(array), 0),
                           ("b", 0): (id(array), 1)})
    assert tuner._trained_model("a", 0) == (array, 0)
    # Frozen where it diverged: the saved weights of its best epoch go on.
    assert tuner._trained_model("b", 0) is None


def test_stock_tensorboard_writes_a_run_per_trial(tmp_path):
    # As keras-tuner lays them out: log_dir/<trial_id>/execution<k>.
    tuner = tuning.FusedRandomSearch(
        build, objective="val_loss", max_trials=2, seed=3,
        directory=str(tmp_path), project_name="tb", num_models=2)
    tuner.search(X[:32], Y[:32], epochs=2, verbose=0,
                 validation_data=(X_VAL[:16], Y_VAL[:16]),
                 callbacks=[keras.callbacks.TensorBoard(
                     str(tmp_path / "logs"))])
    for trial in trials(tuner):
        assert trial.status == "COMPLETED"
        # Inside it, train/ and validation/, as stock Keras writes a run.
        run = tmp_path / "logs" / trial.trial_id / "execution0"
        tags = {}
        # (TensorFlow writes the summaries, and reads them, on either
        # backend.)
        tf = pytest.importorskip("tensorflow")
        for kind in ("train", "validation"):
            events = list((run / kind).glob("events.out.tfevents.*"))
            assert events, run / kind
            tags[kind] = {
                value.tag for event in tf.compat.v1.train.summary_iterator(
                    str(events[0])) for value in event.summary.value}
        assert {"epoch_loss", "epoch_learning_rate"} <= tags["train"]
        assert {"epoch_loss"} <= tags["validation"]


def test_stock_learning_rate_callbacks_act_on_each_trial(tmp_path):
    def search(cls, **kwargs):
        tuner = cls(build, objective="val_loss", max_trials=2, seed=3,
                    directory=str(tmp_path), project_name=cls.__name__,
                    **kwargs)
        tuner.search(
            X[:64], Y[:64], epochs=3, verbose=0, shuffle=False,
            validation_data=(X_VAL[:32], Y_VAL[:32]), callbacks=[
                keras.callbacks.ReduceLROnPlateau(
                    "val_loss", factor=0.5, patience=0, min_delta=10.0),
                keras.callbacks.LearningRateScheduler(
                    lambda epoch, rate: rate * 0.7)])
        return {t.trial_id: (t.hyperparameters.values, t.status,
                             t.metrics.get_history("val_loss"))
                for t in trials(tuner)}

    stock = search(SerialRandomSearch)
    fused = search(tuning.FusedRandomSearch, num_models=2)
    assert stock.keys() == fused.keys()
    for trial_id, (values, status, history) in stock.items():
        assert fused[trial_id][:2] == (values, status) == (values,
                                                            "COMPLETED")
        got = [o.value for o in fused[trial_id][2]]
        want = [o.value for o in history]
        assert_close(np.array(got), np.array(want), err_msg=trial_id)
