"""Every OstrisLinear quantizer AI-Toolkit ships (toolkit/util/ostris_quant.py:get_ostris_quantizer at 27a03a91:
uint2..uint7 in uintx_quant.py, the convrot variants in convrot_quant.py, nvfp4, orbit2/3/4, orbitvq2/3/4),
quantized by AI-Toolkit's own code from the checkout in AI_TOOLKIT_DIR and managed by its own manager.py: with
layerstream's manager_modules each layer's buffers (and bias) cross the bus as stored, and the outputs and LoRA
gradients are bitwise those of the same model under AI-Toolkit's stock manager_modules.py and unmanaged.

Each backend's state is its `_buffers` (uint8/int8/int32 codes, scales as byte views, rotations) plus plain
int attributes (bit width, rotation size); none keeps per-layer state outside them. OrbitVQ's lattice
codebooks and ConvRot's Hadamard matrices are per-device constants in module caches, built once, as under
stock. Every forward runs on the CPU (the torch fallbacks of the Triton kernels), so the CPU and simulator
cases cover every layout; the CUDA cases take the kernels an H200 (sm_90) has: torch._int_mm and the Triton
kernels for the int8/intN/bitnet/comfy variants, and for convrot4 the fallback AI-Toolkit takes without fp4
tensor cores (sm_100+): a straight-through fake-quantized activation and a dequantized bf16 matmul. nvfp4
never uses an fp4 GEMM (its forward is a dequantized matmul on every GPU). The widths that share a layout with
one tested everywhere run on the GPU only, to keep the CPU run short."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F

from conftest import OstrisToolkit, aitk_dirs, block_bytes, skip_unless_triton_can_build
from layerstream import manager_modules as mm
from layerstream.aitk import load_memory_management
from models import apply_lora, train_lora

DIRS = aitk_dirs()
pytestmark = pytest.mark.skipif(
    not DIRS, reason="AI_TOOLKIT_DIR is not set (point it at one or more AI-Toolkit checkouts, os.pathsep-separated)"
)

# One qtype per layout, on every engine: uintx's two-shard packing, each convrot class (the intN widths up to
# 7 bits keep group ratios, 8 bits none), nvfp4, orbit's scalar codebook, orbit-VQ's D4 lattice.
LAYOUTS = ["uint3", "convrot4", "convrot8", "convrotbitnet", "convrotcomfyw4a4", "convrotint4", "convrotint8",
           "nvfp4", "orbit3", "orbitvq3"]
# The other widths of those layouts: on the GPU only (orbitvq2 builds a 65536-point E8 codebook, ~5 s of CPU).
OTHER_WIDTHS = ["uint2", "uint4", "uint5", "uint6", "uint7", "convrotint2", "convrotint3", "convrotint5",
                "convrotint6", "convrotint7", "orbit2", "orbit4", "orbitvq2", "orbitvq4"]
QTYPES = LAYOUTS + [pytest.param(q, marks=pytest.mark.gpu) for q in OTHER_WIDTHS]
DTYPE = torch.bfloat16
# The backends whose weight layerstream decodes itself (src/torch/ostris_fast.h).
DECODED = ("uint", "orbit", "nvfp4")  # (and convrot4 where the GPU has no fp4 matmul: all but sm_100+)


# The ConvRot backends whose forward is an int8 matmul (torch._int_mm): layerstream does their training
# backward, decoding the weight it multiplies by (src/torch/ostris_fast.cc, IntSteFn).
INT_MM = ("convrot8", "convrotint", "convrotbitnet", "convrotcomfyw4a4")


def trained_here(qtype: str, device) -> bool:
    """Whether layerstream does this backend's training calls itself: the decoded families, and the int8
    matmul ones where AI-Toolkit uses torch._int_mm (it does on CUDA, and takes a fake-quantized fallback on
    the CPU)."""
    if qtype.startswith(INT_MM):
        return torch.device(device).type == "cuda"
    return decoded_here(qtype, device)


def decoded_here(qtype: str, device) -> bool:
    """Whether layerstream decodes this backend's weight itself (src/torch/ostris_fast.h)."""
    if qtype == "convrot4":
        return not (torch.device(device).type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10)
    return qtype.startswith(DECODED)


