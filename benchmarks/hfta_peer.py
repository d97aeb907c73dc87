"""HFTA's own PyTorch arrays timed on random data: the peer of hftatf.

HFTA (Wang et al., MLSys 2021) publishes a PyTorch implementation. This
script imports its fused ResNet-18 and PointNet classifiers and its fused
optimizers from an uncommitted snapshot (`--hfta_dir`, default
`$HFTA_DIR` or `.peer/hfta`; `benchmarks/hfta_peer.sh` says how to place
it) and times their training steps, serial against fused, at the batch and
input sizes of hftatf's zoo benchmark. Nothing of HFTA's code is in this
repository: the models, their loss and their optimizers are imported and
driven as HFTA's own examples drive them (`examples/resnet/utils.py`
`train`, `examples/pointnet/train_classification.py`), with random
tensors on the device in place of CIFAR-10 and ShapeNet.

  * serial: HFTA's model built with `B=0` (plain `torch.nn` layers) and
    the stock `torch.optim` optimizer. B models trained one after another
    run at one model's rate, so it is measured once per model;
  * fused: HFTA's array of B (`B=B`: its grouped convolutions, batched
    matmuls and fused Adadelta/Adam), every model with its own learning
    rate, fed the same batch (expanded over the models, as HFTA does).

What the models match in hftatf (`models/resnet.py`, `models/pointnet.py`):
HFTA's ResNet-18 is the full-width ImageNet layout (7x7/2 stem and
max-pooling), which is hftatf's `resnet18` with `width=1.0,stem=imagenet`,
trained with Adadelta (HFTA fuses only Adadelta and Adam; hftatf's recipe
uses SGD). HFTA's PointNet classifier at full width with the feature
transform (`--feature_transform`, as HFTA's benchmark runs it) is
hftatf's `pointnet` with `width=1.0`, but for hftatf's second 64-wide
per-point layer; both train with Adam.

Each point: `--warmup` untimed steps (cuDNN autotuning happens there),
then `--epochs` timed epochs of as many steps as fill `--seconds` in all;
the median epoch gives model-samples per second (B x batch per step).
Float32 with PyTorch's TF32 defaults (convolutions in TF32, matmuls in
full float32; `--tf32_matmul` turns them on too, as XLA does by default),
or `--precision bf16` (autocast). Peak memory is the CUDA allocator's peak
over the point. Rows go to `<output_dir>/hfta_peer.csv` and a Markdown
table to `hfta_peer.md`.

    python benchmarks/hfta_peer.py                 # the GPU run
    python benchmarks/hfta_peer.py --dry-run       # tiny, on the CPU
"""

import argparse
import csv
import gc
import importlib.util
import os
import pathlib
import statistics
import sys
import time

# hftatf's zoo benchmark: `benchmarks.run --batch_size` (64); resnet18 on
# 32x32x3 images of 10 classes; pointnet on 256 points of 6 shapes.
BATCH_SIZE = 64
IMAGE_SIZE = 32
NUM_CLASSES = {"resnet18": 10, "pointnet": 6}
NUM_POINTS = 256
COLUMNS = ("model", "mode", "num_models", "batch_size", "precision",
           "tf32", "device", "steps_per_epoch", "model_samples_per_s",
           "fused_over_serial", "peak_memory_mib", "status")


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--hfta_dir",
                        default=os.environ.get("HFTA_DIR", ".peer/hfta"))
    parser.add_argument("--models", default="resnet18,pointnet")
    parser.add_argument("--num_models", default="1,8,32")
    parser.add_argument("--batch_size", type=int, default=BATCH_SIZE)
    parser.add_argument("--num_points", type=int, default=NUM_POINTS)
    parser.add_argument("--precision", default="fp32",
                        help="comma list of fp32, bf16")
    parser.add_argument("--tf32_matmul", action="store_true")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--output_dir", default="gpu_results/hfta_peer")
    parser.add_argument("--dry-run", dest="dry_run", action="store_true",
                        help="tiny sizes on the CPU, one thread")
    parser.add_argument("--side_by_side", metavar="OUT_DIR",
                        help="measure nothing: join OUT_DIR/hfta_peer.csv "
                             "with hftatf's OUT_DIR/hftatf/results.csv "
                             "into OUT_DIR/side_by_side.md")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.device, args.num_models, args.batch_size = "cpu", "1,2", 4
        args.num_points, args.warmup, args.seconds = 32, 1, 0.3
    args.models = args.models.split(",")
    args.num_models = [int(b) for b in args.num_models.split(",")]
    args.precision = args.precision.split(",")
    return args


