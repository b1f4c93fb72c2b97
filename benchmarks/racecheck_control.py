#!/usr/bin/env python3
"""The control for compute-sanitizer racecheck reports inside library kernels: the same bf16 conv2d
forward/backward cases as tests/python/test_manager_contract.py, in plain torch, without layerstream
imported. Hazards that racecheck reports here too belong to the library kernel (cuDNN), not to
layerstream. Run: compute-sanitizer --tool racecheck python3 benchmarks/racecheck_control.py"""

import torch

CASES = [
    dict(cin=4, cout=8, k=3, stride=1, padding=1, dilation=1, groups=1, bias=True),
    dict(cin=4, cout=8, k=3, stride=2, padding=0, dilation=2, groups=2, bias=False),
    dict(cin=6, cout=6, k=1, stride=1, padding=0, dilation=1, groups=3, bias=True),
    dict(cin=3, cout=5, k=(3, 1), stride=(2, 1), padding=(1, 0), dilation=1, groups=1, bias=True),
]

for trainable in (False, True):
    for case in CASES:
        torch.manual_seed(1)
        conv = torch.nn.Conv2d(case["cin"], case["cout"], case["k"], stride=case["stride"], padding=case["padding"],
                               dilation=case["dilation"], groups=case["groups"], bias=case["bias"])
        conv = conv.to(torch.bfloat16).cuda().requires_grad_(trainable)
        x = torch.randn(2, case["cin"], 11, 9, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        out = conv(x)
        out.backward(torch.randn_like(out))
torch.cuda.synchronize()
print("control done: torch", torch.__version__, "cudnn", torch.backends.cudnn.version())