# The backends whose CUDA forward (or dequantization) is one of AI-Toolkit's Triton kernels.
TRITON_QTYPES = ("convrot", "nvfp4")


@pytest.fixture(autouse=True)
def triton_compiler_on_cuda(request):
    """A CUDA case of a Triton backend (its `qtype`, or the `aitk_triton` mark of a case that names its
    backends itself) needs the C compiler Triton builds its launchers with."""
    spec = getattr(request.node, "callspec", None)
    params = spec.params if spec is not None else {}
    qtype = params.get("qtype")
    triton = request.node.get_closest_marker("aitk_triton") is not None or (
        isinstance(qtype, str) and qtype.startswith(TRITON_QTYPES))
    if triton and params.get("engine", "cuda") == "cuda" and torch.cuda.is_available():
        skip_unless_triton_can_build(qtype or request.node.name)


class QuantizedStack(torch.nn.Module):
    """Three 256-wide linears (the width every backend takes: ConvRot's ComfyUI variant needs 256 inputs),
    one without a bias, and a LayerNorm (the `norm` models.train_lora reads the width from)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(256, 256)
        self.b = torch.nn.Linear(256, 256, bias=False)
        self.c = torch.nn.Linear(256, 256)
        self.norm = torch.nn.LayerNorm(256)

    def forward(self, x):
        return self.norm(self.c(F.gelu(self.b(F.gelu(self.a(x))))))

    def linears(self):
        return [self.a, self.b, self.c]


_quantized: dict[tuple[str, str], QuantizedStack] = {}


def quantized_stack(toolkit: OstrisToolkit, qtype: str) -> QuantizedStack:
    """A QuantizedStack in bf16, every linear converted by AI-Toolkit's convert_linear_to_ostris with its
    get_ostris_quantizer(qtype) (what its quantize() does for these qtypes), frozen; a fresh copy of one
    quantized once per process."""
    key = (toolkit.aitk_dir, qtype)
    if key not in _quantized:
        torch.manual_seed(31)
        model = QuantizedStack().to(DTYPE).requires_grad_(False)
        quantizer = toolkit.quantizer(qtype)
        for lin in model.linears():
            assert toolkit.ostris.convert_linear_to_ostris(lin, quantizer), f"{qtype} refused a 256x256 linear"
        _quantized[key] = model
    return copy.deepcopy(_quantized[key])


def attached(aitk_dir: str, engine_name: str, model, device):
    """`model` under AI-Toolkit's own MemoryManager with `engine_name`'s manager_modules (100% offloaded)."""
    package = load_memory_management(aitk_dir, engine=engine_name)
    random.seed(0)
    package.MemoryManager.attach(model, device, offload_percent=1.0)
    model.to(device)  # manager.py's patched .to: only the unmanaged modules (the LayerNorm) move
    return package


def stored(layer) -> list[torch.Tensor]:
    """What an OstrisLinear stores: its buffers, then its bias."""
    return [b for b in layer._buffers.values() if b is not None] + ([] if layer.bias is None else [layer.bias])


def first_call_bytes(model, x) -> list[int]:
    """The bytes layerstream's engine copies for each layer's call in one no_grad forward of a model whose
    layers have not run yet (nothing in the ring: each copy is the layer's whole block)."""
    moved = []
    for lin in model.linears():
        before = mm.stats()["bytes_h2d"]
        lin(x)
        moved.append(mm.stats()["bytes_h2d"] - before)
    return moved


def merge_into(layer, lora) -> None:
    """AI-Toolkit's LoRA merge into an OstrisLinear (network_mixins.py merge_in), where the layer's buffers are:
    the backend's float32 dequantize() plus up @ down, written back with requantize_ (what
    requantize_module_weight calls for an OstrisLinear). The delta is scaled up to move codes at every width."""
    with torch.no_grad():
        weight = layer.ostris_quantizer.dequantize(layer)
        delta = lora.up.detach().float() @ lora.down.detach().float()
        layer.requantize_(weight + 50 * delta.to(weight.device))


def skip_unless_streamed(engine: str, qtype: str | None = None) -> None:
    """The cases below are the streamed ones (simulator, CUDA); the other widths of a layout run on CUDA only."""
    if engine == "cpu":
        pytest.skip("the CPU process device keeps no engine: layerstream, like stock, runs the layer's own forward "
                    "on its host buffers (the simulator case streams them)")
    if qtype in OTHER_WIDTHS and engine != "cuda":
        pytest.skip(f"{qtype} shares its layout with one tested on this engine; its width runs on the GPU only")


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("aitk_dir", DIRS)
def test_backend_streams_as_stored_and_trains_like_stock(engine, device, aitk_dir, qtype):
    skip_unless_streamed(engine, qtype)
    toolkit = OstrisToolkit(aitk_dir)
    unmanaged = quantized_stack(toolkit, qtype).to(device)
    stock, managed = quantized_stack(toolkit, qtype), quantized_stack(toolkit, qtype)
    sizes = [block_bytes(*stored(lin)) for lin in managed.linears()]
    stock_package = attached(aitk_dir, "stock", stock, device)
    package = attached(aitk_dir, "layerstream", managed, device)
    for lin, size in zip(managed.linears(), sizes):
        lmm = lin._layer_memory_manager
        assert (type(lin).__name__, lmm.path, lmm.packed_bytes) == ("OstrisLinear", "ostris", size)
        assert all(t.device.type == "cpu" and (engine != "cuda" or t.is_pinned()) for t in stored(lin))

    # A call moves the layer's block: its buffers and bias as stored, nothing dequantized.
    x = torch.randn(2, 6, 256, dtype=DTYPE, generator=torch.Generator().manual_seed(5)).to(device)
    host = [[t.data_ptr() for t in stored(lin)] for lin in managed.linears()]
    decoded, kept = mm.stats()["ostris_decoded"], mm.stats()["ostris_kept_bytes"]
    with torch.no_grad():
        assert first_call_bytes(managed, x) == sizes
        # After a call the layer holds its host copies again, its bias too (the staged ones are gone).
        assert [[t.data_ptr() for t in stored(lin)] for lin in managed.linears()] == host
        want = unmanaged(x)
        assert torch.equal(stock(x), want) and torch.equal(managed(x), want)
    # uintx, orbit, orbit-VQ, nvfp4 and convrot4 weights are decoded by layerstream (ostris_fast.h), the others
    # by their backend.
    assert mm.stats()["ostris_decoded"] - decoded == (6 if decoded_here(qtype, device) else 0)
    # Nothing outlived a call without a graph: no staged buffer was copied out of the ring.
    assert mm.stats()["ostris_kept_bytes"] == kept

    # LoRA training: the losses and every LoRA parameter bitwise stock's and the unmanaged model's.
    # (On a CPU device stock runs the layer's own forward unmanaged: its run is the unmanaged one.)
    runs = {}
    for name, model, pkg in (("unmanaged", unmanaged, None), ("stock", stock, stock_package),
                             ("layerstream", managed, package)):
        if name == "unmanaged" and engine != "cuda":
            continue
        loras = [lo.to(device) for lo in apply_lora(model, dtype=DTYPE)]
        sync = getattr(pkg, "sync_grad_transfers", lambda: None)
        decoded = mm.stats()["ostris_decoded"]
        runs[name] = (train_lora(model, loras, device, 2, sync, dtype=DTYPE), loras)
        if name == "layerstream":  # training too (convrot4: its straight-through activation as well)
            assert (mm.stats()["ostris_decoded"] > decoded) == trained_here(qtype, device)
    want_losses, want_loras = runs.pop("stock")
    for name, (losses, loras) in runs.items():
        assert losses == want_losses, name
        for ref, mine in zip(want_loras, loras):
            assert torch.equal(mine.up, ref.up) and torch.equal(mine.down, ref.down), name


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("aitk_dir", DIRS)
def test_a_merge_requantized_into_the_layer_is_seen_by_the_next_call(engine, device, aitk_dir, qtype):
    """requantize_ replaces the layer's buffers on the host (stock's and layerstream's alike); the next call
    packs and moves the new ones as stored and computes like stock and the unmanaged layer merged the same."""
    skip_unless_streamed(engine, qtype)
    toolkit = OstrisToolkit(aitk_dir)
    unmanaged, stock, managed = (quantized_stack(toolkit, qtype) for _ in range(3))
    attached(aitk_dir, "stock", stock, device)
    attached(aitk_dir, "layerstream", managed, device)
    x = torch.randn(2, 6, 256, dtype=DTYPE, generator=torch.Generator().manual_seed(6)).to(device)
    with torch.no_grad():
        before = managed.a(x)
    lora = apply_lora(torch.nn.Sequential(torch.nn.Linear(256, 256)))[0]  # a random up @ down
    for model in (unmanaged, stock, managed):  # on the host, where the managed layers keep their buffers
        merge_into(model.a, lora)
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(stored(managed.a), stored(unmanaged.a)))
    lmm = managed.a._layer_memory_manager
    unmanaged.to(device)
    with torch.no_grad():
        moved = mm.stats()["bytes_h2d"]
        after = managed.a(x)
        assert mm.stats()["bytes_h2d"] - moved == lmm.packed_bytes
        assert lmm.packed_bytes == block_bytes(*stored(managed.a))
        assert not torch.equal(after, before), "the merge changed nothing: a stale copy would go unseen"
        assert torch.equal(after, unmanaged.a(x)) and torch.equal(stock.a(x), after)
        assert torch.equal(managed(x), unmanaged(x))


