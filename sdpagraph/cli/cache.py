"""`sdpagraph cache ...`: inspect and maintain a graph cache directory (ls, info, verify, prune, clear)."""
from __future__ import annotations

import argparse
import sys
from typing import Callable

from sdpagraph.deploy import cache_admin as admin
from sdpagraph.cli.check import add_command_parser
from sdpagraph.config import CACHE_DIR, parse_size

Handler = Callable[[argparse.Namespace], int]


def add_cache_command(subparsers: argparse._SubParsersAction) -> None:
    cache = add_command_parser(
        subparsers, "cache", help="inspect and maintain the graph cache directory",
        description="Inspect and maintain a graph cache directory (default: $SDPAGRAPH_CACHE_DIR or the user "
                    "cache). A directory that does not exist holds nothing (exit 0). A path that is not a "
                    "directory, or that you may not read (or, for prune, clear, and verify --remove with "
                    "something to remove, write), is an error: one line on stderr (with --json also "
                    "{\"error\", \"exit_code\"} on stdout), exit 2, nothing changed.")
    actions = cache.add_subparsers(metavar="ACTION", required=True)  # CommandParsers too
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", help="cache directory (default: $SDPAGRAPH_CACHE_DIR or the user cache)")
    common.add_argument("--json", action="store_true", help="print JSON for scripts")

    ls = actions.add_parser("ls", parents=[common], help="list entries, most recently used first")
    ls.set_defaults(handler=_cache_handler("ls", lambda directory, args: admin.list_entries(directory)))

    info = actions.add_parser("info", parents=[common], help="show one entry")
    info.add_argument("key", help="the entry's key digest or a unique prefix of it (as in `ls`)")
    info.set_defaults(handler=_cache_handler("info", lambda directory, args: admin.entry_info(directory,
                                                                                               args.key)))

    verify = actions.add_parser("verify", parents=[common],
                                help="check every entry and look for stale temp files; exit 1 if an entry is bad")
    verify.add_argument("--remove", action="store_true", help="delete the bad entries and stale temp files")
    verify.set_defaults(handler=_cache_handler("verify", lambda directory, args: admin.verify_entries(directory,
                                                                                                   args.remove)))

    prune = actions.add_parser("prune", parents=[common], help="evict least recently used entries")
    prune.add_argument("--max-bytes", required=True, type=_size_argument, help="budget, e.g. 1073741824 or 1G")
    prune.set_defaults(handler=_cache_handler("prune", lambda directory, args: admin.prune(directory, args.max_bytes)))

    clear = actions.add_parser("clear", parents=[common], help="delete every entry not in use")
    clear.set_defaults(handler=_cache_handler("clear", lambda directory, args: admin.clear(directory)))


def _cache_handler(action: str, operation: Callable[[str, argparse.Namespace], admin.Report]) -> Handler:
    def handle(args: argparse.Namespace) -> int:
        report = operation(args.cache_dir or CACHE_DIR.get(), args)
        if report.error is not None:
            print(f"sdpagraph cache {action}: {report.error}", file=sys.stderr)
            if args.json:
                print(report.to_json())
        else:
            print(report.to_json() if args.json else report.text)
        return report.exit_code

    return handle


def _size_argument(text: str) -> int:
    try:
        return parse_size(text, source="--max-bytes")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
