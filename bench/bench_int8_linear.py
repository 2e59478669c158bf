"""int8 products at the default pair's shapes: the draft's Int8Linear against torch's dynamically quantised linear
layer (``torch.ao.quantization.quantize_dynamic`` with per-channel weights, fbgemm: what a PyTorch user picks for an
int8 CPU model), the float32 layer it replaces (MKL) and the weights' streaming floor.

Shapes are SmolLM2-135M's (hidden 576, intermediate 1536, vocabulary 49152; no model is loaded): a layer's fused q/k/v
(960 x 576), o (576 x 576), fused gate/up (3072 x 576), down (576 x 1536) and the LM head (49152 x 576), each at 1, 4
and 16 input rows. Every case times its implementations interleaved call by call after a warm-up and prints medians.
Int8Linear quantises every row (token) of its input on its own, torch's layer the whole input with one scale; each is
timed as one call on the whole input, and ``equal`` says whether Int8Linear's output equals, bit for bit, torch's
layer's fed each row alone with ``reduce_range=False`` (Int8Linear quantises inputs over uint8's whole range; torch's
layer halves it, since fbgemm's AVX2 kernels sum products in int16, so "no" is expected on a CPU without VNNI). The
floor is the int8 weight's bytes at the read bandwidth of one ``torch.sum`` over 256 MiB; small weights stay in
cache, so they can beat it.

    python bench/bench_int8_linear.py [--repeats 200] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from pass_costs import read_bandwidth
from diversed_ext.forward.int8 import Int8Linear
from diversed_ext.research.report import cell, markdown_rows

SHAPES = {"q/k/v": (960, 576), "o": (576, 576), "gate/up": (3072, 576), "down": (576, 1536), "lm head": (49152, 576)}
ROWS = (1, 4, 16)
WARMUP_CALLS = 20


def torch_quantised(linear: torch.nn.Linear):
    """torch's dynamically quantised copy of ``linear``, or None where this torch no longer ships it."""
    try:
        with warnings.catch_warnings():  # torch.ao's quantisation announces its deprecation on every call
            warnings.simplefilter("ignore")
            qconfig = torch.ao.quantization.per_channel_dynamic_qconfig  # weights scaled per row, as the draft's
            return torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(linear), {torch.nn.Linear: qconfig},
                                                          torch.qint8)[0]
    except (AttributeError, RuntimeError):
        return None


def row_by_row(layer, x: torch.Tensor) -> torch.Tensor:
    """torch's quantised ``layer`` applied to each row of ``x`` [rows, K] alone, over uint8's whole input range."""
    packed = layer._packed_params._packed_params
    return torch.cat([torch.ops.quantized.linear_dynamic(row, packed, reduce_range=False) for row in x.split(1)])


def median_microseconds(layers: dict, x: torch.Tensor, repeats: int) -> dict:
    """Median microseconds per call of each layer on ``x``, the layers called in turn so a slow spell hits all."""
    times = {name: [] for name in layers}
    for repeat in range(WARMUP_CALLS + repeats):
        for name, layer in layers.items():
            start = time.perf_counter()
            layer(x)
            elapsed = time.perf_counter() - start
            if repeat >= WARMUP_CALLS:
                times[name].append(elapsed)
    return {name: 1e6 * statistics.median(values) for name, values in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=200, help="timed calls per implementation and case")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be at least 1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    bandwidth = read_bandwidth()
    rows_out = []
    with torch.inference_mode():
        for name, (out_features, in_features) in SHAPES.items():
            linear = torch.nn.Linear(in_features, out_features, bias=False)
            layers = {"float32 (MKL)": linear, "Int8Linear": Int8Linear.from_float(linear)}
            theirs = torch_quantised(linear)
            if theirs is not None:
                layers["torch.ao int8"] = theirs
            floor_us = 1e6 * out_features * in_features / (bandwidth * 1e9)
            for rows in ROWS:
                x = torch.randn(rows, in_features)
                us = median_microseconds(layers, x, args.repeats)
                ours = layers["Int8Linear"](x)
                equal = "-" if theirs is None else ("yes" if torch.equal(ours, row_by_row(theirs, x)) else "no")
                ao = us.get("torch.ao int8")
                rows_out.append([f"{name} {out_features}x{in_features}", str(rows), cell(us["float32 (MKL)"], ".1f"),
                                 "n/a" if ao is None else cell(ao, ".1f"), cell(us["Int8Linear"], ".1f"),
                                 "n/a" if ao is None else cell(ao / us["Int8Linear"], ".2f") + "x",
                                 cell(floor_us, ".1f"), equal])
    print(f"int8 products, median us per call over {args.repeats} calls, torch threads {args.threads}, "
          f"read bandwidth {bandwidth:.1f} GB/s")
    print(markdown_rows(["product", "rows", "float32 (MKL)", "torch.ao int8", "Int8Linear", "ao / ours",
                         "int8 floor", "equal"], rows_out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