@pytest.mark.parametrize("qtype", LAYOUTS)
@pytest.mark.parametrize("aitk_dir", DIRS)
def test_detach_gives_the_buffers_back_and_free_releases_them(engine, device, aitk_dir, qtype):
    """AI-Toolkit's detach(): each layer keeps exactly the buffers and bias it had (on the host) and computes as
    before; free(): what layerstream held for them is released."""
    skip_unless_streamed(engine)
    toolkit = OstrisToolkit(aitk_dir)
    reference = quantized_stack(toolkit, qtype)
    model = quantized_stack(toolkit, qtype)
    package = load_memory_management(aitk_dir, engine="layerstream")
    if not hasattr(package.MemoryManager, "free"):
        pytest.skip(f"{aitk_dir}: this AI-Toolkit version has no MemoryManager.detach/free")
    host_before = mm.stats()["host_bytes_requested"]
    attached(aitk_dir, "layerstream", model, device)
    x = torch.randn(3, 256, dtype=DTYPE, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = reference.to(device)(x.to(device))
        assert torch.equal(model(x.to(device)), want)
    package.MemoryManager.detach(model)
    for lin, ref in zip(model.linears(), reference.linears()):
        assert not hasattr(lin, "_layer_memory_manager")
        assert list(lin._buffers) == list(ref._buffers)
        for mine, theirs in zip(stored(lin), stored(ref)):
            assert mine.device.type == "cpu" and mine.dtype == theirs.dtype and torch.equal(mine, theirs.cpu())
    if engine != "cuda":  # (on CUDA, upstream's detach shadows the pinned bias with an unpinned clone that
        with torch.no_grad():  # a later .to() does not move; test_aitk_real.py says the same)
            assert torch.equal(model.to(device)(x.to(device)), want)
    model = quantized_stack(toolkit, qtype)
    attached(aitk_dir, "layerstream", model, device)
    assert mm.stats()["host_bytes_requested"] > host_before
    shapes = [[(t.shape, t.dtype) for t in stored(lin)] for lin in model.linears()]
    package.MemoryManager.free(model)
    assert [[(t.shape, t.dtype) for t in stored(lin)] for lin in model.linears()] == shapes
    assert all(t.is_meta for lin in model.linears() for t in stored(lin))
    del model
    for key in list(mm._DEVICE_STATE):  # free() drops the cuda keys; drop the simulator's too
        del mm._DEVICE_STATE[key]
    package.MemoryManager.release_cached_memory()
    assert mm.stats()["host_bytes_requested"] == host_before


@pytest.mark.aitk_triton
@pytest.mark.parametrize("aitk_dir", DIRS)
def test_a_layer_quantized_again_into_another_backend_streams_its_new_buffers(engine, device, aitk_dir):
    """AI-Toolkit's convert_linear_to_ostris re-quantizes an OstrisLinear into another qtype by clearing its
    buffers and registering the new backend's (so does load_quantized_layers with a file of another qtype):
    the next call packs the new set, moves it as stored and computes like the same layer unmanaged."""
    skip_unless_streamed(engine)
    toolkit = OstrisToolkit(aitk_dir)
    unmanaged, model = quantized_stack(toolkit, "convrot8"), quantized_stack(toolkit, "convrot8")
    attached(aitk_dir, "layerstream", model, device)
    x = torch.randn(3, 256, dtype=DTYPE, generator=torch.Generator().manual_seed(7)).to(device)
    with torch.no_grad():
        model(x)
    nvfp4 = toolkit.quantizer("nvfp4")  # (orbit's quantize_ reads module.weight, which this path has cleared)
    for lin in (unmanaged.b, model.b):
        assert toolkit.ostris.convert_linear_to_ostris(lin, nvfp4)
    assert list(model.b._buffers) == ["nv4_qdata", "nv4_scales", "nv4_pts"]
    with torch.no_grad():
        moved = mm.stats()["bytes_h2d"]
        got = model.b(x)
        assert mm.stats()["bytes_h2d"] - moved == block_bytes(*stored(model.b))
        assert model.b._layer_memory_manager.packed_bytes == block_bytes(*stored(model.b))
        assert torch.equal(got, unmanaged.b.to(device)(x))
        assert torch.equal(model(x), unmanaged.to(device)(x))


@pytest.mark.aitk_triton
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason=f"needs two GPUs (this machine has {torch.cuda.device_count()})")
@pytest.mark.parametrize("aitk_dir", DIRS)
def test_triton_backends_on_the_second_gpu_while_the_first_is_current(aitk_dir):
    """The quantizers' Triton kernels launch on the current device; stock makes the process device current
    around the layer's forward, and so does layerstream: a convrot8 model on cuda:1 (Triton activation
    quantization and epilogue, torch._int_mm) with cuda:0 current computes bitwise as on cuda:1."""
    from conftest import clear_device_states

    clear_device_states()
    torch.cuda.set_device(0)
    dev1 = torch.device("cuda", 1)
    toolkit = OstrisToolkit(aitk_dir)
    unmanaged, model = quantized_stack(toolkit, "convrot8"), quantized_stack(toolkit, "convrot8")
    attached(aitk_dir, "layerstream", model, dev1)
    x = torch.randn(2, 6, 256, dtype=DTYPE, generator=torch.Generator().manual_seed(8)).to(dev1)
    with torch.no_grad(), torch.cuda.device(1):
        want = unmanaged.to(dev1)(x)
    with torch.no_grad():
        assert torch.equal(model(x), want)
    assert torch.cuda.current_device() == 0
    clear_device_states()


