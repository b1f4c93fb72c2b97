"""`layerstream install` / `uninstall`: put layerstream's manager_modules in front of AI-Toolkit's own.

Two modes, both reversible:
  patch  writes the one file of patches/ai-toolkit.patch, toolkit/memory_management/manager_modules/__init__.py:
         a package Python imports before the stock manager_modules.py; it loads layerstream (or, with
         LAYERSTREAM=0 or when layerstream cannot load, the stock file). No AI-Toolkit line changes.
  copy   copies the built extension into toolkit/memory_management/; Python loads an extension module
         before a .py of the same name.
Every file install writes is recorded, with its sha256, in toolkit/memory_management/layerstream-install.json;
uninstall removes exactly those files, and only while they are byte-identical to what was written.
Failures raise InstallError with what went wrong and what to do; the CLI prints them without a traceback.
"""

from __future__ import annotations

import difflib
import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from .aitk import KNOWN_VERSIONS, manager_version
from .shell import checkout_arg, command

MM_DIR = Path("toolkit") / "memory_management"
HOOK_DIR = MM_DIR / "manager_modules"
HOOK = HOOK_DIR / "__init__.py"
MANIFEST = MM_DIR / "layerstream-install.json"
# Hooks that earlier layerstream versions wrote: recognised without a manifest, and reported by `status` as
# outdated (reinstall to get the current one).
LEGACY_HOOKS = {"da0d4ba72f1b135988fcd0c7193083e7df1d510d449e25def5f40de9eca464d9",
                "0d19d373ad7dc59f9a18b888580dd102d6924d2bfc8288d9e383d7294bae9de4"}
_WINDOWS = os.name == "nt"


class InstallError(Exception):
    """A failure the user can act on; the message says what to do."""


@dataclass
class Checkout:
    root: Path
    version: str | None  # a KNOWN_VERSIONS name, or None

    @property
    def mm_dir(self) -> Path:
        return self.root / MM_DIR


@dataclass
class Manifest:
    """What one install wrote: paths relative to the checkout, each with the sha256 of the bytes written."""

    mode: str
    files: dict[str, str]
    created_dirs: list[str] = field(default_factory=list)  # removed when empty, deepest first

    def save(self, root: Path) -> None:
        text = json.dumps({"layerstream": 1, "mode": self.mode, "files": self.files,
                           "created_dirs": self.created_dirs}, indent=1)
        _write(root / MANIFEST, (text + "\n").encode())

    @classmethod
    def load(cls, root: Path) -> Manifest | None:
        path = root / MANIFEST
        if path.is_file():
            try:
                data = json.loads(path.read_text())
                return cls(data["mode"], dict(data["files"]), list(data.get("created_dirs", [])))
            except (ValueError, KeyError, TypeError) as exc:
                raise InstallError(f"{path} is damaged ({exc}); remove layerstream's files by hand "
                                   f"({HOOK} or the copied manager_modules extension), then delete it") from exc
        hook = root / HOOK
        if hook.is_file() and _sha256(hook.read_bytes()) in LEGACY_HOOKS | {_sha256(hook_text().encode())}:
            return cls("patch", {str(HOOK.as_posix()): _sha256(hook.read_bytes())}, [HOOK_DIR.as_posix()])
        return None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_of(path: Path) -> str:
    return _sha256(path.read_bytes())


def patch_text() -> str:
    return resources.files("layerstream").joinpath("data", "ai-toolkit.patch").read_text()


def hook_text() -> str:
    """The one file patches/ai-toolkit.patch adds, from the patch's added lines."""
    lines = [line[1:] for line in patch_text().splitlines() if line.startswith("+") and not line.startswith("+++")]
    return "\n".join(lines) + "\n"


