#!/usr/bin/env python
"""Pretrain a GPT with megalite.

    torchrun --nproc_per_node 2 pretrain_gpt.py --mock-data --vocab-size 1024 ...
    python pretrain_gpt.py --data-path data/corpus_text --tokenizer-model data/tok.model ...

Flags follow Megatron-LM's names; ``--help`` lists them all. Expected failures (configuration,
input, divergence, timeouts) end with one ``megalite:`` message and an exit code; anything else
is recorded by torch's ``record`` so torchrun's failure summary shows its traceback.
"""
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from megalite.train.pretrain import main

if __name__ == "__main__":
    sys.exit(record(main)())
