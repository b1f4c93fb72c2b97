"""Against AI-Toolkit's own manager.py (HEAD 27a03a91 and 323b4aaf), loaded from the checkout(s) named by
AI_TOOLKIT_DIR, with layerstream's manager_modules in place of the stock file. Skipped without it."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F

from conftest import OstrisToolkit, aitk_dirs, block_bytes, torchao_codes_and_scale
from layerstream import manager_modules as mm
from layerstream.aitk import import_toolkit, load_memory_management
from models import TinyTransformer, apply_lora, train_lora

DIRS = aitk_dirs()
pytestmark = pytest.mark.skipif(
    not DIRS, reason="AI_TOOLKIT_DIR is not set (point it at one or more AI-Toolkit checkouts, os.pathsep-separated)"
)


@pytest.mark.parametrize("aitk_dir", DIRS)
@pytest.mark.parametrize("checkpointing", [None, "non_reentrant"])
def test_real_manager_trains_lora_bitwise_like_resident(engine, device, aitk_dir, checkpointing):
    package = load_memory_management(aitk_dir, engine="layerstream")
    torch.manual_seed(11)
    base = TinyTransformer(checkpointing=checkpointing).requires_grad_(False)
    resident = copy.deepcopy(base).to(device)
    managed = copy.deepcopy(base)
    random.seed(0)
    package.MemoryManager.attach(managed, device, offload_percent=1.0)
    managed.to(device)  # manager.py's patched .to: only unmanaged modules move
    linears = [m for m in managed.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(hasattr(m, "_layer_memory_manager") for m in linears)
    assert all(m.weight.device.type == "cpu" for m in linears)
    ref_loras = [lo.to(device) for lo in apply_lora(resident)]
    loras = [lo.to(device) for lo in apply_lora(managed)]
    sync = getattr(package, "sync_grad_transfers", lambda: None)
    steps = 10 if engine == "cuda" else 3
    assert train_lora(managed, loras, device, steps, sync) == train_lora(resident, ref_loras, device, steps)
    for a, b in zip(ref_loras, loras):
        assert torch.equal(a.up, b.up) and torch.equal(a.down, b.down)

    if hasattr(package.MemoryManager, "detach"):  # HEAD only
        package.MemoryManager.detach(managed)
        assert not any(hasattr(m, "_layer_memory_manager") for m in managed.modules())
        assert not any(k.type == "cuda" for k in map(torch.device, mm._DEVICE_STATE))
        if engine != "cuda":
            # A plain model again. (On CUDA, upstream's detach leaves the old pinned Parameter in
            # _parameters behind an unpinned clone, so a later .to() moves only the shadowed one.)
            assert managed(torch.randn(1, 3, 64)).shape == (1, 3, 64)


@pytest.mark.parametrize("aitk_dir", DIRS)
def test_real_manager_free_releases_layerstream_memory(engine, device, aitk_dir):
    package = load_memory_management(aitk_dir, engine="layerstream")
    if not hasattr(package.MemoryManager, "free"):
        pytest.skip(f"{aitk_dir}: this AI-Toolkit version has no MemoryManager.free")
    if engine == "cpu":
        pytest.skip("the CPU mode keeps no engine")
    model = TinyTransformer(layers=2).requires_grad_(False)
    before = mm.stats()["host_bytes_requested"]
    package.MemoryManager.attach(model, device)
    model.to(device)
    with torch.no_grad():
        model(torch.randn(1, 3, 64, device=device))
    assert mm.stats()["host_bytes_requested"] > before
    package.MemoryManager.free(model)
    for key in list(mm._DEVICE_STATE):  # free() drops the cuda keys; drop the cpu one too
        del mm._DEVICE_STATE[key]
    package.MemoryManager.release_cached_memory()
    assert mm.stats()["host_bytes_requested"] == before
    assert mm.live_device_states() == 0


@pytest.mark.parametrize("aitk_dir", DIRS)
def test_stock_and_layerstream_agree_on_the_same_checkout(device, engine, aitk_dir):
    if engine != "cuda" and engine != "cpu":
        pytest.skip("one comparison per device is enough")
    outputs = []
    for which in ("stock", "layerstream"):
        package = load_memory_management(aitk_dir, engine=which)
        torch.manual_seed(12)
        model = TinyTransformer(layers=2).requires_grad_(False)
        package.MemoryManager.attach(model, device)
        model.to(device)
        with torch.no_grad():
            outputs.append(model(torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1)).to(device)))
    assert torch.equal(outputs[0], outputs[1])


def _import_quantize(aitk_dir):
    """AI-Toolkit's own toolkit/util/quantize.py (toolkit.print stands in where accelerate is missing)."""
    for lib in ("optimum.quanto", "torchao", "tqdm", "safetensors", "huggingface_hub"):
        pytest.importorskip(lib, reason=f"AI-Toolkit's quantize() needs {lib}")
    try:
        return import_toolkit(aitk_dir, "toolkit.util.quantize")[0]
    except ImportError as exc:  # 323b4aaf imports UIntXWeightOnlyConfig, which torchao 0.18 no longer has
        pytest.skip(f"{aitk_dir}: its toolkit/util/quantize.py does not import here: {exc}")


