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


@pytest.fixture(scope="session")
def build_times():
    """Rows (graph kind, direction, seconds, blob bytes, workspace bytes); printed and saved under $OUT at the end."""
    rows = []
    yield rows
    if not rows:
        return
    print("\nbuild times:")
    for kind, direction, seconds, size, workspace in rows:
        print(f"  {kind:<28} {direction:<10} {seconds * 1e3:8.0f} ms  {size / 1024:6.1f} KiB  ws {workspace}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "build_times.json"), "w") as out:
            json.dump(rows, out, indent=1)
