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
    # Ranges, not pins: a GPU machine keeps the CUDA torch and Triton it already has.
    # Supported: torch >= 2.5 (F.scaled_dot_product_attention(enable_gqa=...) is new in 2.5;
    # register_post_accumulate_grad_hook, all_gather_into_tensor and Module.to_empty are older)
    # and Triton >= 3.0 (the kernels pass tl.dot(input_precision=...), new in 3.0). Tested on
    # torch 2.13 + Triton 3.9 (CPU); the GPU test machine has torch 2.11 + Triton 3.6. On a
    # CPU-only machine install with constraints.txt (the torch==2.13.0 CPU wheel), or pip
    # picks a multi-GB CUDA build.
    install_requires=[
        "torch>=2.5",
        "triton>=3.0",
        "numpy>=1.26",
        "sentencepiece>=0.2.0",
        "safetensors>=0.4",
        "tqdm>=4.60",
    ],
    extras_require={
        # GPU-only backends: never required, import-guarded, never in CI.
        "flash": ["flash-attn>=2.5"],
        "te": ["transformer-engine[pytorch]>=2.0"],  # megalite's adapter follows the TE 2.x API
        "tensorboard": ["tensorboard>=2.14"],
        "hf": ["tokenizers>=0.15"],
        "wandb": ["wandb>=0.16"],
        "plots": ["matplotlib>=3.7"],
        "dev": ["pytest>=8", "transformers>=4.40", "tensorboard>=2.14"],
    },
)
