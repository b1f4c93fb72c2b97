"""Load AI-Toolkit's own ``toolkit.memory_management`` package from a checkout, on either engine.

Used by the tests and benchmarks that drive AI-Toolkit's real ``manager.py`` (never a copy of it): the
checkout's ``manager.py`` and ``__init__.py`` run unchanged, and only ``manager_modules`` is chosen:
``engine="layerstream"`` puts layerstream's compiled module in its place, ``engine="stock"`` loads the
checkout's own Python file. Each engine gets its own package name, so both can live in one process.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

# sha256 of toolkit/memory_management/manager.py in the AI-Toolkit versions layerstream is tested with.
KNOWN_VERSIONS = {
    "d7e3ed5cc2a4e0630bb66f0ab3d75d8068a56abf65b18b203a72055d7731e75e": "27a03a91 (2026-08)",
    "93a8eafa942f7e47c31b02e88b91ec310fdafd4333ca737a74b1fda3e55c2839": "323b4aaf (2025-11)",
}


def manager_version(mm_dir: str | os.PathLike) -> str | None:
    """The KNOWN_VERSIONS name of the checkout's manager.py, or None when it is another one."""
    try:
        data = (Path(mm_dir) / "manager.py").read_bytes()
    except OSError:
        return None
    return KNOWN_VERSIONS.get(hashlib.sha256(data).hexdigest())


def hook_loaded(mm_dir: str | os.PathLike) -> None:
    """Called by the installed hook once layerstream's module loaded: one warning when the checkout's
    manager.py is not a version layerstream was tested with (it may call the module differently)."""
    if manager_version(mm_dir) is None:
        logging.getLogger("layerstream").warning(
            "%s differs from the AI-Toolkit versions layerstream was tested with (%s): it may call "
            "manager_modules in ways layerstream does not handle. Set LAYERSTREAM=0 to run stock if training "
            "misbehaves, and report the AI-Toolkit commit", Path(mm_dir) / "manager.py",
            ", ".join(KNOWN_VERSIONS.values()))


def load_hook(mm_dir: str | os.PathLike) -> tuple[ModuleType | None, ImportError | None]:
    """What the installed hook calls (patches/ai-toolkit.patch): checks the settings this run has (the
    environment, which AI-Toolkit's run.py filled from the checkout's .env) and raises ValueError with the one
    line of the first that is not accepted; then imports layerstream's manager_modules. Returns (the module,
    None), or (None, why) when it cannot be loaded in this Python (the hook then runs stock, with a warning)."""
    from . import settings

    dotenv = Path(mm_dir).parent.parent / ".env"
    found = settings.problems(settings.run_settings(dotenv, loaded=True))
    if found:
        raise ValueError(found[0])
    try:
        from . import manager_modules
    except ImportError as exc:
        return None, exc
    hook_loaded(mm_dir)
    return manager_modules, None


def aitk_dir_from_env() -> Path | None:
    """The checkout named by ``AI_TOOLKIT_DIR``, or None when unset."""
    value = os.environ.get("AI_TOOLKIT_DIR")
    return Path(value) if value else None


def load_memory_management(aitk_dir: str | os.PathLike, engine: str = "layerstream") -> ModuleType:
    """Import ``toolkit/memory_management`` of ``aitk_dir`` and return the package (``.MemoryManager`` etc.)."""
    if engine not in ("layerstream", "stock"):
        raise ValueError(f"engine must be 'layerstream' or 'stock', not {engine!r}")
    mm_dir = Path(aitk_dir) / "toolkit" / "memory_management"
    if not (mm_dir / "manager.py").is_file():
        raise ValueError(f"{aitk_dir} is not an AI-Toolkit checkout: {mm_dir / 'manager.py'} does not exist")
    name = f"_layerstream_aitk_{engine}_{abs(hash(str(mm_dir.resolve()))):x}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        name, mm_dir / "__init__.py", submodule_search_locations=[str(mm_dir)]
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    if engine == "layerstream":
        from . import manager_modules

        sys.modules[name + ".manager_modules"] = manager_modules
    try:
        spec.loader.exec_module(package)
    except BaseException:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]
        raise
    return package


def import_toolkit(aitk_dir: str | os.PathLike, *names: str) -> list[ModuleType]:
    """Modules of the checkout's own ``toolkit`` package (e.g. ``toolkit.util.ostris_quant``, its quantizers),
    imported unchanged, for the tests and benchmarks. A ``toolkit`` imported before (another checkout's) is
    dropped from ``sys.modules`` first. Its ``toolkit/print.py`` needs accelerate for its one function
    ``print_acc``; where accelerate is not installed, a module with that function (``print``) stands in."""
    for name in [n for n in sys.modules if n == "toolkit" or n.startswith("toolkit.")]:
        del sys.modules[name]
    if importlib.util.find_spec("accelerate") is None:
        stand_in = ModuleType("toolkit.print")
        stand_in.print_acc = print
        sys.modules["toolkit.print"] = stand_in
    path = str(aitk_dir)
    sys.path.insert(0, path)
    try:
        return [importlib.import_module(name) for name in names]
    finally:
        sys.path.remove(path)
