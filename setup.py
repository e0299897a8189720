"""megalite: a compact Megatron-style model-parallel trainer for GPT models.

The top-level ``kernels/`` folder is installed as ``megalite.kernels``: a package
on the registry already owns the top-level name ``kernels``.
"""
from setuptools import find_packages, setup

setup(
    name="megalite",
    version="0.1.0",
    description="Compact Megatron-style model-parallel GPT training with Triton kernels",
    python_requires=">=3.10",
    packages=find_packages(include=["megalite", "megalite.*"]) + ["megalite.kernels"],
    package_dir={"megalite.kernels": "kernels"},
    install_requires=[
        "torch==2.13.0",
        "triton==3.9.0",
        "numpy>=1.26",
        "sentencepiece==0.2.3",
        "safetensors>=0.4",
    ],
    extras_require={
        # GPU-only backends: never required, import-guarded, never in CI.
        "flash": ["flash-attn>=2.5"],
        "te": ["transformer-engine>=1.8"],
        "tensorboard": ["tensorboard>=2.14"],
        "dev": ["pytest>=8", "transformers>=4.40", "tensorboard>=2.14"],
    },
)
