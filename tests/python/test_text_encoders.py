"""Real text encoders nobody here wrote: transformers' models of the kinds AI-Toolkit loads with
`layer_offloading_text_encoder_percent` for the models it offloads, built from small configs with random
weights in bf16: Qwen3 with tied embeddings (Z-Image's `Qwen3ForCausalLM`), UMT5 (Wan), T5 (FLUX.1), Mistral 3
with its Pixtral vision tower (FLUX.2) and Qwen2.5-VL given an image (Qwen-Image Edit). Each is attached the way
manager.py walks a model (its Linear and Conv2d layers managed; embeddings, norms, rotary embeddings and
Conv3d moved whole), called under no_grad as the pipelines call it, several times, with the model moved again
whenever `model.device` is not the process device (as Z-Image's `get_prompt_embeds` does): every hidden state
and the logits bitwise equal to the unmanaged model's. Then the encoder is freed as AI-Toolkit's unloader frees
one (where the manager has `free`), and every host byte layerstream took for it is returned."""

from __future__ import annotations

import copy
import gc
import logging
import random

import pytest
import torch

from conftest import aitk_dirs
from contract_driver import ContractManager
from layerstream import manager_modules as mm
from layerstream.aitk import load_memory_management

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

VOCAB = 512
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
IDS = torch.tensor([[1, 7, 33, 250, 499, 12, 5, 88, 301]])


def _qwen3_tied():
    cfg = transformers.Qwen3Config(**TEXT, head_dim=16, tie_word_embeddings=True)
    model = transformers.Qwen3ForCausalLM(cfg)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the Parameter managed and moved whole
    return model


def _t5(cls, cfg_cls):
    return cls(cfg_cls(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4))


def _mistral3():
    text = transformers.MistralConfig(**TEXT, head_dim=16)
    vision = transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=2, image_size=32, patch_size=8)
    return transformers.Mistral3ForConditionalGeneration(
        transformers.Mistral3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), spatial_merge_size=2))


def _qwen25_vl():
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(TEXT, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[1],
                           window_size=16),
        image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503)
    return transformers.Qwen2_5_VLForConditionalGeneration(cfg)


def _causal_call(model, device):
    out = model(input_ids=IDS.to(device), output_hidden_states=True)
    return list(out.hidden_states) + [out.logits]


def _encoder_call(model, device):
    out = model(input_ids=IDS.to(device), attention_mask=torch.ones_like(IDS).to(device), output_hidden_states=True)
    return list(out.hidden_states)


def _vl_call(model, device):
    # One 16x16 image: 4x4 patches of 4 pixels, merged 2x2 into the four image tokens of the prompt.
    ids = torch.tensor([[1, 2, 502, 500, 500, 500, 500, 503, 7, 8]], device=device)
    pixels = torch.randn(16, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(4)).to(device, torch.bfloat16)
    out = model(input_ids=ids, pixel_values=pixels, image_grid_thw=torch.tensor([[1, 4, 4]], device=device),
                output_hidden_states=True)
    return list(out.hidden_states) + [out.logits]


ENCODERS = {
    "qwen3-tied": (_qwen3_tied, _causal_call),
    "umt5": (lambda: _t5(transformers.UMT5EncoderModel, transformers.UMT5Config), _encoder_call),
    "t5": (lambda: _t5(transformers.T5EncoderModel, transformers.T5Config), _encoder_call),
    "mistral3": (_mistral3, _causal_call),
    "qwen2.5-vl-image": (_qwen25_vl, _vl_call),
}


class _Contract:
    """manager.py's walk as written here from the contract (runs everywhere)."""

    name = "contract"

    def attach(self, model, device):
        self.driver = ContractManager.attach(mm, model, device)

    def to_device(self, model, device):
        self.driver.to_device()

    def free(self, model):
        self.driver.free()
        return True


