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


COMMANDS = {
    "demo": (_demo, "stream a toy model through the engine and verify every byte"),
    "info": (_info, "print the build and the devices it sees"),
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
