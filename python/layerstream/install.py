"""`layerstream install` / `uninstall`: put layerstream's manager_modules in front of AI-Toolkit's own.

Two modes, both reversible:
  patch  applies patches/ai-toolkit.patch: it adds one new package, toolkit/memory_management/
         manager_modules/, which Python imports before the stock manager_modules.py; it loads layerstream
         (or, with LAYERSTREAM=0 or when layerstream cannot load, the stock file). No AI-Toolkit line changes.
  copy   copies the built extension into toolkit/memory_management/; Python loads an extension module
         before a .py of the same name.
Failures raise InstallError with what went wrong and what to do; the CLI prints them without a traceback.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

MM_DIR = Path("toolkit") / "memory_management"
HOOK_DIR = MM_DIR / "manager_modules"
# sha256 of toolkit/memory_management/manager.py in the AI-Toolkit versions layerstream is tested with.
KNOWN_VERSIONS = {
    "d7e3ed5cc2a4e0630bb66f0ab3d75d8068a56abf65b18b203a72055d7731e75e": "27a03a91 (2026-08)",
    "93a8eafa942f7e47c31b02e88b91ec310fdafd4333ca737a74b1fda3e55c2839": "323b4aaf (2025-11)",
}


class InstallError(Exception):
    """A failure the user can act on; the message says what to do."""


@dataclass
class Checkout:
    root: Path
    version: str | None  # a KNOWN_VERSIONS name, or None
    is_git: bool

    @property
    def mm_dir(self) -> Path:
        return self.root / MM_DIR


def patch_text() -> str:
    return resources.files("layerstream").joinpath("data", "ai-toolkit.patch").read_text()


def _git(root: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
    except FileNotFoundError as exc:
        raise InstallError("git is not installed; install git, or use --mode copy") from exc
    if check and result.returncode != 0:
        raise InstallError(f"`git {' '.join(args)}` failed in {root}: {result.stderr.strip() or result.stdout.strip()}")
    return result


def inspect(path: str | Path) -> Checkout:
    root = Path(path).expanduser().resolve()
    manager = root / MM_DIR / "manager.py"
    if not manager.is_file():
        raise InstallError(f"{root} is not an AI-Toolkit checkout: {MM_DIR / 'manager.py'} is missing. "
                           "Give the folder that contains toolkit/ (the root of your ai-toolkit clone).")
    version = KNOWN_VERSIONS.get(hashlib.sha256(manager.read_bytes()).hexdigest())
    is_git = shutil.which("git") is not None and _git(root, "rev-parse", "--is-inside-work-tree", check=False).returncode == 0
    return Checkout(root, version, is_git)


def installed_mode(checkout: Checkout) -> str | None:
    """'patch', 'copy', or None (stock)."""
    if (checkout.root / HOOK_DIR / "__init__.py").exists():
        return "patch"
    if _copied_extensions(checkout):
        return "copy"
    return None


def _copied_extensions(checkout: Checkout) -> list[Path]:
    return sorted(p for pattern in ("manager_modules*.so", "manager_modules*.pyd") for p in checkout.mm_dir.glob(pattern))


def _local_changes(checkout: Checkout) -> str:
    if not checkout.is_git:
        return ""
    return _git(checkout.root, "status", "--porcelain", "--", str(MM_DIR)).stdout.strip()


def _native_extension() -> Path:
    try:
        from layerstream import manager_modules
    except ImportError as exc:
        raise InstallError(f"layerstream's extension cannot be loaded in this Python: {exc}") from exc
    return Path(manager_modules.__file__)


def install(path: str | Path, mode: str = "patch", force: bool = False) -> str:
    if mode not in ("patch", "copy"):
        raise InstallError(f"unknown mode {mode!r}: use --mode patch or --mode copy")
    checkout = inspect(path)
    if checkout.version is None and not force:
        raise InstallError(
            f"unknown AI-Toolkit version at {checkout.root} (its manager.py matches none layerstream was tested "
            f"with: {', '.join(KNOWN_VERSIONS.values())}). Update AI-Toolkit, or pass --force to install anyway.")
    current = installed_mode(checkout)
    if current is not None:
        raise InstallError(f"layerstream is already installed in {checkout.root} ({current} mode); "
                           f"run `layerstream uninstall {checkout.root}` first")
    changes = _local_changes(checkout)
    if changes and not force:
        raise InstallError(f"{MM_DIR} has local changes:\n{changes}\nCommit or stash them, or pass --force.")
    extension = _native_extension()  # refuse before touching anything when it cannot load here

    if mode == "copy":
        shutil.copy2(extension, checkout.mm_dir / extension.name)
    elif checkout.is_git:
        with tempfile.TemporaryDirectory() as tmp:
            patch = Path(tmp) / "ai-toolkit.patch"
            patch.write_text(patch_text())
            check = _git(checkout.root, "apply", "--check", str(patch), check=False)
            if check.returncode != 0:
                raise InstallError(f"patches/ai-toolkit.patch does not apply to {checkout.root}: {check.stderr.strip()}")
            _git(checkout.root, "apply", str(patch))
    else:
        _write_hook_without_git(checkout)
    return (f"installed layerstream in {checkout.root} ({mode} mode; AI-Toolkit "
            f"{checkout.version or 'of an unknown version'}); LAYERSTREAM=0 runs stock")


def _write_hook_without_git(checkout: Checkout) -> None:
    """The patch only adds one file: outside git, write that file from the patch's added lines."""
    lines = [line[1:] for line in patch_text().splitlines() if line.startswith("+") and not line.startswith("+++")]
    target = checkout.root / HOOK_DIR
    target.mkdir()
    (target / "__init__.py").write_text("\n".join(lines) + "\n")


def uninstall(path: str | Path) -> str:
    checkout = inspect(path)
    mode = installed_mode(checkout)
    if mode is None:
        return f"layerstream is not installed in {checkout.root}; nothing to do"
    if mode == "copy":
        for extension in _copied_extensions(checkout):
            extension.unlink()
    else:
        shutil.rmtree(checkout.root / HOOK_DIR)  # the patch's one file, and its __pycache__
    left = _local_changes(checkout)
    note = "" if not checkout.is_git else (" (git status: clean)" if not left else f" (git status still shows:\n{left})")
    return f"removed layerstream ({mode} mode) from {checkout.root}{note}"
