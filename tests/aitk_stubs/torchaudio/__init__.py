"""Stand-in for torchaudio in the AI-Toolkit job runs (tests/aitk_stubs/README.md says why). AI-Toolkit imports
torchaudio at module level (toolkit/config_modules.py, on run.py's import chain) but only calls it for audio
datasets and audio models; the jobs here use neither. Any use raises, naming this stub."""

__version__ = "0.0.0+layerstream-stub"


def __getattr__(name):
    raise ImportError(
        f"torchaudio.{name}: this is layerstream's test stub (tests/aitk_stubs), not torchaudio. The index has no "
        "torchaudio build for torch 2.13 that imports on a CPU; the AI-Toolkit jobs of the tests use no audio.")
