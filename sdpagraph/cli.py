"""The `sdpagraph` command.

Each top-level subcommand is added by one function taking the subparsers object and
setting `handler` (args -> exit code) on its parsers; list it in SUBCOMMANDS.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from sdpagraph.cache import admin
from sdpagraph.cache.defaults import default_cache_dir, parse_size
from sdpagraph.check_cli import add_check_command
from sdpagraph.deploy_cli import add_precompile_command, add_verify_command

Handler = Callable[[argparse.Namespace], int]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help or a usage error: return its code instead of exiting
        return exit_.code if isinstance(exit_.code, int) else 2
    return args.handler(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sdpagraph", description="Flex attention for JAX on cuDNN.")
    subparsers = parser.add_subparsers(metavar="COMMAND", required=True)
    for add_subcommand in SUBCOMMANDS:
        add_subcommand(subparsers)
    return parser


# -- sdpagraph demo -------------------------------------------------------------------------


def add_demo_command(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser("demo", help="run flex attention end to end (cuDNN on a GPU, else XLA)")
    demo.add_argument("--seq", type=int, default=1024, help="sequence length (capped at 256 without a GPU)")
    demo.set_defaults(handler=lambda args: _run_demo(args.seq))


def _run_demo(seq: int) -> int:
    from sdpagraph.demo import run_demo  # imports jax: keep `sdpagraph cache ...` fast

    return run_demo(seq=seq)


# -- sdpagraph cache ... -------------------------------------------------------------------


def add_cache_command(subparsers: argparse._SubParsersAction) -> None:
    cache = subparsers.add_parser("cache", help="inspect and maintain the graph cache directory")
    actions = cache.add_subparsers(metavar="ACTION", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", help="cache directory (default: $SDPAGRAPH_CACHE_DIR or the user cache)")
    common.add_argument("--json", action="store_true", help="print JSON for scripts")

    ls = actions.add_parser("ls", parents=[common], help="list entries, most recently used first")
    ls.set_defaults(handler=_cache_handler(lambda directory, args: admin.list_entries(directory)))

    info = actions.add_parser("info", parents=[common], help="show one entry")
    info.add_argument("key", help="the entry's key digest or a unique prefix of it (as in `ls`)")
    info.set_defaults(handler=_cache_handler(lambda directory, args: admin.entry_info(directory, args.key)))

    verify = actions.add_parser("verify", parents=[common], help="check every entry; exit 1 if any is bad")
    verify.add_argument("--remove", action="store_true", help="delete the bad entries")
    verify.set_defaults(handler=_cache_handler(lambda directory, args: admin.verify_entries(directory, args.remove)))

    prune = actions.add_parser("prune", parents=[common], help="evict least recently used entries")
    prune.add_argument("--max-bytes", required=True, type=_size_argument, help="budget, e.g. 1073741824 or 1G")
    prune.set_defaults(handler=_cache_handler(lambda directory, args: admin.prune(directory, args.max_bytes)))

    clear = actions.add_parser("clear", parents=[common], help="delete every entry not in use")
    clear.set_defaults(handler=_cache_handler(lambda directory, args: admin.clear(directory)))


def _cache_handler(operation: Callable[[str, argparse.Namespace], admin.Report]) -> Handler:
    def handle(args: argparse.Namespace) -> int:
        report = operation(args.cache_dir or default_cache_dir(), args)
        print(report.to_json() if args.json else report.text)
        return report.exit_code

    return handle


def _size_argument(text: str) -> int:
    try:
        return parse_size(text, source="--max-bytes")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_demo_command, add_check_command, add_cache_command, add_precompile_command, add_verify_command]

if __name__ == "__main__":
    sys.exit(main())