@pytest.mark.aitk_triton
@pytest.mark.parametrize("aitk_dir", DIRS)
def test_convrot4_activation_at_its_corners_trains_like_stock(engine, device, aitk_dir):
    """convrot4's training activation (quantized to nvfp4 and back by a kernel of layerstream's, proved on the
    first call): on inputs at the corners of that quantization (tiny and large blocks, exact e2m1 ties, zeros)
    the outputs and input gradients are bitwise stock's, call after call, and every call is decoded here."""
    skip_unless_streamed(engine)
    if not decoded_here("convrot4", device):
        pytest.skip("this GPU has fp4 matmuls: convrot4 runs its own forward")
    from test_nvfp4_kernels import corner_activations

    toolkit = OstrisToolkit(aitk_dir)
    stock, managed = quantized_stack(toolkit, "convrot4"), quantized_stack(toolkit, "convrot4")
    attached(aitk_dir, "stock", stock, device)
    attached(aitk_dir, "layerstream", managed, device)
    decoded = mm.stats()["ostris_decoded"]
    for seed, top in ((1, None), (2, 2688.0), (3, 937.0)):
        x = corner_activations(DTYPE, seed, top).view(48, 2, 128).reshape(48, 256).to(device)
        results = []
        for model in (stock, managed):
            xin = x.clone().requires_grad_(True)
            out = model.a(xin)
            out.float().square().sum().backward()
            results.append((out.detach(), xin.grad))
        (want, want_grad), (got, got_grad) = results
        assert torch.equal(got, want) and torch.equal(got_grad, want_grad), seed
    assert mm.stats()["ostris_decoded"] - decoded == 3


