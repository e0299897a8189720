"""Mixture of experts with expert parallelism.

- :mod:`router`   top-k router, load-balancing aux loss, z-loss, capacity dropping;
- :mod:`scoring`  softmax / sigmoid scores, group-limited top-k, normalised and scaled weights;
- :mod:`balancing` aux-loss-free balancing: the expert bias and its update after each step;
- :mod:`experts`  stacked expert MLP weights and the grouped matmul over sorted rows;
- :mod:`dispatch` sort / all-to-all / compute / all-to-all back / combine (serial and EP);
- :mod:`layer`    :class:`MoELayer`, the nn.Module tying them together;
- :mod:`block`    the MoE MLP inside a GPT block (sequence/context parallel input, aux losses);
- :mod:`settings` which layers are MoE and the rules of the MoE flags (called by config);
- :mod:`stats`    per-step MoE figures for the log line;
- :mod:`planning` the MoE arithmetic of the layout planner.

None of these imports the model (:mod:`megalite.model` imports them).
"""
from megalite.moe.experts import GroupedExperts, grouped_mlp
from megalite.moe.layer import MoELayer
from megalite.moe.router import RouterOutput, TopKRouter

__all__ = ["GroupedExperts", "MoELayer", "RouterOutput", "TopKRouter", "grouped_mlp"]