class _RealManager:
    """AI-Toolkit's own manager.py from a checkout, with layerstream's manager_modules."""

    def __init__(self, aitk_dir):
        self.name = aitk_dir
        self.package = load_memory_management(aitk_dir, engine="layerstream")

    def attach(self, model, device):
        random.seed(0)
        self.package.MemoryManager.attach(model, device, offload_percent=1.0)

    def to_device(self, model, device):
        model.to(device, dtype=torch.bfloat16)  # manager.py's patched .to, as the model loaders call it

    def free(self, model):
        """False where this AI-Toolkit version has no MemoryManager.free (323b4aaf)."""
        if not hasattr(self.package.MemoryManager, "free"):
            return False
        self.package.MemoryManager.free(model)
        return True


DRIVERS = ["contract"] + aitk_dirs()


def _driver(which):
    return _Contract() if which == "contract" else _RealManager(which)


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("encoder", sorted(ENCODERS))
def test_text_encoder_bitwise_on_every_call_then_freed(engine, device, encoder, driver):
    build, call = ENCODERS[encoder]
    torch.manual_seed(0)
    base = build().to(torch.bfloat16).eval().requires_grad_(False)
    resident = copy.deepcopy(base).to(device)
    with torch.no_grad():
        expected = call(resident, device)
    del resident

    gc.collect()
    before = mm.stats()["host_bytes_requested"]
    model = copy.deepcopy(base)
    del base
    manager = _driver(driver)
    manager.attach(model, device)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(hasattr(m, "_layer_memory_manager") for m in linears)
    manager.to_device(model, device)
    for _ in range(3):
        if model.device != device:  # what Z-Image's get_prompt_embeds does before it encodes
            manager.to_device(model, device)
        with torch.no_grad():
            got = call(model, device)
        assert len(got) == len(expected)
        for i, (a, b) in enumerate(zip(expected, got)):
            assert torch.equal(a, b), f"{encoder}: output {i} differs from the unmanaged model's"
    if engine == "sim":
        assert mm.stats()["host_bytes_requested"] > before

    if not manager.free(model):
        return
    assert all(p.device.type == "meta" for p in model.parameters())
    del model, got
    for key in list(mm._DEVICE_STATE):  # free() drops the cuda keys; the cpu one too, as a process end would
        del mm._DEVICE_STATE[key]
    gc.collect()
    assert mm.stats()["host_bytes_requested"] == before
    assert mm.live_device_states() == 0


@pytest.mark.parametrize("driver", DRIVERS)
def test_tied_embedding_moved_by_its_module_stays_where_it_puts_it(engine, device, driver, caplog):
    """Z-Image's encoder on a GPU: `embed_tokens` (moved whole by manager.py) and the managed `lm_head` share one
    Parameter, so `.to(device)` gives the Parameter new storage on the device. Emulated here on every engine by
    giving it a copy of its values. At its next call `lm_head` finds its weight held by that unmanaged module:
    it leaves the weight there and computes with it (the generic path, one INFO line), instead of packing it
    again and putting it back on the host under the embedding. Outputs stay bitwise the unmanaged model's, the
    block it had packed is freed, and the freed encoder returns every byte."""
    build, call = ENCODERS["qwen3-tied"]
    torch.manual_seed(0)
    base = build().to(torch.bfloat16).eval().requires_grad_(False)
    with torch.no_grad():
        expected = call(copy.deepcopy(base).to(device), device)
    gc.collect()
    before = mm.stats()["host_bytes_requested"]
    model = copy.deepcopy(base)
    manager = _driver(driver)
    manager.attach(model, device)
    manager.to_device(model, device)
    tied = model.model.embed_tokens.weight
    assert tied is model.lm_head.weight and hasattr(model.lm_head, "_layer_memory_manager")
    packed = model.lm_head._layer_memory_manager.packed_bytes
    assert packed > 0
    held = mm.stats()["host_bytes_requested"]
    mm._testing.reset_log_once()
    with caplog.at_level(logging.INFO, logger="layerstream"):
        # On a GPU the move of `embed_tokens` above gave the shared Parameter its device storage already, and
        # this first call finds it there; a move to the CPU keeps the storage, so after a first call streamed
        # as usual the move is emulated.
        with torch.no_grad():
            assert all(torch.equal(a, b) for a, b in zip(expected, call(model, device)))
        if tied.device.type == "cpu":
            tied.data = tied.data.clone()  # the storage a move gives it
        moved = tied.data_ptr()
        for _ in range(3):
            with torch.no_grad():
                got = call(model, device)
            assert all(torch.equal(a, b) for a, b in zip(expected, got))
            assert tied.data_ptr() == moved, "the shared weight was put back on the host under the embedding"
    assert model.lm_head._layer_memory_manager.path == "generic"
    lines = [r.getMessage() for r in caplog.records if "also the weight of" in r.getMessage()]
    assert len(lines) == 1 and "model.embed_tokens" in lines[0], lines
    gc.collect()
    assert mm.stats()["host_bytes_requested"] == held - packed
    if not manager.free(model):
        return
    del model, got, tied
    for key in list(mm._DEVICE_STATE):
        del mm._DEVICE_STATE[key]
    gc.collect()
    assert mm.stats()["host_bytes_requested"] == before


