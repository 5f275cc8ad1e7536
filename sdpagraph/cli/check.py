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
from typing import Any

from sdpagraph.cache import CacheMissError
from sdpagraph.cache.admin import format_table
from sdpagraph.deploy.specfile import SpecEntry, SpecFileError, load_entries, parse_entry


def add_check_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check", help="say per config whether cuDNN runs it here, and why not",
        description="Answer, for each entry of the spec files (or the config given by flags), whether "
                    "cuDNN runs it on this machine, and the reason when it does not. Exit 0 when every "
                    "answer was found (supported or not); 2 on a bad spec file or bad flags.")
    parser.add_argument("specs", nargs="*", metavar="SPECS.json", help="spec files, recorded or hand-written")
    flags = parser.add_argument_group("one config from flags (instead of spec files)")
    flags.add_argument("--query", type=_shape, metavar="B,T,N,H", help="query shape")
    flags.add_argument("--key", type=_shape, metavar="B,S,K,H", help="key shape (default: the query's)")
    flags.add_argument("--value", type=_shape, metavar="B,S,K,HV", help="value shape (default: the key's)")
    flags.add_argument("--dtype", default="bfloat16", help="bfloat16 (default), float16 or float32")
    flags.add_argument("--causal", action="store_true", help="is_causal=True")
    flags.add_argument("--bottom-right", action="store_true", help="causal_alignment='bottom_right'")
    flags.add_argument("--window", type=_shape, metavar="LEFT,RIGHT", help="local_window_size")
    flags.add_argument("--chunk", type=int, metavar="N", help="chunk_size")
    flags.add_argument("--softcap", type=float, metavar="CAP", help="score_mod = mods.softcap(CAP)")
    flags.add_argument("--segments", type=int, metavar="M",
                       help="packed self-attention: segment_ids of the query's (B, T), max_segments_per_seq=M")
    flags.add_argument("--inference", action="store_true", help="check the inference graph (training=False)")
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")
    parser.set_defaults(handler=_handle_check)


def _shape(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def entry_from_flags(args: argparse.Namespace) -> SpecEntry:
    """The hand-written spec-file entry the flags describe, parsed like one from a file."""
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
    return parse_entry(0, item)


def answer(entry: SpecEntry) -> dict[str, Any]:
    """The support answer for one entry, as plain data."""
    from sdpagraph.jax_api import cudnn as cudnn_backend  # imports jax; keep the CLI's start fast

    try:
        support = cudnn_backend.support(entry.spec, entry.score_mod, training=entry.training)
        verdict = {"supported": support.supported, "backend": support.backend, "reason": support.reason}
    except CacheMissError as miss:  # strict mode: the graph is not precompiled
        verdict = {"supported": False, "backend": "xla", "reason": str(miss)}
    return {"spec": entry.describe(), "directions": list(entry.directions), **verdict}


def _handle_check(args: argparse.Namespace) -> int:
    try:
        if args.query is not None:
            if args.specs:
                raise SpecFileError("give spec files or --query/--key flags, not both")
            entries = [entry_from_flags(args)]
        elif args.specs:
            entries = load_entries(args.specs)
        else:
            raise SpecFileError("give spec files, or a config with --query B,T,N,H (see --help)")
    except (SpecFileError, ValueError, TypeError) as error:
        print(f"sdpagraph check: {error}")
        return 2
    answers = [answer(entry) for entry in entries]
    if args.json:
        print(json.dumps(answers, indent=1))
    else:
        rows = [[str(i), "yes" if a["supported"] else "no", a["backend"], a["spec"], a["reason"]]
                for i, a in enumerate(answers)]
        print(format_table(["#", "CUDNN", "BACKEND", "SPEC", "REASON"], rows))
    return 0
