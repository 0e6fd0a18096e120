"""Every backend against the kernel layer's contract (``kernels/contract.py``): each
kernel it exposes has the reference's signature, and every kernel has a reference."""

from __future__ import annotations

import importlib

import pytest

from te_fuser.kernels import contract

BACKENDS = ["triton", "cuda"]


def test_every_kernel_has_a_reference():
    for kernel in contract.KERNELS:
        assert callable(contract.reference(kernel)), kernel


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_backend_exposes_kernels_with_the_references_signatures(backend):
    module = importlib.import_module(f"te_fuser.kernels.{contract.BACKEND_MODULES[backend]}")
    exposed = [k for k in contract.KERNELS if hasattr(module, k)]
    assert exposed, f"{backend} exposes no kernel"
    mismatches = [m for k in exposed if (m := contract.signature_mismatch(k, getattr(module, k))) is not None]
    assert not mismatches, f"{backend}: " + "; ".join(mismatches)


def test_the_dispatcher_serves_exactly_the_contracts_kernels():
    from te_fuser import backend

    assert backend.KERNELS is contract.KERNELS
    with pytest.raises(KeyError, match="no kernel named 'nope'"):
        contract.reference("nope")


def test_backend_folders_use_the_reference_file_names():
    """A kernel family lives in a file of the same name in every backend that has
    it (``cast.py``, ``gemm.py``, ``scaling.py``, ...): the reference's module names
    are the vocabulary; a backend may lack some, and keeps its private helpers in
    ``_``-files."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent / "kernels"
    reference = {p.stem for p in (root / "reference").glob("*.py") if not p.stem.startswith("_")}
    for backend in ("triton", "cuda"):
        files = {p.stem for p in (root / backend).glob("*.py") if not p.stem.startswith("_")}
        assert files - reference == set(), f"kernels/{backend}: files {sorted(files - reference)} have no reference"
