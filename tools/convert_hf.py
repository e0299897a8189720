#!/usr/bin/env python
"""Exchange weights with Hugging Face GPT-2 (config.json + model.safetensors).

    python tools/convert_hf.py --direction import --hf-dir HF --save CKPT
    python tools/convert_hf.py --direction export --load CKPT --hf-dir HF

Import writes a weights-only megalite checkpoint (it loads under any layout; training
starts a fresh optimizer). Export takes any megalite checkpoint (any layout: pieces are
assembled) of the GPT-2 architecture. transformers is not needed for either direction.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from megalite.checkpoint import load_serial_model, save_weights_checkpoint  # noqa: E402
from megalite.checkpoint.hf import (hf_config_from, hf_state_from_megalite, megalite_state_from_hf,  # noqa: E402
                                    model_config_from_hf)
from megalite.model.gpt import GPTModel  # noqa: E402


def import_hf(hf_dir: str, save: str) -> str:
    config_path, weights_path = os.path.join(hf_dir, "config.json"), os.path.join(hf_dir, "model.safetensors")
    for path in (config_path, weights_path):
        if not os.path.exists(path):
            raise SystemExit(f"convert_hf: {path} is missing (a Hugging Face GPT-2 directory has config.json "
                             f"and model.safetensors; save with save_pretrained(..., safe_serialization=True))")
    cfg = model_config_from_hf(json.load(open(config_path)))
    model = GPTModel(cfg)
    state = megalite_state_from_hf(load_file(weights_path), cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            value = state[name]
            if name == "word_embeddings.weight":
                p.zero_()
                p[: value.shape[0]] = value
            else:
                p.copy_(value)
    return save_weights_checkpoint(save, model)


def export_hf(load: str, hf_dir: str) -> str:
    model = load_serial_model(load)
    os.makedirs(hf_dir, exist_ok=True)
    state = hf_state_from_megalite(dict(model.named_parameters()), model.cfg)
    save_file(state, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(hf_config_from(model.cfg), f, indent=2)
    return hf_dir


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--direction", choices=["import", "export"], required=True)
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--save", help="import: megalite checkpoint directory to write")
    p.add_argument("--load", help="export: megalite checkpoint directory to read")
    a = p.parse_args()
    if a.direction == "import":
        print(f"wrote {import_hf(a.hf_dir, a.save)}")
    else:
        print(f"wrote {export_hf(a.load, a.hf_dir)}")


if __name__ == "__main__":
    main()
