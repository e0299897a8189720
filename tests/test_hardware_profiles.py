"""Hardware profiles (megalite/planner/hardware.py) and the calibration tool (tools/calibrate_hardware.py).

The built-ins are checked against the datasheets' figures written out here by hand (not read from
the module), halving NVIDIA's bidirectional NVLink figure and turning InfiniBand's Gb/s into GB/s;
``plan_parallel.py --hardware`` against the Hardware it hands the planner; the calibration's fit
against data made from a known latency and bandwidth, and the tool itself on a 2-rank gloo world.
"""
from __future__ import annotations

import json

import pytest

from megalite.planner import Hardware
from megalite.planner.hardware import (PROFILES, ProfileError, hardware_from_profile, load_profile,
                                       measured_collective, read_profile, write_profile)
from tools import calibrate_compute, calibrate_links
from tools import calibrate_hardware as cal
from tools import plan_parallel

# name: (GiB, dense bf16 TFLOP/s, HBM GB/s, NVLink GB/s one direction, InfiniBand GB/s per GPU)
DATASHEETS = {
    "h100-sxm": (80, 989, 3350, 900 / 2, 400 / 8),  # 1,979 sparse; 3.35 TB/s; NVLink 900 GB/s; NDR 400 Gb/s
    "h200": (141, 989, 4800, 900 / 2, 400 / 8),  # 141 GB HBM3e, 4.8 TB/s
    "a100-80gb": (80, 312, 2039, 600 / 2, 200 / 8),  # 624 sparse; 2,039 GB/s; NVLink 600 GB/s; HDR 200 Gb/s
    "b200": (1440 / 8, 36000 / 8 / 2, 64000 / 8, 1800 / 2, 400 / 8),  # DGX B200: 1,440 GB, 36 PF sparse, 64 TB/s
}
MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "256",
         "--vocab-size", "1000", "--global-batch-size", "8"]


@pytest.mark.parametrize("name", sorted(DATASHEETS))
def test_builtin_profile_has_the_datasheet_figures_and_a_source_for_each(name):
    hw = hardware_from_profile(name)
    memory, peak, hbm, nvlink, ib = DATASHEETS[name]
    assert (hw.gpu_memory_gb, hw.peak_tflops, hw.hbm_gbps, hw.nvlink_gbps, hw.ib_gbps) == pytest.approx(
        (memory, peak, hbm, nvlink, ib))
    assert hw.gpus_per_node == 8 and hw.nodes == 1 and hw.name == name
    assert hw.achieved_tflops == pytest.approx(0.40 * peak, abs=0.05)  # Megatron's ~40-47% MFU
    assert 0 < hw.nvlink_latency_us < hw.ib_latency_us
    sources = read_profile(name)["sources"]
    assert all(sources.get(k) for k in load_profile(name) if k != "name"), "every figure names its source"
    assert "http" in sources["peak_tflops"]


def test_profile_names_ignore_case_and_take_the_common_aliases():
    assert load_profile("H100") == load_profile("h100-sxm") and load_profile("A100") == load_profile("a100-80gb")
    assert set(PROFILES) == set(DATASHEETS)


def planned_hardware(monkeypatch, argv) -> Hardware:
    """The Hardware plan_parallel.main hands the planner (the search itself is stopped there)."""
    seen = {}

    def stop(m, hw, *args, **kwargs):
        seen["hw"] = hw
        raise KeyboardInterrupt

    monkeypatch.setattr(plan_parallel, "plan", stop)
    with pytest.raises(KeyboardInterrupt):
        plan_parallel.main(MODEL + argv)
    return seen["hw"]


def test_hardware_flag_fills_the_plans_inputs_and_explicit_flags_win(monkeypatch):
    h200 = planned_hardware(monkeypatch, ["--hardware", "h200"])
    assert h200 == Hardware(141, 8, 1, 450, 50, 0.10, 395.6, 989, 4800, 10, 20, "h200")
    mine = planned_hardware(monkeypatch, ["--hardware", "h200", "--gpu-memory-gb", "100", "--nvlink-gbps", "123",
                                          "--nodes", "2", "--peak-tflops", "900", "--ib-latency-us", "7"])
    given = (mine.gpu_memory_gb, mine.nvlink_gbps, mine.nodes, mine.peak_tflops, mine.ib_latency_us)
    assert given == (100, 123, 2, 900, 7)
    assert mine.hbm_gbps == 4800 and mine.ib_gbps == 50  # the rest still the profile's
    # without --hardware a command line means what it meant: Hardware's defaults (an H100 SXM)
    assert planned_hardware(monkeypatch, ["--gpu-memory-gb", "80"]) == Hardware(80, 8)


