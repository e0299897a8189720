"""Mixture of experts with expert parallelism (issue #17, the core).

- :mod:`router`   top-k softmax router, load-balancing aux loss, z-loss, capacity dropping;
- :mod:`experts`  stacked expert MLP weights and the grouped matmul over sorted rows;
- :mod:`dispatch` sort / all-to-all / compute / all-to-all back / combine (serial and EP);
- :mod:`layer`    :class:`MoELayer`, the nn.Module tying them together.

Not yet here (see issue #17): GPT integration, pretrain flags, EP groups in the grid,
ZeRO / DDP treatment of expert parameters, checkpoints, planner.
"""
from megalite.moe.experts import GroupedExperts, grouped_mlp
from megalite.moe.layer import MoELayer
from megalite.moe.router import RouterOutput, TopKRouter

__all__ = ["GroupedExperts", "MoELayer", "RouterOutput", "TopKRouter", "grouped_mlp"]