def _os_failure(exc: OSError, path: Path, removing: bool = False) -> InstallError:
    """An OSError on a checkout file as an InstallError that says what to do."""
    if removing and _WINDOWS and path.suffix == ".pyd" and isinstance(exc, (PermissionError, OSError)):
        return InstallError(f"{path} is in use ({exc.strerror or exc}): close AI-Toolkit first (every Python "
                            "process that loaded it), then run the command again")
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return InstallError(f"cannot {'remove' if removing else 'write'} {path}: {exc.strerror}. Make the "
                            "checkout writable for this user (e.g. `chmod -R u+w toolkit/memory_management`), "
                            "or run the command as its owner")
    return InstallError(f"cannot {'remove' if removing else 'write'} {path}: {exc.strerror or exc}")


def _write(path: Path, data: bytes) -> None:
    try:
        with open(path, "xb" if path.name != MANIFEST.name else "wb") as f:
            f.write(data)
    except OSError as exc:
        raise _os_failure(exc, path) from exc


def _git(root: Path, *args: str) -> subprocess.CompletedProcess | None:
    if shutil.which("git") is None:
        return None
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)


def inspect(path: str | Path) -> Checkout:
    root = Path(path).expanduser().resolve()
    manager = root / MM_DIR / "manager.py"
    if not manager.is_file():
        raise InstallError(f"{root} is not an AI-Toolkit checkout: {MM_DIR / 'manager.py'} is missing. "
                           "Give the folder that contains toolkit/ (the root of your ai-toolkit clone).")
    return Checkout(root, manager_version(root / MM_DIR))


def installed_mode(checkout: Checkout) -> str | None:
    """'patch', 'copy', or None (stock)."""
    manifest = Manifest.load(checkout.root)
    return manifest.mode if manifest else None


def _copied_extensions(checkout: Checkout) -> list[Path]:
    return sorted(p for pattern in ("manager_modules*.so", "manager_modules*.pyd") for p in checkout.mm_dir.glob(pattern))


def _local_changes(checkout: Checkout) -> str:
    """`git status` of toolkit/memory_management, "" outside git (also when the checkout sits inside another
    repository: the path filter keeps it to this folder)."""
    result = _git(checkout.root, "status", "--porcelain", "--", str(MM_DIR))
    return result.stdout.strip() if result is not None and result.returncode == 0 else ""


def _in_git(checkout: Checkout) -> bool:
    result = _git(checkout.root, "rev-parse", "--is-inside-work-tree")
    return result is not None and result.returncode == 0


def _native_extension() -> Path:
    try:
        import torch  # noqa: F401  (first: on Windows it puts torch's DLLs on the search path)
        from layerstream import manager_modules
    except ImportError as exc:
        raise InstallError(f"layerstream's extension cannot be loaded in this Python: {exc}. Build it in "
                           "AI-Toolkit's environment (docs/install.md)") from exc
    return Path(manager_modules.__file__)


def _refuse_foreign_files(checkout: Checkout) -> None:
    """Files layerstream would write, or that would shadow what it writes, that are not layerstream's."""
    hook_dir = checkout.root / HOOK_DIR
    if hook_dir.is_dir():
        foreign = sorted(p.name for p in hook_dir.iterdir() if p.name != "__pycache__")
        if foreign:
            raise InstallError(f"{hook_dir} exists and was not written by layerstream (it holds "
                               f"{', '.join(foreign[:5])}): move it out of the way, then install again")
    elif hook_dir.exists():
        raise InstallError(f"{hook_dir} exists and is not a folder: move it out of the way, then install again")
    copies = _copied_extensions(checkout)
    if copies:
        raise InstallError(f"{copies[0]} exists and was not installed by layerstream (no {MANIFEST.name}): "
                           f"delete it if it is an old copy of layerstream's extension, then install again")


PROBE = r"""
import importlib.util, os, sys
mm_dir = sys.argv[1]
spec = importlib.util.spec_from_file_location("_layerstream_probe", os.path.join(mm_dir, "__init__.py"),
                                              submodule_search_locations=[mm_dir])
package = importlib.util.module_from_spec(spec)
sys.modules["_layerstream_probe"] = package
spec.loader.exec_module(package)
module = sys.modules["_layerstream_probe.manager_modules"]
print("LOADED", module.__name__, getattr(module, "__file__", ""))
"""


