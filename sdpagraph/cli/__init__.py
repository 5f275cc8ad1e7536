"""The `sdpagraph` command: one module per command group (check, cache, precompile/verify, demo, doctor).

Each top-level subcommand is added by one function taking the subparsers object and
setting `handler` (args -> exit code) on its parsers; list it in SUBCOMMANDS.
"""
from __future__ import annotations

import argparse
from typing import Callable, Sequence

from sdpagraph.cli.cache import add_cache_command
from sdpagraph.cli.check import add_check_command
from sdpagraph.cli.demo import add_demo_command
from sdpagraph.cli.deploy import add_precompile_command, add_verify_command
from sdpagraph.cli.doctor import add_doctor_command


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help or a usage error: return its code instead of exiting
        return exit_.code if isinstance(exit_.code, int) else 2
    return args.handler(args)


def build_parser() -> argparse.ArgumentParser:
    from sdpagraph import __version__

    parser = argparse.ArgumentParser(prog="sdpagraph", description="Flex attention for JAX on cuDNN.")
    parser.add_argument("--version", action="version", version=f"sdpagraph {__version__}")
    subparsers = parser.add_subparsers(metavar="COMMAND", required=True)
    for add_subcommand in SUBCOMMANDS:
        add_subcommand(subparsers)
    return parser


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_demo_command, add_check_command, add_cache_command, add_precompile_command, add_verify_command,
    add_doctor_command]
