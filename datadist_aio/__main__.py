"""Command line: ``python -m datadist_aio demo``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m datadist_aio")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="move a paged multi-layer KV cache and verify every byte")
    demo.add_argument("--layers", type=int, default=32)
    demo.add_argument("--blocks", type=int, default=256, help="blocks per tensor")
    demo.add_argument("--block-kib", type=int, default=64, help="block size in KiB")
    demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from .demo import run_demo

    return run_demo(layers=args.layers, blocks=args.blocks, block_bytes=args.block_kib * 1024, seed=args.seed)


if __name__ == "__main__":
    sys.exit(main())