@dataclass
class Probe:
    """What a fresh interpreter found when it imported the checkout's toolkit.memory_management."""

    layerstream: bool  # layerstream's module is what `from .manager_modules import ...` finds
    detail: str  # the module's file, or why it did not load


def probe(checkout: Checkout, env: dict[str, str] | None = None, python: str | None = None) -> Probe:
    """Imports the checkout's toolkit.memory_management in a fresh interpreter (this Python, or `python`) as
    AI-Toolkit does, without AI-Toolkit's other packages; bytecode is not written into the checkout."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **(env or {})}
    try:
        result = subprocess.run([python or sys.executable, "-c", PROBE, str(checkout.mm_dir)], capture_output=True,
                                text=True, env=env, cwd=checkout.root)
    except OSError as exc:
        return Probe(False, f"{python or sys.executable} does not run: {exc.strerror or exc}")
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if line.startswith("LOADED "))
    warning = next((line.strip() for line in result.stderr.splitlines() if "layerstream could not be loaded" in line), "")
    if result.returncode != 0 or "LOADED" not in lines:
        return Probe(False, warning or (result.stderr.strip().splitlines() or ["no output"])[-1])
    name, _, file = lines["LOADED"].partition(" ")
    native = name == "layerstream.manager_modules" or file.endswith((".so", ".pyd"))
    return Probe(native, file or name if native else (warning or f"it loads {file or name}"))


def _verify(checkout: Checkout) -> None:
    found = probe(checkout, {"LAYERSTREAM": "1"})
    if not found.layerstream:
        raise InstallError(f"installed, but toolkit.memory_management does not load layerstream in this Python "
                           f"({found.detail}); the installation was undone. Run `layerstream doctor`")


def next_steps(root: Path) -> str:
    where = checkout_arg(root)
    return (f"Next: set `layer_offloading: true` under `model:` in your job config (UI: Model -> Layer Offloading), "
            f"start training, and look for `layerstream manager_modules active` in the log. The defaults are the "
            f"fast settings; settings go into {root / '.env'}, e.g. the least VRAM: "
            f"`{command('layerstream', 'set', 'LAYERSTREAM_VRAM_BUDGET=min', *where)}`; "
            f"`{command('layerstream', 'status', *where)}` checks them.")


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
                           f"run `{command('layerstream', 'uninstall', *checkout_arg(checkout.root))}` first")
    changes = _local_changes(checkout)
    if changes and not force:
        raise InstallError(f"{MM_DIR} has local changes ({'; '.join(changes.splitlines()[:3])}): "
                           "commit or stash them, or pass --force")
    extension = _native_extension()  # refuse before touching anything when it cannot load here
    _refuse_foreign_files(checkout)

    if mode == "copy":
        files = {(MM_DIR / extension.name).as_posix(): extension.read_bytes()}
        created = []
    else:
        files = {HOOK.as_posix(): hook_text().encode()}
        created = [] if (checkout.root / HOOK_DIR).is_dir() else [HOOK_DIR.as_posix()]
    manifest = Manifest(mode, {rel: _sha256(data) for rel, data in files.items()}, created)
    try:
        manifest.save(checkout.root)
        for rel in created:
            try:
                (checkout.root / rel).mkdir()
            except OSError as exc:
                raise _os_failure(exc, checkout.root / rel) from exc
        for rel, data in files.items():
            _write(checkout.root / rel, data)
        _verify(checkout)
    except BaseException as exc:  # an error, an OSError, Ctrl-C: nothing of the install may stay
        _undo(checkout, manifest, exc)
        raise
    if mode == "copy":
        switch = "LAYERSTREAM=0 has no effect in copy mode (uninstall to run stock)"
    else:
        switch = "LAYERSTREAM=0 runs AI-Toolkit's stock manager_modules.py"
    return (f"installed layerstream in {checkout.root} ({mode} mode; AI-Toolkit "
            f"{checkout.version or 'of an unknown version'}); the hook loads in this Python. {switch}.\n"
            + next_steps(checkout.root))


def _undo(checkout: Checkout, manifest: Manifest, cause: BaseException) -> None:
    """Removes what an install that stopped (`cause`) wrote; when that fails too, raises an InstallError that
    names what is left and how to finish. A Ctrl-C undone becomes an InstallError that says so."""
    try:
        left = _remove(checkout, manifest)
    except BaseException as failure:
        remaining = [rel for rel in [*manifest.files, MANIFEST.as_posix()] if (checkout.root / rel).exists()]
        why = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
        raise InstallError(
            f"install stopped ({why}) and could not undo itself ({failure}); left in "
            f"{checkout.root}: {', '.join(remaining) or 'nothing'}. Finish with "
            f"`{command('layerstream', 'uninstall', *checkout_arg(checkout.root))}`") from cause
    if isinstance(cause, KeyboardInterrupt):
        note = f"; left in place: {'; '.join(left)}" if left else ""
        raise InstallError(f"interrupted; the installation was undone, {checkout.root} is as it was{note}") from cause


def _diff(rel: str, written: bytes | None, now: bytes) -> str:
    if written is None:
        return f"{rel}: sha256 {_sha256(now)}, not the one layerstream wrote"
    try:
        return "".join(difflib.unified_diff(written.decode().splitlines(True), now.decode().splitlines(True),
                                            f"{rel} (as installed)", f"{rel} (now)"))
    except UnicodeDecodeError:
        return f"{rel}: a binary file that changed since layerstream wrote it"


def _remove(checkout: Checkout, manifest: Manifest) -> list[str]:
    """Deletes the manifest's files (and the bytecode Python made of them), then the folders install created
    when they are empty, then the manifest. Returns what was left in place."""
    left = []
    for rel in manifest.files:
        path = checkout.root / rel
        for stale in [path, *path.parent.glob(f"__pycache__/{path.stem}.*.pyc")] if path.suffix == ".py" else [path]:
            try:
                stale.unlink(missing_ok=True)
            except OSError as exc:
                raise _os_failure(exc, stale, removing=True) from exc
        cache = path.parent / "__pycache__"
        if cache.is_dir() and not any(cache.iterdir()):
            cache.rmdir()
    for rel in sorted(manifest.created_dirs, key=len, reverse=True):
        folder = checkout.root / rel
        if folder.is_dir():
            if any(folder.iterdir()):
                left.append(f"{rel}/ (holds files layerstream did not write: {', '.join(sorted(p.name for p in folder.iterdir())[:5])})")
            else:
                folder.rmdir()
    try:
        (checkout.root / MANIFEST).unlink(missing_ok=True)
    except OSError as exc:
        raise _os_failure(exc, checkout.root / MANIFEST, removing=True) from exc
    return left


def uninstall(path: str | Path) -> str:
    checkout = inspect(path)
    manifest = Manifest.load(checkout.root)
    if manifest is None:
        note = ""
        if (checkout.root / HOOK_DIR).exists() or _copied_extensions(checkout):
            note = (f" ({HOOK_DIR}/ or a manager_modules extension is there, but layerstream did not write it "
                    "or it was changed since; it was left alone)")
        return f"layerstream is not installed in {checkout.root}; nothing to do{note}"
    changed = []
    for rel, digest in manifest.files.items():
        file = checkout.root / rel
        if file.is_file() and _sha256(now := file.read_bytes()) != digest:
            written = hook_text().encode() if rel == HOOK.as_posix() and _sha256(hook_text().encode()) == digest else None
            changed.append(_diff(rel, written, now))
    if changed:
        raise InstallError(
            f"{len(changed)} file(s) layerstream installed in {checkout.root} changed since; nothing was removed. "
            "Restore or delete them yourself, then run uninstall again:\n" + "\n".join(changed))
    left = _remove(checkout, manifest)
    report = f"removed layerstream ({manifest.mode} mode) from {checkout.root}: {', '.join(manifest.files)}"
    if left:
        report += "\nleft in place: " + "; ".join(left)
    if _in_git(checkout):
        status = _local_changes(checkout)
        report += " (git status: clean)" if not status else f"\ngit status still shows:\n{status}"
    return report