@pytest.mark.parametrize("aitk_dir", DIRS)
def test_real_ostris_linear_streams_its_buffers_and_computes_like_itself(engine, device, aitk_dir):
    """AI-Toolkit's quantized linear (uint4, its own packing): its buffers and bias go into one arena block,
    each call stages them through the engine and runs the layer's own quantizer: bitwise its own output."""
    toolkit = OstrisToolkit(aitk_dir)
    torch.manual_seed(12)
    layers = []
    for _ in range(3):
        lin = torch.nn.Linear(256, 128).to(torch.bfloat16)
        assert toolkit.ostris.convert_linear_to_ostris(lin, toolkit.quantizer("uint4"))
        layers.append(lin.to(device))
    x = torch.randn(4, 256, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        expected = [lin(x) for lin in layers]
    for lin in layers:
        mm.OstrisLinearLayerMemoryManager.attach(lin, type("M", (), {"process_device": device})())
        lmm = lin._layer_memory_manager
        assert lmm.path == "ostris"
        assert lmm.packed_bytes == block_bytes(*lin._buffers.values(), lin.bias)
        assert all(b.device.type == "cpu" for b in lin._buffers.values())
        if engine == "cuda":
            assert all(b.is_pinned() for b in lin._buffers.values())
    before = mm.stats()["bytes_h2d"]
    for _ in range(2):  # the second pass reuses or refetches: the same bits either way
        with torch.no_grad():
            for lin, want in zip(layers, expected):
                assert torch.equal(lin(x), want)
                assert all(b.device.type == "cpu" for b in lin._buffers.values())  # host views put back
    if engine != "cpu":
        assert mm.stats()["bytes_h2d"] - before >= sum(l._layer_memory_manager.packed_bytes for l in layers)
    # A requantize writes new codes in place (AI-Toolkit's merge path): the next call sees them.
    lin = layers[0]
    with torch.no_grad():
        lin.requantize_(torch.randn(128, 256))
        assert torch.equal(lin(x), F.linear(x, lin.dequantize_weight().to(device).to(x.dtype), lin.bias.to(device)))


@pytest.mark.parametrize("aitk_dir", DIRS)
def test_real_quantize_float8_streams_as_stored_and_trains_bitwise(engine, device, aitk_dir):
    """With layer_offloading on, AI-Toolkit turns qtype qfloat8 into torchao float8 (config_modules.py) and
    quantizes with its own quantize(), as its test_memory_manager.py does: quantize(model, weights=
    get_qtype("float8")), freeze(model). Every linear takes the quantized path with its codes and scale at
    their stored size, and a LoRA trains bitwise like the same model computing with torchao's dequantize()
    (checkpointed: each block's weights are read by the forward, the recomputed forward and the backward)."""
    q = _import_quantize(aitk_dir)
    from optimum.quanto import freeze

    def quantized():
        torch.manual_seed(13)
        model = TinyTransformer(checkpointing="non_reentrant").to(device, torch.bfloat16)
        q.quantize(model, weights=q.get_qtype("float8"))
        freeze(model)
        return model.requires_grad_(False)

    managed, resident = quantized(), quantized()
    for lin in (m for m in resident.modules() if isinstance(m, torch.nn.Linear)):
        lin.weight = torch.nn.Parameter(lin.weight.dequantize(), requires_grad=False)
    linears = [m for m in managed.modules() if isinstance(m, torch.nn.Linear)]
    stored = [[t.numel() * t.element_size() for t in torchao_codes_and_scale(m.weight)] for m in linears]
    package = load_memory_management(aitk_dir, engine="layerstream")
    random.seed(0)
    package.MemoryManager.attach(managed, device, offload_percent=1.0)
    managed.to(device)
    for lin, (codes, scale) in zip(linears, stored):
        lmm = lin._layer_memory_manager
        assert (lmm.path, lmm.stored_as) == ("quantized", "Float8_e4m3fn")
        bias = 0 if lin.bias is None else lin.bias.numel() * 2
        assert lmm.packed_bytes == (_align(_align(codes) + scale) + bias if bias else _align(codes) + scale)
    sync = getattr(package, "sync_grad_transfers", lambda: None)
    ref_loras = [lo.to(device) for lo in apply_lora(resident, dtype=torch.bfloat16)]
    loras = [lo.to(device) for lo in apply_lora(managed, dtype=torch.bfloat16)]
    got = train_lora(managed, loras, device, 3, sync, dtype=torch.bfloat16)
    assert got == train_lora(resident, ref_loras, device, 3, dtype=torch.bfloat16)
    for a, b in zip(ref_loras, loras):
        assert torch.equal(a.up, b.up) and torch.equal(a.down, b.down)


def _align(n: int) -> int:
    return (n + 255) // 256 * 256