def load_hfta(hfta_dir):
    """HFTA's `hfta` package and its two example model modules."""
    root = pathlib.Path(hfta_dir).resolve()
    if not (root / "hfta" / "ops" / "__init__.py").is_file():
        raise SystemExit(
            f"No HFTA snapshot at {root}: place one there (see "
            "benchmarks/hfta_peer.sh) or pass --hfta_dir / HFTA_DIR.")
    sys.path.insert(0, str(root))
    import hfta.optim  # noqa: F401  (HFTA's fused optimizers)

    modules = {}
    for name, example in (("resnet18", "resnet"), ("pointnet", "pointnet")):
        path = root / "examples" / example / "model.py"
        spec = importlib.util.spec_from_file_location(f"hfta_{name}", path)
        modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules[name])
    return modules


def learning_rates(num_models, base):
    """One learning rate per model, as in a search (HFTA's fused
    optimizers then keep them as a tensor)."""
    return [base * (0.5 + b / max(1, num_models)) for b in range(num_models)]


def build_task(name, module, num_models, args):
    """(optimizer, loss function) of HFTA's `name` at `num_models` (0: one
    stock model), on one random batch on the device."""
    import torch
    import torch.nn.functional as F
    from hfta.optim import get_hfta_optim_for

    device, n, b = args.device, args.batch_size, num_models
    if name == "resnet18":
        model = module.Resnet18(num_classes=NUM_CLASSES[name], B=b)
        optimizer_class = torch.optim.Adadelta
        x = torch.randn(n, 3, IMAGE_SIZE, IMAGE_SIZE, device=device)
    else:
        model = module.PointNetCls(k=NUM_CLASSES[name],
                                   feature_transform=True, B=b)
        optimizer_class = torch.optim.Adam
        x = torch.rand(n, args.num_points, 3, device=device)
    model.to(device).train()
    # 1e-3: both examples' default --lr.
    optimizer = get_hfta_optim_for(optimizer_class, B=b)(
        model.parameters(), lr=learning_rates(b, 1e-3) if b else 1e-3)
    y = torch.randint(NUM_CLASSES[name], (n,), device=device)
    target = y.repeat(b) if b else y

    def forward_loss():
        if name == "resnet18":
            data = x.unsqueeze(1).expand(-1, b, -1, -1, -1) if b else x
            output = model(data.contiguous())
            extra = 0.0
        else:
            data = x.unsqueeze(0).expand(b, -1, -1, -1) if b else x
            output, _, trans_feat = model(data.contiguous())
            extra = module.feature_transform_regularizer(trans_feat) * 0.001
        if b:
            return b * F.nll_loss(output.view(b * n, -1), target) + extra
        return F.nll_loss(output, target) + extra

    return optimizer, forward_loss


def measure(step, sync, args):
    """(steps per epoch, median seconds per epoch)."""
    for _ in range(args.warmup):
        step()
    sync()
    per_epoch = args.seconds / args.epochs
    steps, start = 0, time.perf_counter()
    while time.perf_counter() - start < per_epoch / 4 or steps < 1:
        step()
        sync()
        steps += 1
    per_step = (time.perf_counter() - start) / steps
    steps = max(1, round(per_epoch / per_step))
    epochs = []
    for _ in range(args.epochs):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        epochs.append(time.perf_counter() - start)
    return steps, statistics.median(epochs)


def run_point(name, module, num_models, precision, args):
    """One row: HFTA's model at `num_models` (0: serial) trained and
    timed."""
    import torch

    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    row = {"model": name, "mode": "fused" if num_models else "serial",
           "num_models": max(1, num_models), "batch_size": args.batch_size,
           "precision": precision, "device": args.device,
           "tf32": "conv+matmul" if args.tf32_matmul else "conv"}
    dtype = torch.bfloat16 if precision == "bf16" else None
    try:
        optimizer, forward_loss = build_task(name, module, num_models,
                                                    args)

        def step():
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(args.device.split(":")[0], dtype=dtype,
                                enabled=dtype is not None):
                loss = forward_loss()
            loss.backward()
            optimizer.step()

        steps, seconds = measure(step, sync, args)
    except torch.cuda.OutOfMemoryError:
        # The next point's gc.collect() and empty_cache() free its memory.
        return {**row, "status": "OOM"}
    samples = row["num_models"] * args.batch_size * steps / seconds
    row.update(steps_per_epoch=steps, model_samples_per_s=f"{samples:.1f}",
               status="ok")
    if cuda:
        peak = torch.cuda.max_memory_allocated() / 2**20
        row["peak_memory_mib"] = f"{peak:.0f}"
    return row


