"""`layerstream status [PATH]`: whether an AI-Toolkit checkout runs on layerstream, as configured.

Settings are what a run started by AI-Toolkit's run.py sees: this environment, plus the checkout's .env for
the variables the environment does not set (run.py calls python-dotenv's load_dotenv(), which does not
override), each shown as written with where it came from. The hook is loaded in this Python and in the
Python AI-Toolkit's web UI runs jobs with (the checkout's .venv, else venv: AI-Toolkit's launcher and UI
take them in that order). The exit status is 1 when the hook will not run as configured: a setting that is
not accepted or is no setting, layerstream not installed or not loading where the jobs run.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from . import install, settings
from .shell import checkout_arg, command

OFF = ("0", "off", "false", "no")


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def add(self, label: str, text: str) -> None:
        self.lines.append(f"{label:<12} {text}")

    def text(self) -> str:
        problems = ["problems", *(f"  {p}" for p in self.problems)] if self.problems else []
        return "\n".join([*self.lines, *problems])


def ui_python(root: Path) -> Path | None:
    """The interpreter AI-Toolkit's web UI runs jobs with: .venv's, else venv's; None when neither exists."""
    for name in (".venv", "venv"):
        venv = root / name
        if venv.is_dir():
            return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python3")
    return None


def _is_this_python(python: Path) -> bool:
    try:
        return python.parent.parent.resolve() == Path(sys.prefix).resolve()
    except OSError:
        return False


def _source() -> str:
    """Where this layerstream was installed from (pip's direct_url.json), for the command that installs it
    elsewhere; a placeholder when pip did not record a folder."""
    try:
        url = json.loads(metadata.distribution("layerstream").read_text("direct_url.json") or "{}").get("url", "")
    except (metadata.PackageNotFoundError, ValueError):
        url = ""
    if url.startswith("file://"):
        from urllib.parse import unquote, urlparse

        path = unquote(urlparse(url).path)
        return path[1:] if os.name == "nt" and path[:1] == "/" and path[2:3] == ":" else path
    return "/path/to/layerstream"


def _install_command(python: Path) -> str:
    return (f"{command(python, '-m', 'pip', 'install', 'scikit-build-core', 'pybind11', 'cmake', 'ninja')} && "
            f"{command(python, '-m', 'pip', 'install', '--no-build-isolation', _source())}")


def _settings_lines(values: dict[str, settings.Value], report: Report) -> None:
    report.lines.append("settings")
    shown = [spec for spec in settings.TABLE if spec.audience == "user" or spec.name in values]
    width = max(len(f"{spec.name}={values[spec.name].text}" if spec.name in values else spec.name) for spec in shown)
    for spec in shown:
        if spec.name in values and values[spec.name].text:
            value = values[spec.name]
            report.lines.append(f"  {spec.name + '=' + value.text:<{width}}  {value.origin}")
        else:
            report.lines.append(f"  {spec.name:<{width}}  unset: {spec.default}")


def _hook_lines(checkout: install.Checkout, manifest: install.Manifest, env: dict[str, str], stock: bool,
                report: Report) -> None:
    """Whether the hook is current and layerstream loads in this Python and in the web UI's (a problem unless
    LAYERSTREAM=0 chose stock)."""
    again = command("layerstream", "uninstall", *checkout_arg(checkout.root))
    hook = checkout.root / install.HOOK
    if manifest.mode == "patch" and hook.is_file() and install.sha256_of(hook) in install.LEGACY_HOOKS:
        report.problems.append(f"the installed hook is an older layerstream's: run `{again}` and `"
                               f"{command('layerstream', 'install', *checkout_arg(checkout.root))}` to renew it")
    found = install.probe(checkout, env)
    report.add("this Python", f"{sys.executable}: " + ("layerstream loads" if found.layerstream
                                                        else f"layerstream does NOT load ({found.detail})"))
    if not found.layerstream and not stock:
        report.problems.append(f"layerstream does not load in {sys.executable}: {found.detail}")
    python = ui_python(checkout.root)
    if python is None:
        report.add("web UI", "no .venv or venv in the checkout yet (AI-Toolkit's launcher creates .venv at its "
                             "first start: install layerstream into it then)")
    elif _is_this_python(python):
        report.add("web UI", f"{python}: this Python")
    else:
        in_ui = install.probe(checkout, env, str(python))
        report.add("web UI", f"{python}: " + ("layerstream loads" if in_ui.layerstream
                                               else f"layerstream does NOT load ({in_ui.detail})"))
        if not in_ui.layerstream and not stock:
            report.problems.append(f"the web UI runs jobs with {python}, where layerstream does not load "
                                   f"({in_ui.detail}); install it there: {_install_command(python)}")


def report(path: str | Path = ".") -> tuple[str, int]:
    """The status text and the exit status (1 when the hook will not run as configured)."""
    checkout = install.inspect(path)
    manifest = install.Manifest.load(checkout.root)
    dotenv = checkout.root / ".env"
    values = settings.run_settings(dotenv)
    result = Report()
    result.add("checkout", str(checkout.root))
    result.add("AI-Toolkit", checkout.version or "unknown version (manager.py matches no tested one)")
    result.problems.extend(settings.problems(values, dotenv))
    switch = values.get("LAYERSTREAM")
    stock = switch is not None and switch.text.strip().lower() in OFF
    if manifest is None:
        result.add("installed", "no (stock)")
        result.problems.append(f"layerstream is not installed in this checkout: "
                               f"`{command('layerstream', 'install', *checkout_arg(checkout.root))}`")
    else:
        result.add("installed", f"{manifest.mode} mode ({', '.join(manifest.files)})")
        if manifest.mode == "copy" and stock:
            result.problems.append("LAYERSTREAM=0 has no effect in copy mode (uninstall to run stock)")
        # Settings that are not accepted are left out: the probe answers whether layerstream loads at all.
        refused = {name: "" for name in values if settings.refusal(name, values[name])}
        env = {**{name: value.text for name, value in values.items()}, **refused, "LAYERSTREAM": ""}
        _hook_lines(checkout, manifest, env, stock, result)
    engine = "stock (LAYERSTREAM=" + switch.text + f", {switch.origin})" if stock else "layerstream"
    result.add("engine", engine if manifest is not None else "stock")
    _settings_lines(values, result)
    return result.text(), 1 if result.problems else 0
