"""Random-initialised models in diffusers' on-disk format, for AI-Toolkit's own model classes to load by path
(`model.name_or_path` of a job): transformer(s), text encoder, tokenizer and VAE in one folder, as the hub
repositories lay them out. Nothing is downloaded: the configs are written here and the tokenizer is built with
the `tokenizers` library (a byte-level BPE for the Qwen encoders, a character Unigram for UMT5).

Two sizes of each part: ``tiny`` (a few layers at width 64, seconds on a CPU) and ``full`` (the real model's
layer shapes, for a GPU run: tens of GiB of random weights on disk). The VAE is always tiny (its compression and
latent channels are the real ones), so a full-shaped job measures the transformer and the text encoder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

ARCHES = ("zimage", "qwen_image", "wan22_14b", "flux2")
SIZES = ("tiny", "full")

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>", "<think>", "</think>"]
# Written here (not copied): the role/content layout the Qwen chat models use, which the pipelines render.
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TransformerShape:
    layers: int
    heads: int
    head_dim: int
    ffn: int


# The real models' transformer shapes (their published configs) and the tiny stand-ins.
TRANSFORMER_SHAPES = {
    ("zimage", "full"): TransformerShape(layers=30, heads=30, head_dim=128, ffn=0),
    ("zimage", "tiny"): TransformerShape(layers=2, heads=2, head_dim=32, ffn=0),
    ("qwen_image", "full"): TransformerShape(layers=60, heads=24, head_dim=128, ffn=0),
    ("qwen_image", "tiny"): TransformerShape(layers=2, heads=2, head_dim=32, ffn=0),
    ("wan22_14b", "full"): TransformerShape(layers=40, heads=40, head_dim=128, ffn=13824),
    ("wan22_14b", "tiny"): TransformerShape(layers=2, heads=2, head_dim=32, ffn=128),
}


@dataclass(frozen=True)
class EncoderShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int


# Qwen3-4B (Z-Image), Qwen2.5-VL-7B's language model (Qwen-Image), UMT5-XXL (Wan), Mistral Small 3.1's language
# model (FLUX.2).
ENCODER_SHAPES = {
    ("flux2", "full"): EncoderShape(hidden=5120, layers=40, heads=32, kv_heads=8, head_dim=128, ffn=32768),
    ("zimage", "full"): EncoderShape(hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128, ffn=9728),
    ("qwen_image", "full"): EncoderShape(hidden=3584, layers=28, heads=28, kv_heads=4, head_dim=128, ffn=18944),
    ("wan22_14b", "full"): EncoderShape(hidden=4096, layers=24, heads=64, kv_heads=64, head_dim=64, ffn=10240),
}
TINY_ENCODER = EncoderShape(hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, ffn=128)
# FLUX.2 reads the Mistral encoder's hidden states after layers 10, 20 and 30 (its pipeline's OUTPUT_LAYERS_MISTRAL)
# of a prompt padded to 512 tokens: the tiny one needs 30 layers, at half the width (half the time on a CPU).
TINY_ENCODER_FLUX2 = EncoderShape(hidden=32, layers=30, heads=1, kv_heads=1, head_dim=32, ffn=64)


def encoder_shape(arch: str, size: str) -> EncoderShape:
    if size == "tiny":
        return TINY_ENCODER_FLUX2 if arch == "flux2" else TINY_ENCODER
    return ENCODER_SHAPES[(arch, size)]


def rope_axes(head_dim: int) -> list[int]:
    """The (frame, height, width) split of a head's rotary dims: Z-Image's and Qwen-Image's 1:3:3 proportion
    (32/48/48 and 16/56/56 of 128), each even."""
    t = max(2, (head_dim // 4) // 2 * 2)
    h = (head_dim - t) // 2 // 2 * 2
    return [head_dim - 2 * h, h, h]


# ---------------------------------------------------------------------------------------------- tokenizers


def write_qwen_tokenizer(folder: Path, class_name: str) -> int:
    """A byte-level BPE over the 256 byte symbols with no merges (every byte one token) and the Qwen special
    tokens; returns the vocabulary size the text encoder needs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(QWEN_SPECIALS)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": class_name, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "unk_token": None, "model_max_length": 4096, "chat_template": QWEN_CHAT_TEMPLATE,
        "add_prefix_space": False, "errors": "replace",
    }, indent=1))
    return tok.get_vocab_size()