INT_LAYOUTS = ["convrot8", "convrotbitnet", "convrotcomfyw4a4", "convrotint4", "convrotint8"]


@pytest.mark.parametrize("checkpointing", ["none", "non-reentrant", "reentrant"])
@pytest.mark.parametrize("qtype", INT_LAYOUTS + [pytest.param(q, marks=pytest.mark.gpu) for q in
                                                 ("convrotint2", "convrotint3", "convrotint5", "convrotint6",
                                                  "convrotint7")])
@pytest.mark.parametrize("aitk_dir", DIRS)
def test_int_matmul_backends_train_with_layerstreams_backward(engine, device, aitk_dir, qtype, checkpointing,
                                                             monkeypatch):
    """The int8-matmul ConvRot backends in training: their own forward (torch._int_mm), layerstream's backward
    (the weight decoded from the staged codes in one kernel, proved on the first call): outputs and input
    gradients bitwise stock's, with and without gradient checkpointing (both kinds), every training call
    (both passes of checkpointing) taken here, and the codes the backward needs kept past the call, as the
    backend keeps them: their stored bytes, once per layer."""
    skip_unless_streamed(engine, qtype)
    from torch.utils.checkpoint import checkpoint

    toolkit = OstrisToolkit(aitk_dir)
    if engine != "cuda":
        # AI-Toolkit takes torch._int_mm only on CUDA; the simulator's device is the host, where _int_mm runs
        # too: let both engines take the int8 path a GPU takes.
        monkeypatch.setattr(toolkit.modules["toolkit.util.convrot_quant"], "_int8_gemm_supported", lambda d: True)
    stock, managed = quantized_stack(toolkit, qtype), quantized_stack(toolkit, qtype)
    codes = [sum(t.numel() * t.element_size() for n, t in lin._buffers.items() if t is not None)
             for lin in managed.linears()]
    attached(aitk_dir, "stock", stock, device)
    attached(aitk_dir, "layerstream", managed, device)
    before = {k: mm.stats()[k] for k in ("ostris_decoded", "ostris_kept_bytes")}
    results = []
    for model in (stock, managed):
        got = []
        for seed in (1, 2):
            x = torch.randn(3, 5, 256, generator=torch.Generator().manual_seed(seed)).to(device, DTYPE)
            x.requires_grad_(True)
            if checkpointing == "none":
                out = model(x)
            else:
                out = checkpoint(model, x, use_reentrant=checkpointing == "reentrant")
            out.float().square().sum().backward()
            got.append((out.detach(), x.grad))
        results.append(got)
    for (want, want_grad), (out, grad) in zip(*results):
        assert torch.equal(out, want) and torch.equal(grad, want_grad)
    # Per forward: the three layers, twice under non-reentrant checkpointing; reentrant checkpointing's first
    # pass runs without a graph, where only the first layer's input (the checkpoint's) requires grad.
    calls = 2 * {"none": 3, "non-reentrant": 6, "reentrant": 1 + 3}[checkpointing]
    assert mm.stats()["ostris_decoded"] - before["ostris_decoded"] == calls
    assert mm.stats()["ostris_kept_bytes"] - before["ostris_kept_bytes"] == 2 * sum(codes)


