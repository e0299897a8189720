#!/usr/bin/env python
"""Exchange weights with Hugging Face: GPT-2, Llama (2, 3, 3.1/3.2), Qwen2, Qwen3, Mixtral, Qwen3-MoE and
DeepSeek-V3.

    python tools/convert_hf.py --direction import --hf-dir HF --save CKPT
    python tools/convert_hf.py --direction export --load CKPT --hf-dir HF

Import reads config.json and the safetensors (one file, or shards with their index) tensor
by tensor and writes a weights-only megalite checkpoint: it loads under any layout
(``--finetune`` starts a fresh optimizer at iteration 0). Export takes any megalite
checkpoint (any layout: pieces are assembled) and writes safetensors shards, the index,
config.json and generation_config.json that transformers loads as they are. Memory: one
layer at a time. transformers is not needed for either direction.

Special tokens and tokenizer: the import copies the tokenizer files (tokenizer.json,
tokenizer_config.json, special_tokens_map.json, tokenizer.model, ...) and generation_config.json
of HF into the checkpoint and records the bos/eos/pad ids; every later save (--finetune,
resume) carries them, and the export writes them back, so the exported model loads with
AutoTokenizer and generate() stops at EOS. Export refuses a folder that is not empty (exit 2,
nothing written) unless --force, and the folder the checkpoint was imported from always.
DeepSeek-V3's multi-token-prediction layers (model.layers.{num_hidden_layers + i}) come in as
megalite's --mtp-num-layers depths and go out again (docs/checkpoints.md).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.checkpoint.convert import export_hf, import_hf  # noqa: E402,F401
from megalite.checkpoint.format import CheckpointError  # noqa: E402
from megalite.checkpoint.hf_llama import UnsupportedModel  # noqa: E402
from tools.tool_errors import one_line_errors  # noqa: E402


def main(argv=None) -> int:
    p = one_line_errors(argparse.ArgumentParser(description=__doc__,
                                                formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--direction", choices=["import", "export"], required=True)
    p.add_argument("--hf-dir", required=True, help="the Hugging Face model directory (read or written)")
    p.add_argument("--save", help="import: megalite checkpoint directory to write")
    p.add_argument("--load", help="export: megalite checkpoint directory to read")
    p.add_argument("--seq-length", type=int, default=None,
                   help="import: the training sequence length to record (default: min(max positions, 4096))")
    p.add_argument("--model-type", choices=["gpt2", "llama", "qwen2", "mixtral", "deepseek_v3"], default=None,
                   help="export: the Hugging Face architecture (default: the one imported, else from the model)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="export: tensor dtype (default: the imported model's, else the training dtype)")
    p.add_argument("--max-shard-size-gb", type=float, default=5.0, help="export: bytes per safetensors shard")
    p.add_argument("--force", action="store_true",
                   help="export: write into a non-empty --hf-dir (its old weight files are removed; never the "
                        "folder the checkpoint was imported from)")
    a = p.parse_args(argv)
    needed = "save" if a.direction == "import" else "load"
    if getattr(a, needed) is None:
        p.error(f"--direction {a.direction} needs --{needed} DIR")
    try:
        if a.direction == "import":
            print(f"wrote {import_hf(a.hf_dir, a.save, a.seq_length)}")
        else:
            shard_bytes = int(a.max_shard_size_gb * 2**30)
            print(f"wrote {export_hf(a.load, a.hf_dir, a.model_type, a.dtype, shard_bytes, force=a.force)}")
    except (CheckpointError, UnsupportedModel, ValueError) as e:
        print(f"convert_hf: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a folder that cannot be read or written: one line naming it
        print(f"convert_hf: {e.filename}: {e.strerror}" if e.filename else f"convert_hf: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
