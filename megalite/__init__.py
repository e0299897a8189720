"""megalite: a compact Megatron-style model-parallel trainer for GPT models."""
__version__ = "0.1.0"


def _kernels_from_source_checkout() -> None:
    """Make ``megalite.kernels`` importable from a plain source checkout.

    setup.py installs the top-level ``kernels/`` folder as ``megalite.kernels``
    (``package_dir``); a regular install finds it on its own. With only the repository on
    ``PYTHONPATH`` (no ``pip install``: e.g. a GPU machine without network), or when an
    editable install's finder does not map a folder without ``__init__.py``, nothing finds it,
    so register ``<repo>/kernels`` under that name here, as the namespace package it is.
    The folder has no ``__init__.py`` on purpose (kernels/README.md): a regular package there
    would shadow the registry's top-level ``kernels`` for anything run from the checkout.
    This compiles no kernel: each kernel module compiles its own at import.
    """
    import importlib.machinery
    import importlib.util
    import os
    import sys

    if "megalite.kernels" in sys.modules or importlib.util.find_spec("megalite.kernels") is not None:
        return
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")
    if not os.path.isdir(folder):
        return
    spec = importlib.machinery.ModuleSpec("megalite.kernels", None, is_package=True)
    spec.submodule_search_locations = [folder]
    module = importlib.util.module_from_spec(spec)
    module.__doc__ = "megalite's Triton kernels (torch and triton only): see kernels/README.md."
    sys.modules["megalite.kernels"] = module
    globals()["kernels"] = module  # what an import of the subpackage binds on its parent


_kernels_from_source_checkout()