def nvfp4_codes(packed: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=-1).view(rows, cols)


@pytest.mark.aitk_triton
@pytest.mark.parametrize("aitk_dir", DIRS)
def test_nvfp4_decode_is_aitks_own_bit_for_bit_zero_signs_included(device, aitk_dir):
    """The nvfp4 decoder against AI-Toolkit's dequantize_nvfp4 on every code and scale byte: its Triton kernel
    (CUDA) gives code 8, a zero with the sign bit, as +0 and its torch path (host) as -0; the decoder gives
    either, bit for bit."""
    toolkit = OstrisToolkit(aitk_dir)
    dequantize = toolkit.modules["toolkit.util.convrot_quant"].dequantize_nvfp4
    g = torch.Generator().manual_seed(3)
    rows, cols = 64, 512
    packed = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8).to(device)
    scales = torch.randint(0, 0x7f, (rows, cols // 16), generator=g, dtype=torch.uint8).to(device)
    pts = torch.tensor([2.5e-3], dtype=torch.float32).to(device)
    triton_path = torch.device(device).type == "cuda"
    for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float16, "float16"), (torch.float32, "float32")):
        theirs = dequantize(packed, scales.view(torch.float8_e4m3fn), pts, rows, cols, dtype)
        mine = mm._testing.nvfp4_decode(packed, scales, pts.view(torch.uint8), rows, cols, name,
                                        plus_zero=triton_path)
        assert torch.equal(torch.signbit(theirs[nvfp4_codes(packed, rows, cols) == 8]),
                           torch.full_like(theirs[nvfp4_codes(packed, rows, cols) == 8], not triton_path,
                                           dtype=torch.bool)), "AI-Toolkit's zero sign is not the one assumed"
        assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8)), name


