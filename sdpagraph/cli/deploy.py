"""`sdpagraph precompile` and `sdpagraph verify`: the command line of `sdpagraph.deploy`."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Iterator

from sdpagraph.cli.check import add_command_parser, fail

if TYPE_CHECKING:
    from sdpagraph.deploy.spec_entry import SpecEntry
    from sdpagraph.deploy.verify import VerifyReport
# sdpagraph.deploy (and jax) are imported by the handlers: building the parser stays light.

EXIT_CANNOT_RUN = 2
EXIT_INTERRUPTED = 130
JSON_NOTE = ("With --json, stdout is one JSON object whatever happens: the report, or {\"error\", \"exit_code\"} "
             "(errors are also one line on stderr).")


def add_precompile_command(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command_parser(
        subparsers, "precompile", help="build every graph of spec files into a cache directory",
        description="Build every graph the spec files need into DIR, for this machine's GPU and cuDNN. "
                    "The spec files are read and checked first, on any machine. Exit 1 if a graph failed to "
                    "build (or, with --strict, is unsupported); 2 on an invalid spec file or cache directory, "
                    "or if no graph can be built here (no GPU or no cuDNN frontend); 130 when interrupted "
                    "(run it again to continue). " + JSON_NOTE)
    parser.add_argument("specs", nargs="+", metavar="SPECS.json", help="spec files, recorded or hand-written")
    parser.add_argument("--cache-dir", required=True, help="the cache directory to fill (created if missing)")
    parser.add_argument("--jobs", type=_positive_int, default=1, help="build processes (default 1)")
    parser.add_argument("--strict", action="store_true", help="unsupported graphs count as failures")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(handler=_handle_precompile)


def add_verify_command(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command_parser(
        subparsers, "verify", help="check that a cache directory holds every graph of spec files, for this GPU",
        description="Check that DIR holds a valid graph for every graph the spec files need, for this "
                    "machine's GPU, cuDNN and cudnn-frontend. The spec files are read and checked first, on "
                    "any machine. Exit 1 if any graph is missing or invalid; 2 on an invalid spec file or "
                    "cache directory, or if this machine cannot tell (no GPU or no cuDNN frontend). " + JSON_NOTE)
    parser.add_argument("--specs", nargs="+", required=True, metavar="SPECS.json", help="spec files")
    parser.add_argument("--cache-dir", required=True, help="the cache directory to check")
    parser.add_argument("--numerics", action="store_true",
                        help="instead: run every entry's graphs on random inputs against a float32 NumPy reference, record "
                             "the errors in the entries, and exit 1 on any failure (needs this GPU type)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(handler=_handle_verify)


def _handle_precompile(args: argparse.Namespace) -> int:
    from sdpagraph.deploy.precompile import precompile

    try:
        with _terminate_as_interrupt():
            return _run(args, "precompile", lambda entries: precompile(entries, args.cache_dir, jobs=args.jobs,
                                                                       strict=args.strict))
    except KeyboardInterrupt:
        message = (f"interrupted; the graphs built so far are in {args.cache_dir}, each whole: run the same "
                   "command again to build the rest")
        if not args.json:
            print(file=sys.stderr)  # below the progress line
        return fail("sdpagraph precompile", message, args.json, EXIT_INTERRUPTED)


def _handle_verify(args: argparse.Namespace) -> int:
    from sdpagraph.deploy.verify import precompile_command, verify

    if args.numerics:
        from sdpagraph.deploy.numerics import NumericsReport, verify_numerics
        from sdpagraph.deploy.precompile import BuilderUnavailable

        def check(entries: list[SpecEntry]) -> NumericsReport:
            report = verify_numerics(entries, args.cache_dir)
            if report.unavailable is not None:  # an error, reported like verify's own (exit 2)
                raise BuilderUnavailable(report.text())
            return report

        return _run(args, "verify", check)

    def run(entries: list[SpecEntry]) -> VerifyReport:
        report = verify(entries, args.cache_dir)
        # verify() got entries, not paths: the command that fixes the directory names the files.
        return replace(report, fix_command=precompile_command(args.specs, report.cache_dir))

    return _run(args, "verify", run)


def _run(args: argparse.Namespace, command: str,
         run: Callable[[list[SpecEntry]], Any]) -> int:
    """Check the spec files and the directory, then run; errors are one line (and JSON with --json)."""
    from sdpagraph.deploy.precompile import BuilderUnavailable, without_gpu_preallocation
    from sdpagraph.deploy.spec_entry import SpecFileError
    from sdpagraph.deploy.specfile import load_entries

    prog = f"sdpagraph {command}"
    without_gpu_preallocation()
    try:
        entries = load_entries(args.specs)
    except SpecFileError as error:
        return fail(prog, str(error), args.json, EXIT_CANNOT_RUN)
    graphs = sum(len(entry.directions) for entry in entries)
    checked = {"entries": len(entries), "graphs": graphs}
    problem = _directory_problem(args.cache_dir, create=command == "precompile")
    if problem is not None:
        return fail(prog, problem, args.json, EXIT_CANNOT_RUN, **checked)
    try:
        report = run(entries)
    except BuilderUnavailable as error:
        files = " ".join(args.specs) + (" is" if len(args.specs) == 1 else " are")
        return fail(prog, f"{files} valid ({_count(len(entries), 'entry', 'entries')}, "
                          f"{_count(graphs, 'graph', 'graphs')}); {error}", args.json, EXIT_CANNOT_RUN, **checked)
    except (SpecFileError, OSError) as error:
        return fail(prog, str(error), args.json, EXIT_CANNOT_RUN)
    if args.json:
        print(json.dumps({**report.to_dict(), "exit_code": report.exit_code}, indent=2, sort_keys=True))
    else:
        print(report.text())
    return report.exit_code


def _directory_problem(directory: str, create: bool) -> str | None:
    """Why `directory` cannot be the cache directory (precompile creates a missing one), or None."""
    path = os.path.abspath(os.path.expanduser(directory))
    if os.path.exists(path):
        if not os.path.isdir(path):
            return f"--cache-dir {directory}: not a directory"
        if create and not os.access(path, os.W_OK | os.X_OK):
            return f"--cache-dir {directory}: permission denied (cannot write to it)"
        if not create and not os.access(path, os.R_OK | os.X_OK):
            return f"--cache-dir {directory}: permission denied (cannot read it)"
        return None
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"--cache-dir {directory}: {parent} is not a directory"
    if create and not os.access(parent, os.W_OK | os.X_OK):
        return f"--cache-dir {directory}: permission denied (cannot create it in {parent})"
    return None


def _count(number: int, one: str, many: str) -> str:
    return f"{number} {one if number == 1 else many}"


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
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
