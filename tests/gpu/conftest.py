"""GPU tests: skipped as a whole without a CUDA GPU, torch or the cudnn frontend.

torch (test buffers), cuDNN and JAX (the XLA reference) share one GPU, so JAX must not
grab most of its memory up front.
"""
import json
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import pytest  # noqa: E402  (after the environment variable, before anything imports jax)

HERE = os.path.dirname(os.path.abspath(__file__))


def gpu_skip_reason():
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    try:
        import cudnn  # noqa: F401  (nvidia-cudnn-frontend)
    except ImportError:
        return "the cudnn frontend (nvidia-cudnn-frontend) is not installed"
    return None


def pytest_collection_modifyitems(config, items):
    reason = gpu_skip_reason()
    if reason is None:
        return
    for item in items:
        if str(item.path).startswith(HERE):
            item.add_marker(pytest.mark.skip(reason=reason))


def _output_path(stem, suffix):
    """A file under $OUT, one per pytest-xdist worker; None without $OUT."""
    if not os.environ.get("OUT"):
        return None
    return os.path.join(os.environ["OUT"], f"{stem}-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}{suffix}")


@pytest.fixture(scope="session")
def report():
    """report(line): print it and keep it under $OUT (xdist workers' stdout is not shown)."""
    path = _output_path("report", ".txt")

    def write(line):
        print(line)
        if path:
            with open(path, "a") as out:
                out.write(line + "\n")

    return write


@pytest.fixture(scope="session")
def build_times(report):
    """Rows (graph kind, direction, seconds, blob bytes, workspace bytes); reported and saved at the end."""
    rows = []
    yield rows
    for kind, direction, seconds, size, workspace in rows:
        report(f"build {kind:<28} {direction:<10} {seconds * 1e3:8.0f} ms  {size / 1024:6.1f} KiB  ws {workspace}")
    path = _output_path("build_times", ".json")
    if rows and path:
        with open(path, "w") as out:
            json.dump(rows, out, indent=1)


@pytest.fixture(scope="module")
def private_cache(tmp_path_factory):
    """A graph cache of the test module's own, as the runtime's default while the module runs
    (`pytestmark = pytest.mark.usefixtures("private_cache")`)."""
    from sdpagraph.cache import GraphCache, set_default_cache

    cache = GraphCache(str(tmp_path_factory.mktemp("graphs")))
    set_default_cache(cache)
    yield cache
    set_default_cache(None)
