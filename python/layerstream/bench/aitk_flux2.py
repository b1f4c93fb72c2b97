"""FLUX.2 (AI-Toolkit's `arch: flux2`, `Flux2Model`) in the job harness's on-disk form.

AI-Toolkit builds FLUX.2's transformer and VAE from fixed sizes (`Flux2Params()`, `AutoEncoderParams()` in its
extension) and loads their weights from `flux2-dev.safetensors` and `ae.safetensors` in the model folder; it loads
the Mistral 3 text encoder and its processor from a fixed hub repository (`MISTRAL_PATH`). So the folder written
here holds those two files, made with AI-Toolkit's own modules (its `src/model.py` and `src/autoencoder.py`,
loaded from the checkout, not copied) at the sizes in `flux2_params.json`, and a `text_encoder` folder (Mistral 3
with a Pixtral processor) that the harness serves for that repository id from a local hub cache. The job's
`run.py` reads `flux2_params.json` through the harness's sitecustomize (AITK_JOB_FLUX2_PARAMS), which gives the
model class those sizes instead of its fixed ones; at `full` size they are FLUX.2's own (32B: 8 double-stream
and 48 single-stream blocks at 6144).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch

# FLUX.2 [dev]'s transformer (AI-Toolkit's Flux2Params); context_in_dim is three of the encoder's hidden states.
FULL_TRANSFORMER = dict(in_channels=128, hidden_size=6144, num_heads=48, depth=8, depth_single_blocks=48,
                        axes_dim=[32, 32, 32, 32], theta=2000, mlp_ratio=3.0, use_guidance_embed=True)
TINY_TRANSFORMER = dict(FULL_TRANSFORMER, hidden_size=64, num_heads=2, depth=1, depth_single_blocks=1,
                        axes_dim=[8, 8, 8, 8])
# FLUX.2's VAE keeps its 8x compression and 32 latent channels (the transformer's 128 inputs are 2x2 of them);
# the width is tiny (GroupNorm's 32 groups need 32 channels).
TINY_VAE = dict(resolution=256, in_channels=3, ch=32, out_ch=3, ch_mult=[1, 1, 1, 1], num_res_blocks=1,
                z_channels=32)
MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                    "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
# Written here (not copied): system and user turns, each a list of text parts, as FLUX.2's pipeline sends them.
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% set text = m['content'] if m['content'] is string else m['content'] | map(attribute='text') | join('') %}"
    "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif m['role'] == 'user' %}[INST]{{ text }}[/INST]"
    "{% else %}{{ text }}{{ eos_token }}{% endif %}{% endfor %}"
)


def split_blocks(layers: int) -> tuple[int, int]:
    """``layers`` blocks in FLUX.2's proportion of double-stream to single-stream blocks (8 to 48): 56 is the real
    model, 28 is 4 and 24."""
    if layers < 2:
        raise ValueError(f"--layers {layers}: FLUX.2 needs at least 2 blocks (one double-stream, one single-stream)")
    double = max(1, round(layers / 7))
    return double, layers - double


def transformer_params(size: str, layers: int | None, text_hidden: int) -> dict:
    params = dict(FULL_TRANSFORMER if size == "full" else TINY_TRANSFORMER, context_in_dim=3 * text_hidden)
    if layers is not None:
        params["depth"], params["depth_single_blocks"] = split_blocks(layers)
    return params


def _aitk_module(aitk_dir: str, relative: str):
    """One of the FLUX.2 extension's own source files (they import only torch and einops), loaded by path."""
    path = Path(aitk_dir) / "extensions_built_in" / "diffusion_models" / "flux2" / "src" / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: FLUX.2 needs an AI-Toolkit checkout that has it (27a03a91 or later)")
    name = f"_layerstream_aitk_flux2_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _save_file(module: torch.nn.Module, path: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    save_file({k: v.to(dtype).contiguous() for k, v in module.state_dict().items()}, str(path))


def write_mistral_processor(folder: Path) -> dict:
    """A byte-level BPE without merges and Mistral's special tokens, with a Pixtral processor around it (what
    `AutoProcessor.from_pretrained(MISTRAL_PATH)` gives FLUX.2); returns the token ids the encoder's config needs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(MISTRAL_SPECIALS)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "pad_token": "<pad>", "model_max_length": 131072, "padding_side": "left"}, indent=1))
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "PixtralImageProcessor", "patch_size": 16, "size": {"longest_edge": 256},
        "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "rescale_factor": 1 / 255}, indent=1))
    (folder / "processor_config.json").write_text(json.dumps({
        "processor_class": "PixtralProcessor", "patch_size": 16, "spatial_merge_size": 2, "image_token": "[IMG]",
        "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}, indent=1))
    (folder / "chat_template.jinja").write_text(MISTRAL_CHAT_TEMPLATE)
    ids = {name: tok.token_to_id(name) for name in MISTRAL_SPECIALS}
    return {"vocab_size": tok.get_vocab_size(), "bos_token_id": ids["<s>"], "eos_token_id": ids["</s>"],
            "pad_token_id": ids["<pad>"], "image_token_index": ids["[IMG]"]}


def mistral3_encoder(shape, ids: dict):
    """Mistral 3 (Mistral Small 3.1's class) with the given language-model shape and a one-layer vision tower."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    text = dict(model_type="mistral", vocab_size=ids["vocab_size"], hidden_size=shape.hidden,
                intermediate_size=shape.ffn, num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, max_position_embeddings=4096,
                bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"])
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, head_dim=16, patch_size=16, image_size=256)
    config = Mistral3Config(text_config=text, vision_config=vision, image_token_index=ids["image_token_index"],
                            spatial_merge_size=2, multimodal_projector_bias=False)
    return Mistral3ForConditionalGeneration(config)


def build_flux2(folder: Path, size: str, te_size: str, layers: int | None, seed: int, dtype: torch.dtype,
                aitk_dir: str | None) -> Path:
    from .aitk_models import HUB_REPOS, encoder_shape

    if not aitk_dir:
        raise ValueError("FLUX.2's model folder is built with AI-Toolkit's own modules: pass the checkout (aitk_dir)")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    enc = encoder_shape("flux2", te_size)
    params = {"transformer": transformer_params(size, layers, enc.hidden), "vae": TINY_VAE}
    model_src, vae_src = _aitk_module(aitk_dir, "model.py"), _aitk_module(aitk_dir, "autoencoder.py")
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    if size == "full" or te_size == "full":
        torch.set_default_dtype(dtype)  # tens of GiB: never hold them in float32
    try:
        ids = write_mistral_processor(folder / "text_encoder")
        mistral3_encoder(enc, ids).to(dtype).save_pretrained(str(folder / "text_encoder"), safe_serialization=True,
                                                             max_shard_size="5GB")
        _save_file(model_src.Flux2(model_src.Flux2Params(**params["transformer"])), folder / "flux2-dev.safetensors",
                   dtype)
        _save_file(vae_src.AutoEncoder(vae_src.AutoEncoderParams(**params["vae"])), folder / "ae.safetensors", dtype)
    finally:
        torch.set_default_dtype(previous)
    (folder / "flux2_params.json").write_text(json.dumps(params, indent=1) + "\n")
    (folder / "layerstream_model.json").write_text(json.dumps(
        {"arch": "flux2", "size": size, "te_size": te_size, "layers": layers, "seed": seed,
         "hub_repos": HUB_REPOS["flux2"]}) + "\n")
    return folder
