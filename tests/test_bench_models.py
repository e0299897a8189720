"""tools/bench_models.py in its quick mode: a DeepSeek-V3-tiny and a Llama of equal active
parameters per token (counted by megalite.model.counting) train side by side in one process;
the report carries both counts, both tokens/s, the ratio and the one flops_per_token."""
import os
import sys

import pytest

from megalite.model.counting import active_parameters, flops_per_token, total_parameters
from megalite.moe.settings import moe_layers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import bench_models  # noqa: E402


def test_quick_mode_trains_both_models_of_equal_active_parameters(capsys):
    results = bench_models.main(["--quick"])
    out = capsys.readouterr().out
    deepseek, llama = results["DeepSeek-V3-tiny"], results["Llama"]
    assert abs(deepseek["active_parameters"] / llama["active_parameters"] - 1) < 1e-3
    assert deepseek["active_parameters"] < deepseek["total_parameters"]  # the experts a token skips
    a = bench_models.parse(["--quick"])
    lines = bench_models.command_lines(a)
    for name, r in results.items():
        m = bench_models.config_of(lines[name]).model
        assert r["flops_per_token"] == flops_per_token(m) and r["total_parameters"] == total_parameters(m)
        assert r["active_parameters"] == active_parameters(m) and r["tokens_per_s"] > 0
        assert f"{r['active_parameters']:,}" in out
    m = bench_models.config_of(lines["DeepSeek-V3-tiny"]).model
    assert m.multi_latent_attention and m.rope_scaling["rope_type"] == "yarn" and moe_layers(m) == [0] + [1] * (m.num_layers - 1)
    assert m.moe_shared_expert_intermediate_size and m.moe_router_enable_expert_bias
    assert f"tokens/s DeepSeek-V3-tiny / Llama: {deepseek['tokens_per_s'] / llama['tokens_per_s']:.2f}" in out


@pytest.mark.parametrize("argv,message", [(["--layers", "1"], "needs 2 or more"),
                                          (["--hidden", "40"], "must divide by 16"),
                                          (["--micro", "3"], "multiple of --micro")])
def test_bad_input_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        bench_models.parse(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
