"""LoRA (low-rank adaptation) on fused layers, as the stock layers' own.

A stock `Dense`, `EinsumDense`, `Embedding` or `ConvND` with LoRA enabled
freezes its weight `w` and computes with `w + (lora_alpha / lora_rank) *
a @ b`, where `a` is `[*w.shape[:-1], rank]` and `b` is `[rank,
w.shape[-1]]` and only they train. Its fused form holds `[B, ...]` copies
of all three: model `b` adapts its own `w[b]` with its own `a[b] @ b[b]`,
so an array tunes B LoRA fine-tunings of one model (their learning rates,
ranks' scales, seeds) as B stock fine-tunings would.
"""

from keras import ops

from hftatf.core import compat


def lora_property(name):
    """The property `name` of a fused layer with LoRA: its weight
    `_<name>`, to which each model's scaled `a @ b` is added once LoRA is
    enabled, as the stock layer's property of that name does."""

    def read(self):
        return self.lora_merged(getattr(self, "_" + name))

    return property(read, doc=f"The `[B, ...]` {name}, LoRA merged in.")


class LoraLayer:
    """Mixin of fused layers whose stock layer has `enable_lora`.

    The subclass names the adapted weight (`lora_target`), keeps it as
    `_<lora_target>` and reads it through `lora_property(lora_target)`;
    its constructor calls `init_lora` and its `build` ends with
    `build_lora`; `with_lora_config` adds the two arguments to its config.
    """

    lora_target = "kernel"

    def init_lora(self, lora_rank, lora_alpha):
        """Keeps the constructor's `lora_rank` and `lora_alpha` (the rank
        where None), as the stock layer does."""
        self.lora_rank = lora_rank
        self.lora_alpha = lora_alpha if lora_alpha is not None else lora_rank
        self.lora_enabled = False

    def build_lora(self):
        """Enables LoRA at the end of `build` where the layer was made
        with a `lora_rank`. The layer keeps its `lora_alpha` (a stock
        `Dense` or `Embedding` built from a config takes the rank
        instead)."""
        if self.lora_rank:
            self.built = True
            self.enable_lora(self.lora_rank, lora_alpha=self.lora_alpha)

    def enable_lora(self, rank, lora_alpha=None, a_initializer="he_uniform",
                    b_initializer="zeros"):
        """Freezes the layer's weight and adds each model's LoRA factors,
        as the stock layer's `enable_lora`: `a` drawn per model by
        `a_initializer` (each model's own seed), `b` by `b_initializer`
        (zeros: every model starts as its frozen weight), both float32.

        Args:
            rank: the rank of the factors, a positive integer.
            lora_alpha: the scale's numerator (`lora_alpha / rank`); the
                rank where None.
            a_initializer, b_initializer: initializers of `a` and `b`.
        """
        target = self.lora_target
        if getattr(self, f"{target}_constraint", None):
            raise ValueError(
                f"Lora is incompatible with {target} constraints. In order "
                f"to enable lora on layer '{self.name}', remove the "
                f"`{target}_constraint` argument.")
        if not self.built:
            raise ValueError(
                f"Cannot enable lora on layer '{self.name}': it isn't yet "
                "built. Build it (call it, or fuse a built model) first.")
        if self.lora_enabled:
            raise ValueError(
                f"lora is already enabled on layer '{self.name}'. This can "
                "only be done once per layer.")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
            raise ValueError(
                "`rank` must be a positive integer. Received: "
                f"rank={rank!r}.")
        weight = getattr(self, "_" + target)
        shape = tuple(weight.shape[1:])
        regularizer = getattr(self, f"{target}_regularizer", None)
        with compat.unlocked_tracker(self):
            for suffix, factor_shape, initializer in (
                    ("a", (*shape[:-1], rank), a_initializer),
                    ("b", (rank, shape[-1]), b_initializer)):
                setattr(self, f"lora_{target}_{suffix}", self.add_model_weight(
                    factor_shape, name=f"lora_{target}_{suffix}",
                    initializer=initializer, regularizer=regularizer,
                    dtype="float32"))
            weight.trainable = False
        self.lora_enabled = True
        self.lora_rank = rank
        self.lora_alpha = lora_alpha if lora_alpha is not None else rank

    def lora_merged(self, weight):
        """`weight` (`[B, ...]`) with each model's scaled `a @ b` added
        and cast to the compute dtype once LoRA is enabled, else itself."""
        if not self.lora_enabled:
            return weight
        target = self.lora_target
        a = getattr(self, f"lora_{target}_a")
        b = getattr(self, f"lora_{target}_b")
        rows = ops.reshape(a, (self.num_models, -1, self.lora_rank))
        delta = ops.reshape(ops.matmul(rows, b), tuple(weight.shape))
        return ops.cast(
            ops.add(weight, (self.lora_alpha / self.lora_rank) * delta),
            dtype=self.compute_dtype)

    def with_lora_config(self, config):
        """`config` with `lora_rank` and `lora_alpha`, where set."""
        if self.lora_rank:
            config["lora_rank"] = self.lora_rank
            config["lora_alpha"] = self.lora_alpha
        return config


def lora_settings(layer):
    """`{name: (rank, alpha)}` of the layers inside `layer` (itself
    included, under its own name) that have LoRA enabled."""
    return {inner.name: (inner.lora_rank, inner.lora_alpha)
            for inner in compat.inner_layers(layer)
            if getattr(inner, "lora_enabled", False)}


def match_lora(settings, layer):
    """Enables LoRA on the layers inside `layer` (itself included) named
    in `settings` (`lora_settings` of a layer of its architecture, stock
    or fused; ranks and scales as lists or tuples) with that rank and
    scale; one already enabled takes that scale. A stock attention layer's
    projections, for one, carry no LoRA in the attention layer's config."""
    for inner in compat.inner_layers(layer):
        setting = settings.get(inner.name)
        if setting is None or not hasattr(inner, "enable_lora"):
            continue
        rank, alpha = setting
        if not inner.lora_enabled:
            inner.enable_lora(rank, lora_alpha=alpha)
        inner.lora_alpha = alpha
