"""The README's two quickstart commands stay true: CI runs the test command verbatim."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def quickstart_commands():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Quickstart.*?```bash\n(.*?)```", readme, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_quickstart_has_exactly_two_commands():
    demo, tests = quickstart_commands()
    assert "sdpagraph demo" in demo and "pytest" in tests


def test_ci_runs_the_readme_test_command():
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert quickstart_commands()[1] in ci_lines


def test_demo_subcommand_exists():
    from sdpagraph.cli import build_parser

    args = build_parser().parse_args(["demo"])
    assert callable(args.handler)
