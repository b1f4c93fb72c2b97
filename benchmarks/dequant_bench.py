#!/usr/bin/env python3
"""The fused dequantization kernel against torch operations computing the same formula, on FLUX.1 layer
shapes: time per call, achieved HBM bandwidth (codes read + scales read + output written) and, where the
peak is known, its share of it. Also checks that both give the same bits. Then the lossless bfloat16
decoder (LAYERSTREAM_HOST_DTYPE=lossless) on weight-like values of the same shapes: its time, bandwidth
(packed bytes read + output written), the packed size, and that it rebuilds the weight bit for bit.

    python benchmarks/dequant_bench.py [--json-out FILE] [--peak-gbs 4800]

With --nvfp4: the nvfp4 weight decode (AI-Toolkit's nvfp4 and convrot4 backends) on FLUX.2 layer shapes, against
AI-Toolkit's own single-pass Triton dequantize_nvfp4 when a checkout is importable (the first path in
AI_TOOLKIT_DIR): time per call, GB/s (codes + scales read, bf16 written) and whether both give the same bits.

With --contention (GPU only): what a lossless decode on a side stream costs a chain of bfloat16 GEMMs on
the compute stream (a FLUX.2-shaped linear), at several limits on the decode's thread blocks
(LAYERSTREAM_DECODE_BLOCKS): the chain alone, then beside as many decodes as the bus would deliver packed
bytes in that time; the chain's extra time per decode, against the decode's own time alone.

On a machine without a GPU it runs the host reference on small shapes (a smoke run, no timing claims).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from layerstream import manager_modules as mm

# (rows, cols): FLUX.1 double-block MLP up and down, the fused qkv, a single-block linear1.
SHAPES = [(12288, 3072), (3072, 12288), (9216, 3072), (21504, 3072)]
# (codes dtype, scale dtype, math): optimum-quanto qfloat8 (bf16 scale and math), torchao float8 (float32),
# quanto qint8, layerstream's host compression (float32 scale and math).
KINDS = [
    ("float8_e4m3fn", torch.bfloat16, "bfloat16", "quanto qfloat8"),
    ("float8_e4m3fn", torch.float32, "float32", "torchao float8 / LAYERSTREAM_HOST_DTYPE"),
    ("int8", torch.bfloat16, "bfloat16", "quanto qint8"),
]


def _time(fn, device, repeats: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / repeats
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def _print_row(label: str, rows: int, cols: int, t_k: float, gbs_k: float, share: float | None, torch_cols: str,
               same: bool) -> None:
    print(f"{label:42} {rows:>6}x{cols:<6} {t_k * 1e6:>10.1f} {gbs_k:>8.0f} "
          f"{'-' if share is None else f'{share:.0f}':>7} {torch_cols}  {same}", flush=True)


def _chain_ms(fn_compute, fn_side, device) -> tuple[float, float]:
    """Runs fn_compute on the current stream and fn_side (or nothing) on a side stream, both starting
    together; returns (compute ms, side ms)."""
    compute = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    torch.cuda.synchronize(device)
    ev[0].record(compute)
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        ev[2].record(side)
        if fn_side is not None:
            fn_side()
        ev[3].record(side)
    fn_compute()
    ev[1].record(compute)
    torch.cuda.synchronize(device)
    return ev[0].elapsed_time(ev[1]), ev[2].elapsed_time(ev[3])


def contention(device, caps: list[int], bus_gbs: float, repeats: int = 5) -> list[dict]:
    """The compute stream's GEMM chain alone and beside capped decodes (see the module's docstring)."""
    gen = torch.Generator(device="cpu").manual_seed(7)
    tokens, hidden, out_features = 4608, 6144, 18432  # FLUX.2: image + text tokens, hidden, an MLP's width
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(device)
    w = (torch.randn(out_features, hidden, generator=gen) * 0.02).to(torch.bfloat16)
    packed, spec = mm._testing.lossless_pack(w)
    packed = packed.to(device)
    w = w.to(device)
    y = torch.empty(tokens, out_features, dtype=torch.bfloat16, device=device)
    gemms = 40

    def chain() -> None:
        for _ in range(gemms):
            torch.mm(x, w.t(), out=y)

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    chain()
    alone = median([_chain_ms(chain, None, device)[0] for _ in range(repeats)])
    decodes = max(1, round(alone / 1e3 * bus_gbs * 1e9 / packed.numel()))
    print(f"\nGEMM chain ({gemms} x [{tokens}x{hidden}] @ [{hidden}x{out_features}], bf16) alone: {alone:.2f} ms; "
          f"beside {decodes} decodes of a {out_features}x{hidden} weight ({packed.numel() / 1e6:.0f} MB packed: "
          f"the bus's {bus_gbs:.0f} GB/s over that time)", flush=True)
    print(f"{'decode blocks':>13} {'decode us':>10} {'GB/s':>7} {'chain ms':>9} {'+ms':>7} {'us/decode':>10} "
          f"{'x alone':>8} {'decodes ms':>11}", flush=True)
    rows = []
    for cap in caps:
        one = lambda: mm._testing.lossless_unpack(packed, spec, [out_features, hidden], max_blocks=cap)  # noqa: E731
        same = torch.equal(one(), w)
        t_one = _time(one, device, repeats * 4)

        def side() -> None:
            for _ in range(decodes):
                one()

        runs = [_chain_ms(chain, side, device) for _ in range(repeats)]
        with_decodes = median([r[0] for r in runs])
        side_ms = median([r[1] for r in runs])
        extra = with_decodes - alone
        per_decode_us = extra * 1e3 / decodes
        gbs = (packed.numel() + w.numel() * 2) / t_one / 1e9
        rows.append({"kind": "contention", "decode_blocks": cap, "decode_s": t_one, "decode_gbs": gbs,
                     "chain_alone_ms": alone, "chain_with_decodes_ms": with_decodes, "decodes": decodes,
                     "decodes_ms": side_ms, "extra_us_per_decode": per_decode_us,
                     "extra_over_decode_alone": per_decode_us / (t_one * 1e6), "same_bits": same})
        print(f"{cap if cap else 'all':>13} {t_one * 1e6:>10.1f} {gbs:>7.0f} {with_decodes:>9.2f} {extra:>7.2f} "
              f"{per_decode_us:>10.1f} {per_decode_us / (t_one * 1e6):>8.2f} {side_ms:>11.2f}"
              f"{'' if same else '  WRONG BITS'}", flush=True)
    return rows


NVFP4_SHAPES = [(18432, 6144), (6144, 18432), (36864, 6144), (6144, 6144)]  # FLUX.2 MLP up/down, fused, attn


def _aitk_dequantize_nvfp4():
    """AI-Toolkit's dequantize_nvfp4 from the checkout in AI_TOOLKIT_DIR (its first path), or None."""
    import os
    root = os.environ.get("AI_TOOLKIT_DIR", "").split(os.pathsep)[0]
    if not root:
        return None
    sys.path.insert(0, root)
    try:
        from toolkit.util.convrot_quant import dequantize_nvfp4
    except Exception as e:  # noqa: BLE001 - a checkout that does not import: report and go on without it
        print(f"AI-Toolkit's dequantize_nvfp4 not importable from {root}: {e}", flush=True)
        return None
    finally:
        sys.path.remove(root)
    return dequantize_nvfp4


