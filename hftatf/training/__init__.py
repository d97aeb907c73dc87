"""The training of an array, by concern, as Keras splits its trainer.

`hftatf.model.FusedModel` mixes in:

* `trainer.Trainer`: the backend's training step (`tensorflow_trainer`),
  chosen once by `keras.backend.backend()`;
* `routing.LabelRouting`: each model's labels and sample weights;
* `losses.PerModelLosses`: per-model losses, metrics and logs (the
  metrics held by `model_metrics.ModelMetrics`);
* `divergence.Divergence`: which models train, the step's update;
* `hftatf.passes.PassPlanning`: models per pass of the step;
* `surgery.Surgery`: freezing, selecting, one model's weights.
"""
