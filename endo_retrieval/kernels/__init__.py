"""Triton kernels, each beside the plain torch twin it is tested against; imported as endo_retrieval.kernels.*"""
from __future__ import annotations

import warnings

_failed: set[str] = set()


def kernel_or_twin(name: str, kernel, twin, *args):
    """`kernel(*args)`; a kernel that fails to compile on this GPU / Triton version warns once, and `twin` serves
    from then on."""
    if name not in _failed:
        try:
            return kernel(*args)
        except Exception as e:  # compile errors surface as many exception types across Triton versions
            _failed.add(name)
            warnings.warn(f"Triton {name} kernel failed ({type(e).__name__}: {e}); using the torch twin.")
    return twin(*args)