def test_a_profile_file_round_trips(tmp_path, monkeypatch):
    figures = {"gpu_memory_gb": 12.5, "gpus_per_node": 4, "peak_tflops": 1.5, "achieved_tflops": 0.75,
               "hbm_gbps": 20, "nvlink_gbps": 2.5, "ib_gbps": 1.25, "nvlink_latency_us": 300, "ib_latency_us": 900}
    path = tmp_path / "mine.json"
    write_profile(str(path), "mine", figures, {k: "by hand" for k in figures}, {"note": "kept"})
    assert load_profile(str(path)) == {"name": "mine", **figures}
    assert read_profile(str(path))["measured"] == {"note": "kept"}
    assert planned_hardware(monkeypatch, ["--hardware", str(path)]) == Hardware(**{"name": "mine", **figures})
    (tmp_path / "h200.json").write_text(json.dumps(PROFILES["h200"]))  # a built-in written out reads the same
    assert load_profile(str(tmp_path / "h200.json")) == load_profile("h200")


@pytest.mark.parametrize("content, message", [
    (None, "is unknown: the built-in ones are a100-80gb, b200, h100-sxm, h200"),
    ("{not json", "is not valid JSON"),
    ('{"name": "x"}', "is not a hardware profile: it needs a JSON object with a 'hardware' object"),
    ('{"hardware": {"gpu_memory_gb": 80}}', "'hardware' lacks gpus_per_node, peak_tflops"),
    ('{"hardware": {"gpu_memory_gb": 80, "nvlink": 1}}', "unknown field(s) nvlink in 'hardware'"),
    (json.dumps({"hardware": {**PROFILES["h200"]["hardware"], "hbm_gbps": -1}}), "hbm_gbps must be a positive number"),
    (json.dumps({"hardware": {**PROFILES["h200"]["hardware"], "nodes": 2}}), "unknown field(s) nodes"),
    (json.dumps({"hardware": {**PROFILES["h200"]["hardware"], "overlap_cost": 1.5}}),
     "overlap_cost must be a number from 0 to 1"),
    ("missing", "does not exist"),
])
def test_bad_profile_is_one_message(tmp_path, capsys, content, message):
    arg = "h300"
    if content is not None:
        arg = str(tmp_path / "bad.json")
        if content != "missing":
            (tmp_path / "bad.json").write_text(content)
    with pytest.raises(ProfileError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_profile(arg)
    with pytest.raises(SystemExit) as exit_:
        plan_parallel.main(MODEL + ["--hardware", arg])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and message in err


def test_gpu_memory_is_required_only_without_a_profile(capsys):
    with pytest.raises(SystemExit):
        plan_parallel.main(MODEL)
    assert "--gpu-memory-gb is required without --hardware" in capsys.readouterr().err


def test_measured_collective_reads_the_nearest_group(tmp_path):
    fits = {"2": {"latency_us": 300, "gbps": 1.5, "points": []}, "8": {"latency_us": 9000, "gbps": 0.5, "points": []}}
    path = str(tmp_path / "m.json")
    write_profile(path, "m", load_profile("h100-sxm"), {}, {"collectives": {"all_reduce": fits}})
    nearest = [measured_collective(path, "all_reduce", n)["ranks"] for n in (1, 2, 3, 4, 5, 8, 64)]
    assert nearest == [2, 2, 2, 2, 8, 8, 8]
    assert measured_collective(path, "all_reduce", 8) == {"ranks": 8, "latency_us": 9000, "gbps": 0.5}
    with pytest.raises(ProfileError, match="has no measured all_to_all"):
        measured_collective(path, "all_to_all", 2)
    with pytest.raises(ProfileError, match="has no measured all_reduce"):
        measured_collective("h200", "all_reduce", 2)


def test_one_rank_calibration_keeps_the_default_links_and_says_so(tmp_path, capsys):
    out = tmp_path / "one.json"
    assert cal.main(["--quick", "--max-ranks", "1", "--output", str(out)]) == 0  # no world: matmuls and a copy
    doc, hw = read_profile(str(out)), hardware_from_profile(str(out))
    assert (hw.nvlink_gbps, hw.ib_gbps, hw.gpus_per_node) == (Hardware.nvlink_gbps, Hardware.ib_gbps, 1)
    assert doc["sources"]["nvlink_gbps"].startswith("not measured") and doc["measured"]["collectives"] == {}
    assert 0 < hw.achieved_tflops <= hw.peak_tflops and hw.hbm_gbps > 0
    with pytest.raises(SystemExit):
        cal.main(["--quick", "--link-ranks", "4", "--output", str(out)])
    assert "--link-ranks 4 is not a group size measured here ([2])" in capsys.readouterr().err


def test_wire_bytes_and_gemm_shapes_by_hand():
    assert [cal.wire_bytes(k, 1000, 4) for k in calibrate_links.COLLECTIVES] == [1500, 750, 750, 750, 1000]
    # b 2, s 8, h 16, 4 heads (d 4), TP 2: tokens 16
    assert cal.layer_gemms(16, 8, 2, 4, 2) == [("qkv", 1, 16, 16, 24), ("proj", 1, 16, 8, 16), ("fc1", 1, 16, 16, 32),
                                               ("fc2", 1, 16, 32, 16), ("scores", 4, 8, 4, 8),
                                               ("context", 4, 8, 8, 4)]


def test_fit_recovers_a_known_latency_and_bandwidth():
    wire = [1e3, 1e4, 1e5, 1e6, 1e7]
    latency, bandwidth = cal.fit_latency_bandwidth(wire, [250e-6 + w / 2e9 for w in wire])
    assert latency == pytest.approx(250e-6, rel=1e-9) and bandwidth == pytest.approx(2e9, rel=1e-9)
    # the small messages below the line of the large ones would fit a negative latency: clamped to 0,
    # the slope refitted through the origin (weights 1/t: sum x t / t / sum x^2 / t)
    wire, seconds = [1e3, 1e6, 2e6], [1e-6, 1e-3, 3e-3]
    latency, bandwidth = cal.fit_latency_bandwidth(wire, seconds)
    assert latency == 0 and bandwidth == pytest.approx(sum(x * x / t for x, t in zip(wire, seconds)) / sum(wire))
    # a time that does not grow with the size: no bandwidth to measure, all latency (the mean, weights 1/t)
    latency, bandwidth = cal.fit_latency_bandwidth([1e3, 1e6], [2e-3, 1e-3])
    assert latency == pytest.approx(2 / (1 / 2e-3 + 1 / 1e-3)) and bandwidth >= 1e17


@pytest.mark.slow
def test_calibration_writes_a_profile_whose_fit_reproduces_its_measurements(tmp_path):
    out = tmp_path / "cpu.json"
    assert cal.main(["--quick", "--output", str(out), "--sizes", "1024", "65536", "1048576", "--name", "t"]) == 0
    doc, hw = read_profile(str(out)), hardware_from_profile(str(out))
    fits = doc["measured"]["collectives"]
    assert set(fits) == set(calibrate_links.COLLECTIVES) and all(set(f) == {"2"} for f in fits.values())
    assert hw.gpus_per_node == 2 and hw.name == "t" and hw.achieved_tflops <= hw.peak_tflops
    assert [r["name"] for r in doc["measured"]["matmul"]] == ["qkv", "proj", "fc1", "fc2", "scores", "context",
                                                              "square"]
    errors = []
    for kind, by_n in fits.items():
        f = by_n["2"]
        wire = [p[1] for p in f["points"]]
        assert wire == [cal.wire_bytes(kind, p[0], 2) for p in f["points"]]
        latency, bandwidth = cal.fit_latency_bandwidth(wire, [p[2] for p in f["points"]])
        assert (latency * 1e6, bandwidth / 1e9) == pytest.approx((f["latency_us"], f["gbps"]))
        for _, w, measured, fitted in f["points"]:
            assert fitted == pytest.approx(latency + w / bandwidth)
            errors.append(abs(fitted - measured) / measured)
    assert sorted(errors)[len(errors) // 2] < 0.5, errors  # noisy shared CPU: a generous bound on the median
    median_link = sorted(fits[k]["2"]["gbps"] for k in cal.LINK_COLLECTIVES)[1]
    assert hw.nvlink_gbps == pytest.approx(median_link) and hw.ib_gbps == hw.nvlink_gbps
    overlap = doc["measured"]["overlap"]["2"]  # GEMMs with an all-reduce in flight: 5 rounds' median
    after = doc["measured"]["after_compute"]["2"]  # a call after compute: measured, the latency only if asked
    assert len(after["rounds"]) == 5 and after["seconds"] == sorted(after["rounds"])[2]
    median_latency = sorted(fits[k]["2"]["latency_us"] for k in cal.LINK_COLLECTIVES)[1]
    assert hw.nvlink_latency_us == pytest.approx(max(median_latency, 0.1))  # --latency fit, the default
    assert hw.overlap_cost == overlap["overlap_cost"] and 0 <= hw.overlap_cost <= 1 and len(overlap["rounds"]) == 5
    assert cal.main(["--quick", "--output", str(out), "--sizes", "1024", "65536", "--latency", "after-compute"]) == 0
    doc, hw = read_profile(str(out)), hardware_from_profile(str(out))
    after = doc["measured"]["after_compute"]["2"]
    assert hw.nvlink_latency_us == pytest.approx(max(0.1, (after["seconds"] - 2048 / (hw.nvlink_gbps * 1e9)) * 1e6))


def test_overlap_cost_loads_from_0_to_1_and_older_profiles_keep_the_default(tmp_path):
    """A profile may state the overlap cost (0 to 1, 0 allowed: a collective that costs compute
    nothing); one without it (the built-ins, docs/profiles/*.json of before) takes Hardware's 0.10."""
    import glob
    import os
    for path in glob.glob(os.path.join(os.path.dirname(__file__), "..", "docs", "profiles", "*.json")):
        stated = read_profile(path)["hardware"].get("overlap_cost")  # a recalibrated profile states its own
        assert hardware_from_profile(path).overlap_cost == (Hardware.overlap_cost if stated is None else stated)
    assert Hardware.overlap_cost == 0.10
    assert all(hardware_from_profile(name).overlap_cost == 0.10 for name in PROFILES)
    for cost in (0, 0.35, 1):
        path = tmp_path / f"o{cost}.json"
        path.write_text(json.dumps({"hardware": {**PROFILES["h200"]["hardware"], "overlap_cost": cost}}))
        assert hardware_from_profile(str(path)).overlap_cost == cost


def test_overlap_cost_by_hand():
    """(together - GEMMs) / all-reduce, clipped to [0, 1]; the profile takes the link group's median
    over rounds (measure_overlap) and says where it comes from."""
    assert calibrate_links.overlap_cost_of(10.0, 4.0, 13.0) == 0.75
    assert calibrate_links.overlap_cost_of(10.0, 4.0, 10.0) == 0  # hidden entirely: the GEMMs took no longer
    assert calibrate_links.overlap_cost_of(10.0, 4.0, 9.0) == 0 and calibrate_links.overlap_cost_of(10.0, 4.0, 20.0) == 1  # noise: clipped
    fits = {k: {"2": {"gbps": 1.0, "latency_us": 100.0}} for k in cal.LINK_COLLECTIVES}
    gemms = [{"name": "qkv", "flops": 2e12, "seconds": 1.0, "tflops": 2.0}]
    overlap = {"2": {"tensor_bytes": 1024, "overlap_cost": 0.6}}
    hw, sources = cal.profile_figures(fits, gemms, 10.0, 2, 8.0, "test", overlap=overlap)
    assert hw["overlap_cost"] == 0.6 and "all-reduce of 1024 bytes in flight" in sources["overlap_cost"]
    hw, sources = cal.profile_figures(fits, gemms, 10.0, 2, 8.0, "test")
    assert "overlap_cost" not in hw  # not measured: the planner keeps Hardware's default
    assert hw["nvlink_latency_us"] == 100.0 and sources["nvlink_latency_us"].startswith("measured: the median fit")


def test_latency_is_a_call_after_compute_less_its_wire_time():
    """The profile's latency: the all-gather issued after compute (measure_call_after_compute's
    median), less its wire bytes at the fitted bandwidth; the fits' intercept said beside it."""
    fits = {k: {"2": {"gbps": 1.0, "latency_us": 100.0}} for k in cal.LINK_COLLECTIVES}
    gemms = [{"name": "qkv", "flops": 2e12, "seconds": 1.0, "tflops": 2.0}]
    after = {"2": {"tensor_bytes": 4096, "rounds": [3e-3, 2e-3, 1e-3, 2e-3, 9e-3], "seconds": 2e-3}}
    hw, sources = cal.profile_figures(fits, gemms, 10.0, 2, 8.0, "test", after_compute=after)
    assert hw["nvlink_latency_us"] == hw["ib_latency_us"] == pytest.approx((2e-3 - 2048 / 1e9) * 1e6)
    assert "issued after compute" in sources["nvlink_latency_us"] and "(100 us)" in sources["nvlink_latency_us"]


def test_cp_blocks_by_hand():
    """A causal CP 2 rank holds chunks r and 3 - r of 4 and attends every key chunk not after its query
    chunk: the 10 such pairs split 5 and 5; the rate counts the planner's attention FLOPs of a rank
    (3 x 4 b heads d s^2 / CP) over the blocks' time, and the profile takes it."""
    import torch
    assert calibrate_compute.cp_block_pairs(0, 2) == [(0, 0, True), (3, 0, False), (3, 3, True), (3, 1, False), (3, 2, False)]
    assert calibrate_compute.cp_block_pairs(1, 2) == [(1, 0, False), (2, 0, False), (1, 1, True), (2, 1, False), (2, 2, True)]
    pairs = calibrate_compute.cp_block_pairs(0, 4) + calibrate_compute.cp_block_pairs(1, 4) + calibrate_compute.cp_block_pairs(2, 4) + calibrate_compute.cp_block_pairs(3, 4)
    assert sorted((q, k) for q, k, _ in pairs) == [(q, k) for q in range(8) for k in range(q + 1)]
    run = cal.measure_cp_blocks((32, 16, 2, 4), torch.device("cpu"), torch.float32, 1, 1)
    assert run["backend"] == "torch" and run["flops"] == 3 * 4 * 2 * 4 * 8 * 16 * 16 / 2
    assert run["tflops"] == pytest.approx(run["flops"] / run["blocks_s"] / 1e12) and run["fused_s"] > 0
    gemms = [{"name": "qkv", "flops": 2e12, "seconds": 1.0, "tflops": 2.0}]
    hw, sources = cal.profile_figures({}, gemms, 10.0, 1, 8.0, "test", cp_blocks=run)
    assert hw["cp_block_tflops"] == run["tflops"] and "CP 2 rank's torch attention blocks" in sources["cp_block_tflops"]
    assert "cp_block_tflops" not in cal.profile_figures({}, gemms, 10.0, 1, 8.0, "test")[0]


def test_achieved_rate_is_a_training_steps_model_flops_over_its_time():
    """measure_training times a real GPT's forward and backward and counts the planner's model
    FLOPs (flops_per_token x tokens); the profile's achieved rate is that one, said so, while the
    GEMMs' rate stays the peak's source (--training-layers 0: the GEMMs' rate, as before)."""
    import torch
    from megalite.config import ModelConfig
    from megalite.model.counting import flops_per_token

    run = cal.measure_training((32, 16, 2, 4), 1, 64, torch.device("cpu"), False, repeats=1, trials=1)
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16,
                      max_position_embeddings=16, vocab_size=64)
    assert run["flops"] == flops_per_token(cfg) * 2 * 16 and run["tokens"] == 32
    assert run["tflops"] == pytest.approx(run["flops"] / run["seconds"] / 1e12)
    gemms = [{"name": "qkv", "flops": 2e12, "seconds": 1.0, "tflops": 2.0},
             {"name": "square", "flops": 3e12, "seconds": 1.0, "tflops": 3.0}]
    hw, sources = cal.profile_figures({}, gemms, 10.0, 1, 8.0, "test", training={**run, "tflops": 0.5})
    assert hw["achieved_tflops"] == 0.5 and hw["peak_tflops"] == 3.0
    assert "forward + backward" in sources["achieved_tflops"]
    hw, sources = cal.profile_figures({}, gemms, 10.0, 1, 8.0, "test")
    assert hw["achieved_tflops"] == 2.0 and "GEMMs" in sources["achieved_tflops"]