def write_t5_tokenizer(folder: Path) -> int:
    """A Unigram over printable ASCII with T5's pad/eos/unk ids (0, 1, 2) and `</s>` appended, as UMT5's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(chr(c), -3.0) for c in range(33, 127)] + [("\u2581" + chr(c), -2.5) for c in range(33, 127)]
    tok = Tokenizer(models.Unigram(pieces, unk_id=2))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                       special_tokens=[("</s>", 1)])
    tok.add_special_tokens(["<pad>", "</s>", "<unk>"])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "T5Tokenizer", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
        "extra_ids": 0, "model_max_length": 512,
    }, indent=1))
    return tok.get_vocab_size() + 100  # room for the <extra_id_N> tokens T5 tokenizers may add


# ---------------------------------------------------------------------------------------------- parts


def _save(model: torch.nn.Module, folder: Path, dtype: torch.dtype) -> None:
    model.to(dtype).save_pretrained(str(folder), safe_serialization=True, max_shard_size="5GB")


def _qwen_token_ids() -> dict:
    """bos/eos/pad as the tokenizer numbers them (the 256 byte tokens first, then QWEN_SPECIALS)."""
    end, im_end = 256 + QWEN_SPECIALS.index("<|endoftext|>"), 256 + QWEN_SPECIALS.index("<|im_end|>")
    return {"bos_token_id": end, "eos_token_id": im_end, "pad_token_id": end}


def _qwen3_encoder(shape: EncoderShape, vocab: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        max_position_embeddings=4096, tie_word_embeddings=True, **_qwen_token_ids()))


def _qwen25vl_encoder(shape: EncoderShape, vocab: int):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    half = shape.head_dim // 2
    section = [half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8]  # 16/24/24 of 64, as Qwen2.5-VL
    text = dict(vocab_size=vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
                num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                num_key_value_heads=shape.kv_heads, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "mrope_section": section, "rope_theta": 1e6})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=shape.hidden,
                  fullatt_block_indexes=[0], window_size=28)
    ids = {name: QWEN_SPECIALS.index(name) + 256 for name in ("<|image_pad|>", "<|video_pad|>",
                                                             "<|vision_start|>", "<|vision_end|>")}
    text.update(_qwen_token_ids())
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                              video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                              vision_end_token_id=ids["<|vision_end|>"])
    return Qwen2_5_VLForConditionalGeneration(config)


def _umt5_encoder(shape: EncoderShape, vocab: int):
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(
        vocab_size=vocab, d_model=shape.hidden, d_kv=shape.head_dim, d_ff=shape.ffn, num_layers=shape.layers,
        num_heads=shape.heads, feed_forward_proj="gated-gelu", is_encoder_decoder=False))


def _flux_vae():
    """Z-Image's VAE: FLUX's AutoencoderKL layout (8x, 16 latent channels, its scaling and shift) at width 8-16."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(8, 16, 16, 16), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=8,
        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)


def _wan_vae(cls_name: str):
    """Wan's and Qwen-Image's causal 3D VAE (8x spatial, 4x temporal, 16 latent channels) at base width 8."""
    import diffusers

    return getattr(diffusers, cls_name)(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1)


def _zimage_transformer(shape: TransformerShape, text_hidden: int):
    from diffusers import ZImageTransformer2DModel

    dim = shape.heads * shape.head_dim
    return ZImageTransformer2DModel(
        in_channels=16, dim=dim, n_layers=shape.layers, n_refiner_layers=2 if shape.layers > 2 else 1,
        n_heads=shape.heads, n_kv_heads=shape.heads, cap_feat_dim=text_hidden, axes_dims=rope_axes(shape.head_dim))


def _qwen_image_transformer(shape: TransformerShape, text_hidden: int):
    from diffusers import QwenImageTransformer2DModel

    return QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=shape.layers, attention_head_dim=shape.head_dim,
        num_attention_heads=shape.heads, joint_attention_dim=text_hidden,
        axes_dims_rope=tuple(rope_axes(shape.head_dim)))


def _wan_transformer(shape: TransformerShape, text_hidden: int):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=shape.heads, attention_head_dim=shape.head_dim, in_channels=16,
        out_channels=16, text_dim=text_hidden, freq_dim=256, ffn_dim=shape.ffn, num_layers=shape.layers,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)