@pytest.mark.aitk_triton
@pytest.mark.parametrize("aitk_dir", DIRS)
def test_an_nvfp4_backend_of_the_other_zero_sign_is_proved_and_decoded(engine, device, aitk_dir, monkeypatch):
    """Where AI-Toolkit's nvfp4 dequantization gives code 8 the other zero sign than the one guessed for the
    device (a Triton kernel on the host, the torch path on a GPU), the first call's bitwise proof fails, the
    decoder takes the other sign, proves again and decodes every call; outputs and LoRA training stay stock's."""
    skip_unless_streamed(engine)
    toolkit = OstrisToolkit(aitk_dir)
    module = toolkit.modules["toolkit.util.nvfp4_quant"]
    own = module.dequantize_nvfp4
    sign = -1.0 if torch.device(device).type == "cuda" else 1.0  # the sign the device's guess does not give

    def other_sign(packed, scales, pts, rows, cols, dtype):
        w = own(packed, scales, pts, rows, cols, dtype)
        scale = (scales.float() * pts).repeat_interleave(16, dim=1)
        return torch.where(nvfp4_codes(packed, rows, cols) == 8, (sign * 0.0 * scale).to(dtype), w)

    monkeypatch.setattr(module, "dequantize_nvfp4", other_sign)
    stock, managed = quantized_stack(toolkit, "nvfp4"), quantized_stack(toolkit, "nvfp4")
    assert any((nvfp4_codes(lin.nv4_qdata, 256, 256) == 8).any() for lin in managed.linears()), "no code 8 to see"
    stock_package = attached(aitk_dir, "stock", stock, device)
    package = attached(aitk_dir, "layerstream", managed, device)
    x = torch.randn(2, 6, 256, dtype=DTYPE, generator=torch.Generator().manual_seed(9)).to(device)
    decoded = mm.stats()["ostris_decoded"]
    with torch.no_grad():
        assert torch.equal(managed(x), stock(x))
    assert mm.stats()["ostris_decoded"] - decoded == 3
    want = train_lora(stock, [lo.to(device) for lo in apply_lora(stock, dtype=DTYPE)], device, 2,
                      getattr(stock_package, "sync_grad_transfers", lambda: None), dtype=DTYPE)
    got = train_lora(managed, [lo.to(device) for lo in apply_lora(managed, dtype=DTYPE)], device, 2,
                     package.sync_grad_transfers, dtype=DTYPE)
    assert got == want