def _nvfp4_differences(a, b, packed, scales) -> dict:
    """Where two bf16 decodes of the same codes differ: how many values, and the first few with their scale
    byte, their code and both results (as floats and bits)."""
    where = (a != b).flatten().nonzero().flatten()
    cols = a.shape[1]
    first = []
    for i in where[:6].tolist():
        r, c = divmod(i, cols)
        byte = int(packed[r, c // 2])
        code = byte & 15 if c % 2 == 0 else byte >> 4
        first.append({"row": r, "col": c, "scale_byte": int(scales[r, c // 16]), "code": code,
                      "mine": [float(a[r, c].view(torch.bfloat16)), int(a[r, c]) & 0xFFFF],
                      "theirs": [float(b[r, c].view(torch.bfloat16)), int(b[r, c]) & 0xFFFF]})
    subnormal = (scales.flatten()[where // 16] < 8).sum().item() if where.numel() else 0
    return {"count": int(where.numel()), "with_subnormal_scale": int(subnormal), "first": first}


def nvfp4(device, shapes: list[tuple[int, int]], repeats: int, peak_gbs: float | None) -> list[dict]:
    """layerstream's nvfp4 decode against AI-Toolkit's (see the module's docstring)."""
    theirs = _aitk_dequantize_nvfp4() if device.type == "cuda" else None
    print(f"\nnvfp4 decode (bf16 out): layerstream, then {'AI-Toolkit' if theirs else 'no AI-Toolkit'}'s "
          "dequantize_nvfp4", flush=True)
    rows = []
    for r, c in shapes:
        gen = torch.Generator(device="cpu").manual_seed(r * 13 + c)
        packed = torch.randint(0, 256, (r, c // 2), generator=gen, dtype=torch.uint8).to(device)
        scales = torch.randint(0, 0x7f, (r, c // 16), generator=gen, dtype=torch.uint8)  # positive, no NaN
        scales = scales.to(device)
        pts = torch.tensor([3e-3], dtype=torch.float32).view(torch.uint8).to(device)
        mine = lambda: mm._testing.nvfp4_decode(packed, scales, pts, r, c, "bfloat16", plus_zero=True)  # noqa: E731
        moved = packed.numel() + scales.numel() + r * c * 2
        t_k = _time(mine, device, repeats)
        gbs_k = moved / t_k / 1e9
        share = gbs_k / peak_gbs * 100 if peak_gbs else None
        row = {"kind": "nvfp4", "shape": [r, c], "device": str(device), "kernel_s": t_k, "kernel_gbs": gbs_k,
               "kernel_share_of_peak": share, "same_bits": True}
        cols = f"{'-':>10} {'-':>8}"
        if theirs is not None:
            pts_f = pts.view(torch.float32)
            other = lambda: theirs(packed, scales.view(torch.float8_e4m3fn), pts_f, r, c, torch.bfloat16)  # noqa: E731
            a, b = mine().view(torch.int16), other().view(torch.int16)
            row["same_bits"] = torch.equal(a, b)
            if not row["same_bits"]:
                row["differ"] = _nvfp4_differences(a, b, packed, scales)
                print(f"  {row['differ']['count']} values differ; first: {row['differ']['first']}", flush=True)
            t_o = _time(other, device, repeats)
            row.update(aitk_s=t_o, aitk_gbs=moved / t_o / 1e9)
            cols = f"{t_o * 1e6:>10.1f} {moved / t_o / 1e9:>8.0f}"
        rows.append(row)
        _print_row("nvfp4 weight (torch cols: AI-Toolkit Triton)", r, c, t_k, gbs_k, share, cols, row["same_bits"])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json-out")
    parser.add_argument("--peak-gbs", type=float, default=None,
                        help="HBM peak in GB/s for the percentage (H200: 4800); default: none shown")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--nvfp4", action="store_true",
                        help="also the nvfp4 weight decode, beside AI-Toolkit's when AI_TOOLKIT_DIR is set")
    parser.add_argument("--contention", action="store_true",
                        help="GPU: also the decode beside a GEMM chain at several block limits")
    parser.add_argument("--contention-blocks", default="0,2048,1024,528,264,132,66,32,16",
                        help="the block limits for --contention (0: none)")
    parser.add_argument("--bus-gbs", type=float, default=55.0,
                        help="--contention: packed bytes decoded per second of the chain (the bus's rate)")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    shapes = SHAPES if cuda else [(96, 64), (64, 96)]
    repeats = args.repeats if cuda else 2
    rows = []
    print(f"{'kind':42} {'shape':>13} {'kernel us':>10} {'GB/s':>8} {'% peak':>7} {'torch us':>10} {'GB/s':>8}  same bits")
    for codes_dtype, scale_dtype, math, label in KINDS:
        for r, c in shapes:
            gen = torch.Generator(device="cpu").manual_seed(r * 31 + c)
            raw = torch.randint(0, 256, (r, c), generator=gen, dtype=torch.uint8)
            if codes_dtype == "float8_e4m3fn":
                raw[(raw & 0x7F) == 0x7F] = 0  # no NaN codes: the comparison below is then exact
            codes = raw.view(getattr(torch, codes_dtype)).to(device)
            scale = (torch.rand(r, 1, generator=gen) * 0.01 + 1e-4).to(scale_dtype).to(device)
            kernel = lambda: mm._testing.dequantize(codes, scale, "bfloat16", math)  # noqa: E731
            ops = lambda: mm._testing.dequantize(codes, scale, "bfloat16", math, use_core=False)  # noqa: E731
            same = torch.equal(kernel(), ops())
            moved = codes.numel() + scale.numel() * scale.element_size() + codes.numel() * 2
            t_k, t_o = _time(kernel, device, repeats), _time(ops, device, repeats)
            gbs_k, gbs_o = moved / t_k / 1e9, moved / t_o / 1e9
            share = gbs_k / args.peak_gbs * 100 if args.peak_gbs else None
            rows.append({"kind": label, "codes": codes_dtype, "scale": str(scale_dtype), "math": math,
                         "shape": [r, c], "device": str(device), "kernel_s": t_k, "kernel_gbs": gbs_k,
                         "kernel_share_of_peak": share, "torch_ops_s": t_o, "torch_ops_gbs": gbs_o,
                         "same_bits": same})
            _print_row(label, r, c, t_k, gbs_k, share, f"{t_o * 1e6:>10.1f} {gbs_o:>8.0f}", same)
    for r, c in shapes:
        gen = torch.Generator(device="cpu").manual_seed(r * 17 + c)
        weight = (torch.randn(r, c, generator=gen) * 0.02).to(torch.bfloat16)
        packed, spec = mm._testing.lossless_pack(weight)
        packed = packed.to(device)
        kernel = lambda: mm._testing.lossless_unpack(packed, spec, [r, c])  # noqa: E731
        same = torch.equal(kernel().cpu(), weight)
        moved = packed.numel() + weight.numel() * 2
        t_k = _time(kernel, device, repeats)
        gbs_k = moved / t_k / 1e9
        share = gbs_k / args.peak_gbs * 100 if args.peak_gbs else None
        ratio = packed.numel() / (weight.numel() * 2)
        label = f"lossless bf16 ({ratio:.3f} of the bytes)"
        rows.append({"kind": "lossless", "shape": [r, c], "device": str(device), "kernel_s": t_k,
                     "kernel_gbs": gbs_k, "kernel_share_of_peak": share, "packed_ratio": ratio,
                     "exceptions": spec[1], "same_bits": same})
        _print_row(label, r, c, t_k, gbs_k, share, f"{'-':>10} {'-':>8}", same)  # no torch counterpart
    if args.nvfp4:
        rows += nvfp4(device, NVFP4_SHAPES if cuda else [(32, 64)], repeats, args.peak_gbs)
    if args.contention and cuda:
        rows += contention(device, [int(c) for c in args.contention_blocks.split(",")], args.bus_gbs)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                       "rows": rows}, f, indent=1)
    return 0 if all(r["same_bits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
