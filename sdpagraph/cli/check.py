"""`sdpagraph check`: will these configs run on cuDNN here, and if not, why?

Entries come from spec files (recorded or hand-written, see docs/deployment.md) or from
shapes and flags on the command line; each is answered by the same query `attention`
and `check_support` use, so a "supported" answer leaves its graphs in the cache.

    sdpagraph check specs.json [--json]
    sdpagraph check --query 4,4096,16,128 --key 4,4096,16,128 --dtype bfloat16 --causal --softcap 30
    sdpagraph check --query 4,4096,16,128 --causal --softcap 30 --segments 8
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from typing import TYPE_CHECKING, Any, Callable, NoReturn

from sdpagraph.deploy.formatting import format_table

if TYPE_CHECKING:
    from sdpagraph.deploy.spec_entry import SpecEntry
# The spec-file reader (and jax) are imported where a command needs them: building the
# parser, and commands such as `cache`, stay free of jax.

EXIT_USAGE = 2
# Arguments that argparse would take for options but are values: negative numbers, and
# comma-separated integers that start with one (`--window -1,0`).
_VALUE_LIKE = re.compile(r"^-\d+$|^-\d*\.\d+$|^-\d+(,-?\d+)+$")


class CommandParser(argparse.ArgumentParser):
    """The parser of one `sdpagraph` command (or of a command's actions).

    A usage error is one line on stderr naming the flag, plus a JSON object on stdout when
    the command line has --json, and exit status 2 (no usage block: `--help` has it).
    """

    json_requested = False

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self.json_requested = "--json" in (sys.argv[1:] if args is None else list(args))
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:  # here, rather than in the top-level parser: one line, naming this command
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    def error(self, message: str) -> NoReturn:
        fail(self.prog, f"{message} (see {self.prog} --help)", self.json_requested)
        raise SystemExit(EXIT_USAGE)


def add_command_parser(subparsers: argparse._SubParsersAction, name: str, **kwargs: Any) -> CommandParser:
    """`subparsers.add_parser(name, **kwargs)`, as a CommandParser (so are its own subparsers)."""
    parser = subparsers.add_parser(name, **kwargs)
    parser.__class__ = CommandParser  # adds no state: only error reporting and parse_known_args change
    # argparse keeps this pattern per parser (an instance attribute since Python 3.2); with it,
    # `--window -1,0` reads -1,0 as the flag's value rather than as an unknown option.
    parser._negative_number_matcher = _VALUE_LIKE
    return parser


def fail(prog: str, message: str, as_json: bool, exit_code: int = EXIT_USAGE, **facts: Any) -> int:
    """Report an error the command cannot get past: one line on stderr; with --json, also
    `{"error": ..., "exit_code": ...}` (and `facts`) on stdout. Returns `exit_code`."""
    line = " ".join(str(message).split())
    print(f"{prog}: {line}", file=sys.stderr)
    if as_json:
        print(json.dumps({"error": line, "exit_code": exit_code, **facts}, indent=2, sort_keys=True))
    return exit_code


def add_check_command(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command_parser(
        subparsers, "check", help="say per config whether cuDNN runs it here, and why not",
        description="Answer, for each entry of the spec files (or the config given by flags), whether "
                    "cuDNN runs it on this machine, and the reason when it does not. Exit 0 when every "
                    "answer was found (supported or not); 2 on a bad spec file or bad flags (one line on "
                    "stderr naming the file or flag; with --json also {\"error\", \"exit_code\"} on stdout).")
    parser.add_argument("specs", nargs="*", metavar="SPECS.json", help="spec files, recorded or hand-written")
    flags = parser.add_argument_group("one config from flags (instead of spec files)")
    flags.add_argument("--query", type=_sizes("B,T,N,H"), metavar="B,T,N,H", help="query shape")
    flags.add_argument("--key", type=_sizes("B,S,K,H"), metavar="B,S,K,H", help="key shape (default: the query's)")
    flags.add_argument("--value", type=_sizes("B,S,K,HV"), metavar="B,S,K,HV",
                       help="value shape (default: the key's)")
    flags.add_argument("--dtype", default="bfloat16", help="bfloat16 (default), float16 or float32")
    flags.add_argument("--causal", action="store_true", help="is_causal=True")
    flags.add_argument("--bottom-right", action="store_true", help="causal_alignment='bottom_right'")
    flags.add_argument("--window", type=_window, metavar="LEFT,RIGHT",
                       help="local_window_size: LEFT,RIGHT or one size for both; -1 leaves a side open "
                            "(--window -1,0 and --window=-1,0 both work)")
    flags.add_argument("--chunk", type=int, metavar="N", help="chunk_size")
    flags.add_argument("--softcap", type=float, metavar="CAP", help="score_mod = mods.softcap(CAP)")
    flags.add_argument("--segments", type=int, metavar="M",
                       help="packed self-attention: segment_ids of the query's (B, T), max_segments_per_seq=M")
    flags.add_argument("--inference", action="store_true", help="check the inference graph (training=False)")
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")
    parser.set_defaults(handler=_handle_check)


def _sizes(names: str) -> Callable[[str], list[int]]:
    """An argparse type: exactly len(names) comma-separated positive integers."""
    count = len(names.split(","))

    def parse(text: str) -> list[int]:
        try:
            sizes = [int(part) for part in text.split(",")]
        except ValueError:
            sizes = []
        if len(sizes) != count or min(sizes) < 1:
            raise argparse.ArgumentTypeError(f"expected {count} comma-separated positive integers {names}, "
                                             f"got {text!r}")
        return sizes

    return parse


def _window(text: str) -> int | list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if len(sizes) not in (1, 2):
        raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT or one size (integers, -1 for an open side), "
                                         f"got {text!r}")
    return sizes[0] if len(sizes) == 1 else sizes


# The flag that sets each hand-written entry field, to name it in an error.
FIELD_FLAGS = {"shapes": "--query/--key/--value", "dtype": "--dtype", "training": "--inference",
               "is_causal": "--causal", "causal_alignment": "--bottom-right", "local_window_size": "--window",
               "chunk_size": "--chunk", "score_mod": "--softcap", "segment_ids": "--segments",
               "max_segments_per_seq": "--segments"}


def entry_from_flags(args: argparse.Namespace) -> SpecEntry:
    """The hand-written spec-file entry the flags describe, parsed like one from a file."""
    from sdpagraph.deploy.entry_parser import parse_entry
    from sdpagraph.deploy.spec_entry import SpecFileError

    key = args.key or args.query
    item: dict[str, Any] = {
        "shapes": {"query": args.query, "key": key, "value": args.value or key},
        "dtype": args.dtype, "training": not args.inference, "is_causal": args.causal,
    }
    if args.bottom_right:
        item["causal_alignment"] = "bottom_right"
    if args.window:
        item["local_window_size"] = args.window
    if args.chunk is not None:
        item["chunk_size"] = args.chunk
    if args.softcap is not None:
        item["score_mod"] = {"mod": "softcap", "args": [args.softcap]}
    if args.segments is not None:
        item["segment_ids"] = {"shape": args.query[:2]}
        item["max_segments_per_seq"] = args.segments
    try:
        return parse_entry(0, item)
    except SpecFileError as error:  # "entry 0: field 'chunk_size': ..." -> "--chunk: ..."
        if error.field is None:
            raise
        reason = str(error).split(": ", 2)[-1]
        raise SpecFileError(f"{FIELD_FLAGS.get(error.field, error.field)}: {reason}", field=error.field) \
            from error.__cause__


def answer(entry: SpecEntry) -> dict[str, Any]:
    """The support answer for one entry, as plain data."""
    from sdpagraph.cache import CacheMissError
    from sdpagraph.backends import registry  # its backends import jax; keep the CLI's start fast

    try:
        support = registry.primary().support(entry.spec, entry.score_mod, training=entry.training)
        verdict = {"supported": support.supported, "backend": support.backend, "reason": support.reason}
    except CacheMissError as miss:  # strict mode: the graph is not precompiled
        verdict = {"supported": False, "backend": "xla", "reason": str(miss)}
    return {"spec": entry.describe(), "directions": list(entry.directions), **verdict}


def _handle_check(args: argparse.Namespace) -> int:
    from sdpagraph.deploy.spec_entry import SpecFileError
    from sdpagraph.deploy.specfile import load_entries

    try:
        if args.query is not None:
            if args.specs:
                raise SpecFileError("give spec files or --query/--key flags, not both")
            entries = [entry_from_flags(args)]
        elif args.key is not None or args.value is not None:
            raise SpecFileError("--key and --value need --query B,T,N,H")
        elif args.specs:
            entries = load_entries(args.specs)
        else:
            raise SpecFileError("give spec files, or a config with --query B,T,N,H (see sdpagraph check --help)")
    except (SpecFileError, ValueError, TypeError) as error:
        return fail("sdpagraph check", str(error), args.json)
    answers = [answer(entry) for entry in entries]
    if args.json:
        print(json.dumps(answers, indent=1))
    else:
        rows = [[str(i), "yes" if a["supported"] else "no", a["backend"], a["spec"], a["reason"]]
                for i, a in enumerate(answers)]
        print(format_table(["#", "CUDNN", "BACKEND", "SPEC", "REASON"], rows))
    return 0
