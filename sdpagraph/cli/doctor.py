"""`sdpagraph doctor`: what this installation has, and whether attention runs on cuDNN here.

One line per item: sdpagraph, python, jax, jaxlib, the jax CUDA plugin, GPUs, CUDA, the cuDNN
backend (the libcudnn loaded in this process), the cuDNN frontend, the C++ executor (built? loads?
where, or why not), the graph cache (directory and mode), then the verdict: "cuDNN path ready", or
"attention runs on XLA here because ..." with the same reason `check_support` gives.

    sdpagraph doctor [--json]

Exit 0 whenever it could report (problems are reported, not failed on); a probe that raises is
reported as that item's error.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
from typing import Any, Callable

# Distributions whose versions say which CUDA and cuDNN wheels this environment has.
_CUDA_PLUGINS = ("jax-cuda13-plugin", "jax-cuda12-plugin")
_CUDA_RUNTIMES = ("nvidia-cuda-runtime", "nvidia-cuda-runtime-cu13", "nvidia-cuda-runtime-cu12")
_CUDNN_WHEELS = ("nvidia-cudnn-cu13", "nvidia-cudnn-cu12")
_FRONTEND = "nvidia-cudnn-frontend"
READY = "cuDNN path ready"


def add_doctor_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "doctor", help="versions, GPU, executor and cache here, and whether attention runs on cuDNN",
        description="Report the versions (jax, jaxlib, CUDA, cuDNN backend and frontend), the GPUs, whether "
                    "the C++ executor is built and loads, the cache directory and mode, and whether "
                    "attention runs on cuDNN here (and why not). Exit 0 whenever it could report.")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    parser.set_defaults(handler=lambda args: run_doctor(as_json=args.json))


def run_doctor(as_json: bool = False) -> int:
    report = collect()
    if as_json:
        print(json.dumps({name: item for name, item in report.items()}, indent=2))
    else:
        width = max(len(item["label"]) for item in report.values())
        for item in report.values():
            print(f"{item['label']:<{width}}  {item['text']}")
    return 0


def collect() -> dict[str, dict[str, Any]]:
    """Every item of the report: {name: {"label", "text", ...item fields}}, in print order."""
    report: dict[str, dict[str, Any]] = {}
    for name, label, probe in _ITEMS:
        try:
            fields = probe()
        except Exception as error:  # noqa: BLE001 - the doctor reports what it cannot find
            fields = {"error": f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"}
            fields["text"] = f"could not tell ({fields['error']})"
        report[name] = {"label": label, **fields}
    return report


# ----------------------------------------------------------------------------------- the items

def _distribution_version(*names: str) -> tuple[str, str] | None:
    """(name, version) of the first of `names` that is installed, or None."""
    for name in names:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _sdpagraph() -> dict[str, Any]:
    import sdpagraph

    path = os.path.dirname(sdpagraph.__file__)
    fields: dict[str, Any] = {"version": sdpagraph.__version__, "path": path}
    text = f"{sdpagraph.__version__} ({path})"
    try:
        installed = importlib.metadata.distribution("sdpagraph")
        installed_path = os.path.realpath(str(installed.locate_file("sdpagraph")))
        fields["installed"] = {"version": installed.version, "path": installed_path}
        if installed_path != os.path.realpath(path):
            text += f"; installed distribution {installed.version} at {installed_path}"
    except importlib.metadata.PackageNotFoundError:
        fields["installed"] = None
        text += "; not installed (running from a checkout)"
    return {**fields, "text": text}


def _python() -> dict[str, Any]:
    version, machine = platform.python_version(), f"{platform.system()} {platform.machine()}"
    return {"version": version, "executable": sys.executable, "platform": machine,
            "text": f"{version} ({sys.executable}), {machine}"}


def _jax() -> dict[str, Any]:
    import jax

    return {"version": jax.__version__, "text": jax.__version__}


def _jaxlib() -> dict[str, Any]:
    import jaxlib.version

    return {"version": jaxlib.version.__version__, "text": jaxlib.version.__version__}


def _cuda_plugin() -> dict[str, Any]:
    found = _distribution_version(*_CUDA_PLUGINS)
    if found is None:
        return {"plugin": None, "text": "none installed (for a GPU: `pip install 'jax[cuda13]'` or `'jax[cuda12]'`)"}
    return {"plugin": found[0], "version": found[1], "text": f"{found[0]} {found[1]}"}


def _gpus() -> list[Any]:
    import jax

    try:
        return list(jax.devices("gpu"))
    except RuntimeError:
        return []


def _gpu() -> dict[str, Any]:
    import jax

    try:
        devices = jax.devices("gpu")
    except RuntimeError as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return {"devices": [], "text": f"none (jax.devices('gpu'): {first_line[:200]})"}
    if not devices:
        return {"devices": [], "text": "none"}
    names = [f"{d.device_kind} (sm{str(getattr(d, 'compute_capability', '?')).replace('.', '')})" for d in devices]
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    return {"devices": names, "text": ", ".join(f"{n} x {name}" for name, n in counts.items())}


def _cuda() -> dict[str, Any]:
    fields: dict[str, Any] = {}
    parts = []
    gpus = _gpus()
    if gpus:
        fields["platform_version"] = str(gpus[0].client.platform_version)
        parts.append(f"jax GPU backend: {fields['platform_version']}")
    runtime = _distribution_version(*_CUDA_RUNTIMES)
    fields["runtime_wheel"] = None if runtime is None else f"{runtime[0]} {runtime[1]}"
    if runtime is not None:
        parts.append(f"runtime wheel {runtime[0]} {runtime[1]}")
    return {**fields, "text": "; ".join(parts) if parts else "not found (no GPU backend, no CUDA runtime wheel)"}


def _cudnn() -> dict[str, Any]:
    from sdpagraph.graphs import builder

    fields: dict[str, Any] = {"loaded": None}
    parts = []
    if _gpus():
        try:  # the version graphs are built and keyed with (the libcudnn JAX loaded, else the frontend's)
            fields["loaded"] = builder.build_environment().cudnn_version
        except Exception as error:  # noqa: BLE001
            fields["error"] = f"{type(error).__name__}: {error}"
    else:
        loaded = builder._loaded_cudnn_version()
        if loaded is not None:
            fields["loaded"] = f"{loaded // 10000}.{loaded % 10000 // 100}.{loaded % 100}"
    parts.append(f"backend {fields['loaded']}" if fields["loaded"] else
                 f"no backend loaded ({fields.get('error') or 'libcudnn is not loaded in this process'})")
    wheel = _distribution_version(*_CUDNN_WHEELS)
    fields["wheel"] = None if wheel is None else f"{wheel[0]} {wheel[1]}"
    if wheel is not None:
        parts.append(f"wheel {wheel[0]} {wheel[1]}")
    return {**fields, "text": "; ".join(parts)}


def _frontend() -> dict[str, Any]:
    found = _distribution_version(_FRONTEND)
    if found is None:
        return {"version": None, "text": "not installed (`pip install 'sdpagraph[cuda]'`: needed to build graphs)"}
    return {"version": found[1], "text": found[1]}


def _executor() -> dict[str, Any]:
    from sdpagraph.ffi import loader

    path = loader.library_path()
    status = loader.build_status(path.parent)  # what the build that made (or skipped) it said
    library = loader.load()
    reason = loader.unavailable_reason()
    fields: dict[str, Any] = {"path": str(path), "exists": path.is_file(), "loads": library is not None,
                              "reason": reason, "version": None if library is None else library.version,
                              "build_status": status}
    if library is not None:
        compiler = f", compiled by {status['compiler']}" if status and status.get("compiler") else ""
        text = f"built, loads: {path} ({library.version}{compiler})"
    elif path.is_file():
        text = f"built, does not load: {reason}"
    else:
        text = f"not built: {reason}"
    return {**fields, "text": text}


def _cache() -> dict[str, Any]:
    from sdpagraph.config import CACHE_DIR, CACHE_MAX_BYTES, CACHE_MODE

    directory = CACHE_DIR.get()
    try:
        mode = mode_text = CACHE_MODE.get()
    except ValueError as error:
        mode = None
        mode_text = f"invalid: {error}"
    try:
        max_bytes = CACHE_MAX_BYTES.get()
        size_text = f"max {max_bytes / 1024**3:.3g} GiB"
    except ValueError as error:
        max_bytes, size_text = None, f"max bytes invalid: {error}"
    exists = os.path.isdir(directory)
    text = (f"{directory} (mode {mode_text}, {size_text}"
            f"{'' if exists else ', does not exist yet'})")
    return {"directory": directory, "mode": mode, "max_bytes": max_bytes, "exists": exists, "text": text}


def _verdict() -> dict[str, Any]:
    from sdpagraph import ffi
    from sdpagraph.graphs.support import environment_reason

    # The same order as the cuDNN backend's support(): check_support says the same.
    reason = environment_reason() or ffi.unavailable_reason()
    if reason is None:
        return {"cudnn_ready": True, "reason": None,
                "text": f"{READY} (each call still needs a graph cuDNN supports: `sdpagraph check`)"}
    return {"cudnn_ready": False, "reason": reason, "text": f"attention runs on XLA here because {reason}"}


_ITEMS: list[tuple[str, str, Callable[[], dict[str, Any]]]] = [
    ("sdpagraph", "sdpagraph", _sdpagraph),
    ("python", "python", _python),
    ("jax", "jax", _jax),
    ("jaxlib", "jaxlib", _jaxlib),
    ("jax_cuda_plugin", "jax CUDA plugin", _cuda_plugin),
    ("gpu", "GPU", _gpu),
    ("cuda", "CUDA", _cuda),
    ("cudnn", "cuDNN", _cudnn),
    ("cudnn_frontend", "cuDNN frontend", _frontend),
    ("executor", "executor", _executor),
    ("cache", "cache", _cache),
    ("verdict", "verdict", _verdict),
]