def write(rows, output_dir):
    output_dir = pathlib.Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    with open(output_dir / "hfta_peer.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    shown = ("model", "precision", "mode", "num_models",
             "model_samples_per_s", "fused_over_serial", "peak_memory_mib",
             "status")
    table = _markdown(shown, [[r.get(c, "") for c in shown] for r in rows])
    (output_dir / "hfta_peer.md").write_text(table + "\n")
    return table


def _markdown(header, rows):
    """A Markdown table of `header` and the `rows` of cells."""
    return "\n".join(["| " + " | ".join(header) + " |",
                      "|" + "---|" * len(header)]
                     + ["| " + " | ".join(str(c) for c in cells) + " |"
                        for cells in rows])


def _read(path):
    if not path.is_file():
        return []
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def _rate(rows, model, mode, num_models, column):
    for row in rows:
        if (row["model"], row["mode"], int(row["num_models"])) == (
                model, mode, num_models) and row.get(column):
            return float(row[column])
    return None


def _rate_cell(value):
    return f"{value:.0f}" if value else "-"


def _ratio(value, over):
    return f"{value / over:.2f}" if value and over else "-"


def side_by_side(out_dir):
    """HFTA's and hftatf's model-samples per second and fused/serial
    ratios, per model and B (float32 rows; serial measured at B = 1)."""
    out_dir = pathlib.Path(out_dir)
    hfta = [r for r in _read(out_dir / "hfta_peer.csv")
            if r["precision"] == "fp32"]
    ours = _read(out_dir / "hftatf" / "results.csv")
    header = ("model", "B", "HFTA serial", "HFTA fused", "HFTA ratio",
              "hftatf serial", "hftatf fused", "hftatf ratio",
              "hftatf / HFTA fused")
    cells = []
    sizes = sorted({(r["model"], int(r["num_models"])) for r in hfta
                    if r["mode"] == "fused"})
    for model, b in sizes:
        hfta_serial = _rate(hfta, model, "serial", 1, "model_samples_per_s")
        hfta_fused = _rate(hfta, model, "fused", b, "model_samples_per_s")
        our_serial = _rate(ours, model, "serial", 1, "samples_per_s")
        our_fused = _rate(ours, model, "fused", b, "samples_per_s")
        cells.append([model, b, _rate_cell(hfta_serial),
                      _rate_cell(hfta_fused), _ratio(hfta_fused, hfta_serial),
                      _rate_cell(our_serial), _rate_cell(our_fused),
                      _ratio(our_fused, our_serial),
                      _ratio(our_fused, hfta_fused)])
    table = _markdown(header, cells)
    (out_dir / "side_by_side.md").write_text(table + "\n")
    print(table)


def main(argv=None):
    args = parse_args(argv)
    if args.side_by_side:
        side_by_side(args.side_by_side)
        return
    import torch

    if args.dry_run:
        torch.set_num_threads(1)
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SystemExit("PyTorch sees no CUDA device; use --dry-run.")
        torch.backends.cudnn.benchmark = True  # as HFTA's examples set it
        torch.backends.cuda.matmul.allow_tf32 = args.tf32_matmul
    modules = load_hfta(args.hfta_dir)
    print(f"PyTorch {torch.__version__} on {args.device}"
          + (f" ({torch.cuda.get_device_name()})"
             if args.device.startswith("cuda") else "")
          + f"; HFTA from {pathlib.Path(args.hfta_dir).resolve()}",
          flush=True)
    rows = []
    for name in args.models:
        for precision in args.precision:
            serial = run_point(name, modules[name], 0, precision, args)
            rows.append(serial)
            print(serial, flush=True)
            for num_models in args.num_models:
                row = run_point(name, modules[name], num_models, precision,
                                args)
                if row["status"] == serial["status"] == "ok":
                    ratio = (float(row["model_samples_per_s"])
                             / float(serial["model_samples_per_s"]))
                    row["fused_over_serial"] = f"{ratio:.2f}"
                rows.append(row)
                print(row, flush=True)
                write(rows, args.output_dir)
    print(write(rows, args.output_dir))
    print(f"hfta_peer: results in {args.output_dir}/ (hfta_peer.csv, "
          "hfta_peer.md)")


if __name__ == "__main__":
    # Run as a script, this folder heads sys.path: its module names
    # (layers, measure, flags, ...) must not shadow PyTorch's imports.
    _here = pathlib.Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path
                   if pathlib.Path(p or ".").resolve() != _here]
    main()
