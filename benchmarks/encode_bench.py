"""Host encode speed of LAYERSTREAM_HOST_DTYPE=lossless (the packing done at attach): GB/s of bfloat16
weights in, at each thread count asked, plus the host decode (what a PackedWeight's read costs).

    python benchmarks/encode_bench.py --gib 1 --threads 1 2 0      # 0: one thread per core

The output is the same for any thread count (checked here too, byte for byte)."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from layerstream import manager_modules as mm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="GiB of bfloat16 weights (one tensor per 64 MiB)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 0])
    ap.add_argument("--repeats", type=int, default=2, help="best of this many runs")
    args = ap.parse_args()
    torch.manual_seed(0)
    per = 32 * 1024 * 1024  # values per tensor (64 MiB)
    n = max(1, int(args.gib * (1 << 30) / 2 / per))
    weights = [(torch.randn(per) * 0.02).to(torch.bfloat16) for _ in range(n)]
    total = n * per * 2
    rows, first = [], None
    for threads in args.threads:
        mm._testing.set_lossless_threads(threads)
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            packed = [mm._testing.lossless_pack(w) for w in weights]
            best = min(best, time.perf_counter() - t0)
        digest = [(p[0].numel(), int(p[0].sum())) for p in packed]
        first = first or digest
        assert digest == first, "the encoding changed with the thread count"
        rows.append({"threads": threads or os.cpu_count(), "encode_gbps": round(total / best / 1e9, 3),
                     "ratio": round(sum(p[0].numel() for p in packed) / total, 4)})
        del packed
    mm._testing.set_lossless_threads(0)
    codes, spec = mm._testing.lossless_pack(weights[0])
    t0 = time.perf_counter()
    out = mm._testing.lossless_unpack(codes, spec, [per])
    decode = time.perf_counter() - t0
    assert torch.equal(out, weights[0])
    print(json.dumps({"bytes": total, "encode": rows, "host_decode_gbps": round(per * 2 / decode / 1e9, 3),
                      "cores": os.cpu_count()}))


if __name__ == "__main__":
    main()
