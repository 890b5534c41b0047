"""Command line: ``python -m datadist_aio demo``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Optional


def _at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below the minimum of {minimum}")
        return value

    return parse


def main(argv: Optional[list[str]] = None) -> int:
    from . import __version__

    parser = argparse.ArgumentParser(prog="python -m datadist_aio")
    parser.add_argument("--version", action="version", version=f"datadist_aio {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="move a paged multi-layer KV cache and verify every byte")
    demo.add_argument("--layers", type=_at_least(1), default=32)
    demo.add_argument("--blocks", type=_at_least(2), default=256, help="blocks per tensor")
    demo.add_argument("--block-kib", type=_at_least(1), default=64, help="block size in KiB")
    demo.add_argument("--seed", type=_at_least(0), default=0)
    demo.add_argument("--transport", choices=("auto", "tcp", "ucx"), default="auto",
                      help="LLMConfig.transport of both processes (ucx: UCX must be installed)")
    args = parser.parse_args(argv)
    from .demo import DemoError, run_demo

    try:
        return run_demo(layers=args.layers, blocks=args.blocks, block_bytes=args.block_kib * 1024, seed=args.seed,
                        transport=args.transport)
    except DemoError as exc:
        print(f"python -m datadist_aio demo: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