def build_model(arch: str, folder: Path, size: str = "tiny", te_size: str = "tiny", layers: int | None = None,
                seed: int = 0, dtype: torch.dtype = torch.bfloat16, aitk_dir: str | None = None) -> Path:
    """Writes the model folder for ``arch`` (see ARCHES) and returns it. ``layers`` overrides the transformer's
    block count (a full-width model with few blocks). The same seed gives the same bytes. ``aitk_dir``: the
    AI-Toolkit checkout, for FLUX.2 (its transformer and VAE are AI-Toolkit's own modules, aitk_flux2.py)."""
    if arch == "flux2":
        from .aitk_flux2 import build_flux2

        return build_flux2(folder, size, te_size, layers, seed, dtype, aitk_dir)
    if arch not in ARCHES:
        raise ValueError(f"unknown arch {arch!r}: choose from {', '.join(ARCHES)}")
    if size not in SIZES or te_size not in SIZES:
        raise ValueError(f"sizes are {', '.join(SIZES)}, not {size!r}/{te_size!r}")
    shape = TRANSFORMER_SHAPES[(arch, size)]
    if layers is not None:
        shape = TransformerShape(layers=layers, heads=shape.heads, head_dim=shape.head_dim, ffn=shape.ffn)
    enc = encoder_shape(arch, te_size)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    if size == "full" or te_size == "full":
        torch.set_default_dtype(dtype)  # tens of GiB: never hold them in float32
    try:
        if arch == "wan22_14b":
            vocab = write_t5_tokenizer(folder / "tokenizer")
            _save(_umt5_encoder(enc, vocab), folder / "text_encoder", dtype)
            for name in ("transformer", "transformer_2"):  # Wan 2.2's high-noise and low-noise experts
                _save(_wan_transformer(shape, enc.hidden), folder / name, dtype)
            _save(_wan_vae("AutoencoderKLWan"), folder / "vae", dtype)
        else:
            tok_class = "Qwen2Tokenizer"
            vocab = write_qwen_tokenizer(folder / "tokenizer", tok_class)
            if arch == "zimage":
                _save(_qwen3_encoder(enc, vocab), folder / "text_encoder", dtype)
                _save(_zimage_transformer(shape, enc.hidden), folder / "transformer", dtype)
                _save(_flux_vae(), folder / "vae", dtype)
            else:
                _save(_qwen25vl_encoder(enc, vocab), folder / "text_encoder", dtype)
                _save(_qwen_image_transformer(shape, enc.hidden), folder / "transformer", dtype)
                _save(_wan_vae("AutoencoderKLQwenImage"), folder / "vae", dtype)
    finally:
        torch.set_default_dtype(previous)
    (folder / "layerstream_model.json").write_text(json.dumps(
        {"arch": arch, "size": size, "te_size": te_size, "layers": shape.layers, "seed": seed,
         "hub_repos": HUB_REPOS.get(arch, {})}) + "\n")
    return folder


# Parts a model class loads from a fixed hub repository whatever the job's path says: served from a local hub
# cache (seed_hub_cache) with the folder's own part, as HF_HUB_OFFLINE=1 resolves a repo id from the cache.
HUB_REPOS = {
    "wan22_14b": {"ai-toolkit/wan2.1-vae": "vae"},  # Wan2214bModel._wan_vae_path
    # Flux2Model.load_te: MISTRAL_PATH, the encoder and its processor from one repository
    "flux2": {"mistralai/Mistral-Small-3.1-24B-Instruct-2503": "text_encoder"},
}


def seed_hub_cache(cache: Path, model_folder: Path) -> Path:
    """Lays the model folder's parts that its class fetches by repo id (HUB_REPOS) into a hub cache at
    ``cache`` (the layout huggingface_hub reads with HF_HUB_CACHE and HF_HUB_OFFLINE=1); returns ``cache``."""
    import shutil

    info = json.loads((Path(model_folder) / "layerstream_model.json").read_text())
    for repo, part in info.get("hub_repos", {}).items():
        entry = Path(cache) / ("models--" + repo.replace("/", "--"))
        revision = "0" * 40
        snapshot = entry / "snapshots" / revision
        if not snapshot.is_dir():
            shutil.copytree(Path(model_folder) / part, snapshot)
            (entry / "refs").mkdir(parents=True, exist_ok=True)
            (entry / "refs" / "main").write_text(revision)
    return Path(cache)