def _quantize_float8(driver, model):
    """What the model loaders do after attaching the text encoder when it is quantized (quantize_te) with layer
    offloading on: AI-Toolkit's own quantize(te, weights=get_qtype("float8")) where a checkout is given, else
    the torchao call it makes for that qtype."""
    if isinstance(driver, _RealManager):
        from layerstream.aitk import import_toolkit

        try:
            q = import_toolkit(driver.name, "toolkit.util.quantize")[0]
        except ImportError as exc:  # 323b4aaf imports UIntXWeightOnlyConfig, which torchao 0.18 no longer has
            pytest.skip(f"{driver.name}: its toolkit/util/quantize.py does not import here: {exc}")
        q.quantize(model, weights=q.get_qtype("float8"))
    else:
        quant = pytest.importorskip("torchao.quantization", reason="torchao is not installed")
        quant.quantize_(model, quant.Float8WeightOnlyConfig())


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("encoder", ["qwen2.5-vl-image", "mistral3", "umt5"])
def test_text_encoder_quantized_after_attach_streams_float8_bitwise(engine, device, encoder, driver):
    """Qwen-Image, FLUX.2 and Wan attach their text encoder, move it, then quantize it (torchao float8 when layer
    offloading is on): every managed Linear gets a new, quantized weight after attach. They leave the plain path
    for the quantized one (codes and scale streamed as stored) and compute bitwise what the unmanaged encoder,
    quantized the same way, computes with torchao's own forward."""
    pytest.importorskip("torchao.quantization", reason="torchao is not installed")
    build, call = ENCODERS[encoder]
    torch.manual_seed(0)
    base = build().to(torch.bfloat16).eval().requires_grad_(False)
    manager = _driver(driver)
    reference = copy.deepcopy(base)
    _quantize_float8(manager, reference)
    with torch.no_grad():
        expected = call(reference.to(device), device)
    del reference
    model = copy.deepcopy(base)
    manager.attach(model, device)
    manager.to_device(model, device)
    _quantize_float8(manager, model)
    ran = set()
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(lambda mod, args, name=name: ran.add(name))
    for _ in range(2):
        with torch.no_grad():
            got = call(model, device)
        for i, (a, b) in enumerate(zip(expected, got)):
            assert torch.equal(a, b), f"{encoder}: output {i} differs from the unmanaged quantized model's"
    # Each layer changes path at its first call after the quantization (the vision tower of a text-only call
    # keeps its path until it runs).
    assert ran
    paths = {name: m._layer_memory_manager.path for name, m in model.named_modules() if name in ran}
    assert set(paths.values()) == {"quantized"}, paths
