"""The answer to "will this config run on cuDNN here, and if not, why?"."""
from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("cudnn", "xla", "small_seq")


@dataclass(frozen=True)
class Support:
    """`supported`: cuDNN runs this config. `backend`: what `attention` will use. `reason`: why."""

    supported: bool
    backend: str
    reason: str

    def __bool__(self) -> bool:
        return self.supported


def environment_reason() -> str | None:
    """Why cuDNN cannot be used in this process at all, or None when it can be tried."""
    import jax

    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        return "no GPU visible to JAX (jax.devices('gpu') is empty)"
    try:
        import cudnn  # noqa: F401  (nvidia-cudnn-frontend)
    except ImportError:
        return "cudnn frontend not installed (pip install 'sdpagraph[cuda]')"
    return None
