"""`benchmarks.kernels --torch`: the cuDNN kernels TensorFlow runs without
XLA, through PyTorch: one grouped convolution against B convolutions,
forward and backward.
"""

import statistics
import time

# (batch, image size, channels, filters) of one model's 3x3 convolution.
TORCH_CASES = ((128, 32, 64, 64), (128, 16, 128, 128), (128, 8, 256, 256))


def _cudnn_case(torch, device, batch, size, channels, filters, num_models,
                repeats):
    """Median seconds of B convolutions and of one grouped convolution."""
    # Each model reads its own input, as B models do; the array's
    # activations are already folded into one tensor.
    inputs = [torch.randn(batch, channels, size, size, device=device)
              .to(memory_format=torch.channels_last).requires_grad_()
              for _ in range(num_models)]
    folded = torch.cat([x.detach() for x in inputs], 1).to(
        memory_format=torch.channels_last).requires_grad_()
    kernels = [torch.randn(filters, channels, 3, 3, device=device,
                           requires_grad=True) for _ in range(num_models)]
    wide = torch.cat([k.detach() for k in kernels]).requires_grad_()

    def grouped():
        y = torch.nn.functional.conv2d(folded, wide, padding=1,
                                       groups=num_models)
        y.backward(torch.ones_like(y))

    def per_model():
        for x, kernel in zip(inputs, kernels):
            y = torch.nn.functional.conv2d(x, kernel, padding=1)
            y.backward(torch.ones_like(y))

    seconds = []
    for function in (per_model, grouped):
        for _ in range(3):
            function()
        times = []
        for _ in range(repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            function()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        seconds.append(statistics.median(times))
    return seconds


def torch_convolutions(num_models_list, repeats, cases=TORCH_CASES):
    """Forward and backward of one grouped cuDNN convolution against B
    convolutions, channels-last, TF32 on: the choice TensorFlow makes
    without XLA."""
    try:
        import torch
    except ImportError:
        print("--torch: PyTorch is not installed; skipped.")
        return []
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = True
    rows = []
    for batch, size, channels, filters in cases:
        for num_models in num_models_list:
            seconds = _cudnn_case(torch, device, batch, size, channels,
                                  filters, num_models, repeats)
            rows.append({"case": f"{size}x{size}x{channels}->{filters}",
                         "batch": batch, "num_models": num_models,
                         "per_model_ms": 1e3 * seconds[0],
                         "grouped_ms": 1e3 * seconds[1],
                         "grouped_speedup": seconds[0] / seconds[1]})
            print("cudnn conv {case} B={num_models}: per-model "
                  "{per_model_ms:.3f} ms, grouped {grouped_ms:.3f} ms, "
                  "grouped {grouped_speedup:.2f}x".format(**rows[-1]),
                  flush=True)
    return rows
