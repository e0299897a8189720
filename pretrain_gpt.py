#!/usr/bin/env python
"""Pretrain a GPT with megalite.

    torchrun --nproc_per_node 2 pretrain_gpt.py --mock-data --vocab-size 1024 ...
    python pretrain_gpt.py --data-path data/corpus_text --tokenizer-model data/tok.model ...

Flags follow Megatron-LM's names; ``--help`` lists them all.
"""
import sys

from megalite.pretrain import main

if __name__ == "__main__":
    sys.exit(main())
