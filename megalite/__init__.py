"""megalite: a compact Megatron-style model-parallel trainer for GPT models."""
__version__ = "0.1.0"


def _kernels_from_source_checkout() -> None:
    """Make ``megalite.kernels`` importable from a plain source checkout.

    setup.py installs the top-level ``kernels/`` folder as ``megalite.kernels``
    (``package_dir``); a regular or editable install finds it on its own. With only the
    repository on ``PYTHONPATH`` (no ``pip install``: e.g. a GPU machine without network)
    nothing maps it, so register ``<repo>/kernels`` under that name here. Its
    ``__init__`` holds only a docstring: this compiles no kernel.
    """
    import importlib.util
    import os
    import sys

    if "megalite.kernels" in sys.modules or importlib.util.find_spec("megalite.kernels") is not None:
        return
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels")
    init = os.path.join(folder, "__init__.py")
    if not os.path.isfile(init):
        return
    spec = importlib.util.spec_from_file_location("megalite.kernels", init,
                                                  submodule_search_locations=[folder])
    module = importlib.util.module_from_spec(spec)
    sys.modules["megalite.kernels"] = module
    spec.loader.exec_module(module)


_kernels_from_source_checkout()
