"""The ``layerstream`` command line: one argparse subparser per command; every failure is one line on stderr
(with what to do) and exit status 2, never a traceback."""

from __future__ import annotations

import argparse
import sys


def _info(_: argparse.Namespace) -> int:
    import layerstream
    from layerstream import _native

    print(f"layerstream {layerstream.__version__}")
    print(f"CUDA backend compiled: {_native.cuda_compiled()}")
    count = _native.cuda_device_count()
    print(f"CUDA devices: {count}" + ("" if count else f" ({_native.cuda_unavailable_reason()})"))
    return 0


def _install(args: argparse.Namespace) -> int:
    from layerstream import install

    print(install.install(args.path, args.mode, args.force))
    return 0


def _uninstall(args: argparse.Namespace) -> int:
    from layerstream import install

    print(install.uninstall(args.path))
    return 0


def _status(args: argparse.Namespace) -> int:
    from layerstream import status

    text, code = status.report(args.path)
    print(text)
    return code


def _set(args: argparse.Namespace) -> int:
    from layerstream import dotenv_file, install

    name, equals, value = args.assignment.partition("=")
    if not equals:
        raise ValueError(f"give NAME=value, e.g. `layerstream set LAYERSTREAM_VRAM_BUDGET=auto`, not {args.assignment!r}")
    print(dotenv_file.set_value(install.inspect(args.path).root / ".env", name.strip(), value.strip()))
    return 0


def _unset(args: argparse.Namespace) -> int:
    from layerstream import dotenv_file, install

    print(dotenv_file.unset_value(install.inspect(args.path).root / ".env", args.name))
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from layerstream import doctor

    return doctor.run(aitk=args.aitk, weights_gb=args.weights_gb, host_dtype=args.host_dtype)


def _demo(args: argparse.Namespace) -> int:
    from layerstream import demo

    return demo.run(args.rest)


def _bench(args: argparse.Namespace) -> int:
    from layerstream import bench

    return bench.main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    from layerstream import __version__

    parser = argparse.ArgumentParser(
        prog="layerstream", description="layerstream: weight streaming for training on GPUs smaller than the model.")
    parser.add_argument("--version", action="version", version=f"layerstream {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="command", required=True)

    def command(name: str, handler, help_: str, **kwargs) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_, description=help_, **kwargs)
        sub.set_defaults(handler=handler)
        return sub

    # demo and bench parse their own options (bench re-runs itself with them); --help reaches them too.
    command("demo", _demo, "stream a toy model through the engine and verify every byte", add_help=False)
    command("bench", _bench, "side-by-side training benchmark: resident, stock AI-Toolkit, layerstream",
            add_help=False)
    command("info", _info, "print the build and the devices it sees")
    checkout_help = "the AI-Toolkit checkout, the folder that contains toolkit/ (default: the current folder)"
    sub = command("install", _install, "make an AI-Toolkit checkout run on layerstream (patch or copy mode)")
    sub.add_argument("path", nargs="?", default=".", help=checkout_help)
    sub.add_argument("--mode", choices=["patch", "copy"], default="patch",
                     help="patch: add a small loader package (default, recommended); copy: copy the extension in")
    sub.add_argument("--force", action="store_true", help="install into an unknown or modified checkout")
    sub = command("uninstall", _uninstall, "remove what `layerstream install` wrote (only files it wrote, "
                  "only while unchanged)")
    sub.add_argument("path", nargs="?", default=".", help=checkout_help)
    sub = command("status", _status, "show whether an AI-Toolkit checkout runs on layerstream as configured, and "
                  "its settings (exit status 1 when it will not)")
    sub.add_argument("path", nargs="?", default=".", help=checkout_help)
    sub = command("set", _set, "set a LAYERSTREAM setting in the checkout's .env (checked first; other lines kept "
                  "byte for byte)")
    sub.add_argument("assignment", metavar="NAME=value", help="e.g. LAYERSTREAM_VRAM_BUDGET=auto")
    sub.add_argument("path", nargs="?", default=".", help=checkout_help)
    sub = command("unset", _unset, "remove a LAYERSTREAM setting from the checkout's .env")
    sub.add_argument("name", metavar="NAME", help="e.g. LAYERSTREAM_VRAM_BUDGET")
    sub.add_argument("path", nargs="?", default=".", help=checkout_help)
    sub = command("doctor", _doctor, "check GPU, driver, torch, the extension, host RAM, pinning and bandwidth")
    sub.add_argument("--aitk", action="store_true",
                     help="check for training in AI-Toolkit: a CPU-only torch or no GPU is a failure")
    sub.add_argument("--weights-gb", type=float,
                     help="the managed weights' size in GiB (e.g. 22 for FLUX.1, 60 for FLUX.2 in bf16), "
                          "checked against host RAM")
    sub.add_argument("--host-dtype", choices=["same", "lossless", "float8_e4m3fn", "float8_e5m2", "auto"],
                     help="the form the weights are kept in on the host (default: LAYERSTREAM_HOST_DTYPE as set)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command in ("demo", "bench"):
        args.rest = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    from layerstream.install import InstallError

    try:
        return args.handler(args)
    except (InstallError, RuntimeError, ValueError, OSError) as exc:
        message = str(exc).strip() or type(exc).__name__
        print(f"layerstream {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
