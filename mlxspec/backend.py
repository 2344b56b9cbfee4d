"""Device and BLAS set-up, run before `mlx.core` is first imported.

Stock `mlx[cpu]` wheels on Linux link the reference BLAS, where a k-row matmul costs k times a
one-row matmul, so verifying k drafted tokens costs k decode steps and speculation cannot pay.
Loading a system OpenBLAS globally before MLX resolves its BLAS symbols fixes that.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

# What `setup_blas` found: "openblas:<path>", "reference", "accelerate", or "disabled".
blas_in_use = "unknown"
# Settings `setup_blas` could not follow (also printed on stderr, and by `mlxspec doctor`).
blas_warnings: list[str] = []


def _warn(message: str) -> None:
    blas_warnings.append(message)
    print(f"mlxspec: warning: {message}", file=sys.stderr)


def setup_blas() -> str:
    """Load OpenBLAS globally on Linux unless MLXSPEC_NO_OPENBLAS=1; return what is in use."""
    global blas_in_use
    if sys.platform == "darwin":
        blas_in_use = "accelerate"
        return blas_in_use
    if os.environ.get("MLXSPEC_NO_OPENBLAS", "") not in ("", "0"):
        blas_in_use = "reference (MLXSPEC_NO_OPENBLAS set)"
        return blas_in_use
    if "mlx.core" in sys.modules and blas_in_use == "unknown":
        # Too late: MLX already bound its BLAS symbols.
        blas_in_use = "reference (mlx imported before mlxspec)"
        _warn("mlx.core was imported before mlxspec, so MLX keeps the reference BLAS, where "
              "verifying k tokens costs k forwards; import mlxspec first")
        return blas_in_use
    asked = os.environ.get("MLXSPEC_BLAS", "")
    if asked:
        if not os.path.isfile(asked):
            _warn(f"MLXSPEC_BLAS={asked}: no such file; looking for the system OpenBLAS instead")
        else:
            try:
                ctypes.CDLL(asked, mode=ctypes.RTLD_GLOBAL)
                blas_in_use = f"openblas:{asked}"
                return blas_in_use
            except OSError as e:
                _warn(f"MLXSPEC_BLAS={asked} cannot be loaded ({e}); looking for the system "
                      "OpenBLAS instead")
    for path in OPENBLAS_CANDIDATES:
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            blas_in_use = f"openblas:{path}"
            return blas_in_use
    blas_in_use = "reference (install libopenblas0-pthread for fast verification)"
    return blas_in_use


def full_float32() -> None:
    """float32 matmuls in full precision unless the user asked otherwise (MLX_ENABLE_TF32). On
    CUDA (and Apple's M5 accelerators) MLX runs float32 products of 2+ rows in TF32 by default
    but a one-row product in float32: a verification forward then computes other logits than
    a plain step, and the output is no longer the model's own (seen on an H200: 20 of 47
    exactness tests failed). MLX reads the variable at its first such product."""
    os.environ.setdefault("MLX_ENABLE_TF32", "0")


def device_name() -> str:
    """'metal', 'cuda' or 'cpu': the backend MLX computes on."""
    import mlx.core as mx

    if mx.metal.is_available():
        return "metal"
    try:
        if mx.cuda.is_available():
            return "cuda"
    except AttributeError:
        pass
    return "cpu"


def compute_dtype():
    """float32 on the CPU backend (half and quantized matmuls skip BLAS there), else None (keep)."""
    import mlx.core as mx

    return mx.float32 if device_name() == "cpu" else None


def machine_info() -> dict:
    """What a benchmark result must record about the machine."""
    import mlx.core as mx

    try:
        import mlx_lm

        mlx_lm_version = mlx_lm.__version__
    except Exception:  # pragma: no cover - version lookup only
        mlx_lm_version = "unknown"
    info = {
        "backend": device_name(),
        "blas": blas_in_use,
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm_version,
        "platform": platform.platform(),
        "processor": _cpu_name(),
        "cpu_count": os.cpu_count(),
    }
    try:
        info["device"] = mx.device_info().get("device_name", "")
    except Exception:
        pass
    return info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def peak_memory_gb() -> float:
    import mlx.core as mx

    return mx.get_peak_memory() / 1e9


def reset_peak_memory() -> None:
    import mlx.core as mx

    mx.reset_peak_memory()
