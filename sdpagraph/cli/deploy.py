"""`sdpagraph precompile` and `sdpagraph verify`: the command line of `sdpagraph.deploy`."""
from __future__ import annotations

import argparse
import json
import signal
import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from sdpagraph.deploy.precompile import BuilderUnavailable, PrecompileReport, precompile, without_gpu_preallocation
from sdpagraph.deploy.verify import VerifyReport, verify
from sdpagraph.deploy.specfile import SpecFileError

EXIT_CANNOT_RUN = 2
EXIT_INTERRUPTED = 130


def add_precompile_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "precompile", help="build every graph of spec files into a cache directory",
        description="Build every graph the spec files need into DIR, for this machine's GPU and cuDNN. "
                    "Exit 1 if a graph failed to build (or, with --strict, is unsupported); 2 if no graph "
                    "can be built here; 130 when interrupted (run it again to continue).")
    parser.add_argument("specs", nargs="+", metavar="SPECS.json", help="spec files, recorded or hand-written")
    parser.add_argument("--cache-dir", required=True, help="the cache directory to fill (created if missing)")
    parser.add_argument("--jobs", type=_positive_int, default=1, help="build processes (default 1)")
    parser.add_argument("--strict", action="store_true", help="unsupported graphs count as failures")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(handler=_handle_precompile)


def add_verify_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "verify", help="check that a cache directory holds every graph of spec files, for this GPU",
        description="Check that DIR holds a valid graph for every graph the spec files need, for this "
                    "machine's GPU, cuDNN and cudnn-frontend. Exit 1 if any is missing or invalid; 2 if "
                    "this machine cannot tell (no GPU or no cuDNN frontend).")
    parser.add_argument("--specs", nargs="+", required=True, metavar="SPECS.json", help="spec files")
    parser.add_argument("--cache-dir", required=True, help="the cache directory to check")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(handler=_handle_verify)


def _handle_precompile(args: argparse.Namespace) -> int:
    try:
        with _terminate_as_interrupt():
            return _report(args, lambda: precompile(args.specs, args.cache_dir, jobs=args.jobs,
                                                    strict=args.strict))
    except KeyboardInterrupt:
        print(f"\nsdpagraph precompile: interrupted; the graphs built so far are in {args.cache_dir}, each "
              "whole: run the same command again to build the rest", file=sys.stderr)
        return EXIT_INTERRUPTED


def _handle_verify(args: argparse.Namespace) -> int:
    return _report(args, lambda: verify(args.specs, args.cache_dir))


def _report(args: argparse.Namespace, run: Callable[[], PrecompileReport | VerifyReport]) -> int:
    without_gpu_preallocation()
    try:
        report = run()
    except (SpecFileError, OSError, BuilderUnavailable) as error:
        print(f"sdpagraph: {error}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    print(json.dumps(report.to_dict(), indent=2, sort_keys=True) if args.json else report.text())
    return report.exit_code


@contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """`kill` stops a precompile the way Ctrl-C does: its build workers are stopped too."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
