"""The ``layerstream`` command line."""

from __future__ import annotations

import argparse
import sys


def _info(_: list[str]) -> int:
    import layerstream
    from layerstream import _native

    print(f"layerstream {layerstream.__version__}")
    print(f"CUDA backend compiled: {_native.cuda_compiled()}")
    count = _native.cuda_device_count()
    print(f"CUDA devices: {count}" + ("" if count else f" ({_native.cuda_unavailable_reason()})"))
    return 0


def _demo(rest: list[str]) -> int:
    from layerstream import demo

    return demo.run(rest)


def _install(rest: list[str]) -> int:
    from layerstream import install

    parser = argparse.ArgumentParser(prog="layerstream install",
                                     description="Make an AI-Toolkit checkout run on layerstream.")
    parser.add_argument("path", help="the AI-Toolkit checkout (the folder that contains toolkit/)")
    parser.add_argument("--mode", choices=["patch", "copy"], default="patch",
                        help="patch: add a small loader package (default); copy: copy the extension in")
    parser.add_argument("--force", action="store_true", help="install into an unknown or modified checkout")
    args = parser.parse_args(rest)
    try:
        print(install.install(args.path, args.mode, args.force))
    except install.InstallError as exc:
        print(f"layerstream install: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _uninstall(rest: list[str]) -> int:
    from layerstream import install

    parser = argparse.ArgumentParser(prog="layerstream uninstall",
                                     description="Restore an AI-Toolkit checkout to its stock manager_modules.")
    parser.add_argument("path", help="the AI-Toolkit checkout")
    args = parser.parse_args(rest)
    try:
        print(install.uninstall(args.path))
    except install.InstallError as exc:
        print(f"layerstream uninstall: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _doctor(rest: list[str]) -> int:
    from layerstream import doctor

    return doctor.run(rest)


def _bench(rest: list[str]) -> int:
    from layerstream import bench

    return bench.main(rest)


COMMANDS = {
    "demo": (_demo, "stream a toy model through the engine and verify every byte"),
    "info": (_info, "print the build and the devices it sees"),
    "install": (_install, "make an AI-Toolkit checkout run on layerstream (patch or copy mode)"),
    "uninstall": (_uninstall, "restore an AI-Toolkit checkout to stock"),
    "doctor": (_doctor, "check GPU, driver, torch, the extension, pinning and bandwidth"),
    "bench": (_bench, "side-by-side training benchmark: resident, stock AI-Toolkit, layerstream"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="layerstream",
        description="layerstream: weight streaming for training on GPUs smaller than the model.",
        epilog="\n".join(f"  {name:8s} {help_}" for name, (_, help_) in COMMANDS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=sorted(COMMANDS), metavar="command")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    try:
        return COMMANDS[ns.command][0](ns.args)
    except (RuntimeError, ValueError) as exc:
        print(f"layerstream {ns.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
