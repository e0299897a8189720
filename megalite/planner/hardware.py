"""Hardware profiles: the figures of a GPU and its links that fill :class:`~megalite.planner.types.Hardware`.

A profile is data, a mapping of ``Hardware`` field names to values plus, for each figure, where it
comes from. Four are built in (:data:`PROFILES`: ``h100-sxm``, ``h200``, ``a100-80gb``, ``b200``),
each figure from the vendor's datasheet; ``tools/calibrate_hardware.py`` writes a measured one as a
JSON file (:data:`FORMAT`) that :func:`load_profile` reads as well:

    {"format": "megalite-hardware-profile/1", "name": "cpu-2core",
     "hardware": {"peak_tflops": ..., "nvlink_gbps": ..., ...},   # Hardware's fields, nothing else
     "sources": {"peak_tflops": "measured: ...", ...},            # where each figure comes from
     "measured": {...}}                                           # optional: the calibration's raw table

The figures' meaning, as the planner uses them:

- ``peak_tflops``: dense bf16 (no 2:4 sparsity) tensor-core TFLOP/s per GPU, MFU's denominator;
- ``achieved_tflops``: what a GPU sustains in training, ``ACHIEVED_FRACTION`` of the peak for the
  built-ins (see :data:`ACHIEVED_FRACTION` for its sources), the measured GEMM rate when calibrated;
- ``hbm_gbps``: device memory bandwidth, GB/s (10^9 bytes/s);
- ``nvlink_gbps`` / ``ib_gbps``: GB/s **one direction per GPU**, the rate a ring collective's wire
  bytes move at (the planner's wire bytes are what one rank sends: ``(n-1)/n`` of the tensor per
  all-gather or reduce-scatter, twice that per all-reduce; time = wire bytes / this rate). NVIDIA
  quotes NVLink as the bidirectional total (900 GB/s on H100), so one direction is half; InfiniBand
  as Gb/s per adapter, one adapter per GPU (400 Gb/s NDR = 50 GB/s);
- ``nvlink_latency_us`` / ``ib_latency_us``: the fixed cost of one collective call. No datasheet
  states it: the built-ins take the order of a small NCCL all-reduce (tens of microseconds); a
  calibrated profile fits it (time = latency + wire bytes / bandwidth), or with ``--latency
  after-compute`` measures it as a step meets it, a small all-gather issued after compute (less its
  wire time; both kept under ``measured``);
- ``gpu_memory_gb``: per GPU, as the datasheet states it; ``gpus_per_node``: an HGX/DGX board's 8;
- ``overlap_cost`` (optional, 0 to 1): what a collective hidden behind compute still costs per second
  of its link time (:mod:`.step_time`'s "overlap"). No datasheet states it: the built-ins and an
  older profile without it take Hardware's 0.10; ``tools/calibrate_hardware.py`` measures it (GEMMs
  with a collective in flight against each alone: 0 where the two share nothing, 1 where the
  collective's work takes the compute's own cores, as gloo's threads do on a CPU);
- ``cp_block_tflops`` (optional): the rate of context parallelism's attention blocks (the ring's and
  allgather's: Triton's on a GPU, torch's reference on a CPU), the planner's attention FLOPs over
  their time; without it the blocks run at ``achieved_tflops``. ``tools/calibrate_hardware.py``
  measures it at the layer's shape.

A profile leaves out the cluster's own choices (``nodes``, ``headroom``): the caller gives those.
"""
from __future__ import annotations

import dataclasses
import json
import os

from megalite.planner.types import Hardware

FORMAT = "megalite-hardware-profile/1"

# The fields a profile may set: every Hardware field but the cluster's own choices.
PROFILE_FIELDS = tuple(f.name for f in dataclasses.fields(Hardware) if f.name not in ("nodes", "headroom"))
REQUIRED_FIELDS = ("gpu_memory_gb", "gpus_per_node", "peak_tflops", "achieved_tflops", "hbm_gbps", "nvlink_gbps",
                   "ib_gbps", "nvlink_latency_us", "ib_latency_us")

# Training sustains ~40% of the dense bf16 peak: Megatron-Core reports up to 47% MFU on H100 clusters
# (GPT-3 175B, 390 TFLOP/s per GPU; Megatron-LM README) and Llama 3 405B ran at 38-43% (Meta, "The Llama 3
# Herd of Models", 2024, table 4: 380-430 TFLOP/s per H100); a bare bf16 GEMM reaches ~80% (769-798
# TFLOP/s of 989 measured at 8192^3 on an H200: ENV_NOTES). 0.40 keeps Hardware's default (400 of 989).
ACHIEVED_FRACTION = 0.40
ACHIEVED_SOURCE = ("0.40 x peak: Megatron-Core up to 47% MFU on H100 (Megatron-LM README), Llama 3 405B 38-43% "
                   "(arXiv 2407.21783 table 4); a bare 8192^3 bf16 GEMM gives ~80% (769-798 TFLOP/s on an H200, "
                   "ENV_NOTES)")
LATENCY_SOURCE = ("estimate, not a datasheet figure: the order of a small-message NCCL all-reduce ({} us); "
                  "run tools/calibrate_hardware.py to measure it")
NDR = "400 Gb/s NDR InfiniBand, one ConnectX-7 per GPU (DGX {} datasheet) = 50 GB/s per GPU one direction"


def _builtin(name: str, memory: float, peak: float, hbm: float, nvlink_total: float, ib: float, sources: dict,
             nvlink_latency: float = 10.0, ib_latency: float = 20.0) -> dict:
    """One datasheet profile: ``nvlink_total`` is the vendor's bidirectional figure (halved here)."""
    return {"format": FORMAT, "name": name,
            "hardware": {"name": name, "gpu_memory_gb": memory, "gpus_per_node": 8, "peak_tflops": peak,
                         "achieved_tflops": round(ACHIEVED_FRACTION * peak, 1), "hbm_gbps": hbm,
                         "nvlink_gbps": nvlink_total / 2, "ib_gbps": ib, "nvlink_latency_us": nvlink_latency,
                         "ib_latency_us": ib_latency},
            "sources": {"gpus_per_node": "HGX/DGX board: 8 GPUs", "achieved_tflops": ACHIEVED_SOURCE,
                        "nvlink_latency_us": LATENCY_SOURCE.format(nvlink_latency),
                        "ib_latency_us": LATENCY_SOURCE.format(ib_latency), **sources}}


H100_SHEET = "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column (https://www.nvidia.com/en-us/data-center/h100/)"
H200_SHEET = "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column (https://www.nvidia.com/en-us/data-center/h200/)"
A100_SHEET = ("NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column (https://www.nvidia.com/content/dam/en-zz/"
              "Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf)")
B200_SHEET = ("NVIDIA DGX B200 / HGX B200 datasheet, per GPU = the 8-GPU system's figure / 8 "
              "(https://www.nvidia.com/en-us/data-center/dgx-b200/, https://www.nvidia.com/en-us/data-center/hgx/)")

PROFILES: dict[str, dict] = {
    "h100-sxm": _builtin("h100-sxm", 80, 989.0, 3350.0, 900.0, 50.0, {
        "gpu_memory_gb": f"80 GB HBM3: {H100_SHEET}",
        "peak_tflops": f"BF16 Tensor Core 1,979 TFLOPS with sparsity, 989 dense: {H100_SHEET}",
        "hbm_gbps": f"3.35 TB/s: {H100_SHEET}",
        "nvlink_gbps": f"NVLink 900 GB/s (both directions), 450 one direction: {H100_SHEET}",
        "ib_gbps": NDR.format("H100")}),
    "h200": _builtin("h200", 141, 989.0, 4800.0, 900.0, 50.0, {
        "gpu_memory_gb": f"141 GB HBM3e: {H200_SHEET}",
        "peak_tflops": f"BF16 Tensor Core 1,979 TFLOPS with sparsity, 989 dense: {H200_SHEET}; measured 769-798 "
                       "TFLOP/s bf16 at 8192^3 on this project's H200 (ENV_NOTES)",
        "hbm_gbps": f"4.8 TB/s: {H200_SHEET} (device copy measured ~4.3 TB/s, ENV_NOTES)",
        "nvlink_gbps": f"NVLink 900 GB/s (both directions), 450 one direction: {H200_SHEET}",
        "ib_gbps": NDR.format("H200")}),
    "a100-80gb": _builtin("a100-80gb", 80, 312.0, 2039.0, 600.0, 25.0, {
        "gpu_memory_gb": f"80 GB HBM2e: {A100_SHEET}",
        "peak_tflops": f"BF16 Tensor Core 624 TFLOPS with sparsity, 312 dense: {A100_SHEET}",
        "hbm_gbps": f"2,039 GB/s: {A100_SHEET}",
        "nvlink_gbps": f"NVLink 600 GB/s (both directions), 300 one direction: {A100_SHEET}",
        "ib_gbps": "200 Gb/s HDR InfiniBand, one ConnectX-6 per GPU (DGX A100 datasheet) = 25 GB/s per GPU"}),
    "b200": _builtin("b200", 180, 2250.0, 8000.0, 1800.0, 50.0, {
        "gpu_memory_gb": f"1,440 GB HBM3e per 8 GPUs = 180 GB: {B200_SHEET}",
        "peak_tflops": f"FP16/BF16 Tensor Core 36 PFLOPS with sparsity per 8 GPUs = 4.5 per GPU, 2.25 dense: "
                       f"{B200_SHEET}",
        "hbm_gbps": f"64 TB/s per 8 GPUs = 8 TB/s: {B200_SHEET}",
        "nvlink_gbps": f"fifth-generation NVLink 1.8 TB/s per GPU (both directions), 900 one direction: {B200_SHEET}",
        "ib_gbps": NDR.format("B200")}),
}
ALIASES = {"h100": "h100-sxm", "h100-sxm5": "h100-sxm", "h200-sxm": "h200", "a100": "a100-80gb",
           "a100-sxm": "a100-80gb", "a100-80gb-sxm": "a100-80gb", "b200-sxm": "b200"}


class ProfileError(ValueError):
    """A profile name nobody knows, or a profile file that is not one."""


def known_profiles() -> str:
    return ", ".join(sorted(PROFILES))


def check_profile(doc, where: str) -> dict:
    """``doc`` as a profile document, or :class:`ProfileError` naming the first thing wrong with it."""
    if not isinstance(doc, dict) or not isinstance(doc.get("hardware"), dict):
        raise ProfileError(f"{where} is not a hardware profile: it needs a JSON object with a 'hardware' object "
                           f"of Hardware's fields (tools/calibrate_hardware.py writes one)")
    if doc.get("format", FORMAT) != FORMAT:
        raise ProfileError(f"{where}: format {doc['format']!r} is not {FORMAT!r}")
    hw = doc["hardware"]
    unknown = sorted(set(hw) - set(PROFILE_FIELDS))
    if unknown:
        raise ProfileError(f"{where}: unknown field(s) {', '.join(unknown)} in 'hardware'; a profile sets "
                           f"{', '.join(PROFILE_FIELDS)}")
    missing = [k for k in REQUIRED_FIELDS if k not in hw]
    if missing:
        raise ProfileError(f"{where}: 'hardware' lacks {', '.join(missing)}")
    for k, v in hw.items():
        if k == "name":
            if not isinstance(v, str):
                raise ProfileError(f"{where}: name must be a string, got {v!r}")
        elif k == "overlap_cost":
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise ProfileError(f"{where}: overlap_cost must be a number from 0 to 1 (the share of a hidden "
                                   f"collective's time that still slows compute), got {v!r}")
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v != v or v == float("inf"):
            raise ProfileError(f"{where}: {k} must be a positive number, got {v!r}")
    if int(hw["gpus_per_node"]) != hw["gpus_per_node"]:
        raise ProfileError(f"{where}: gpus_per_node must be a whole number, got {hw['gpus_per_node']!r}")
    return doc


def read_profile(name_or_path: str) -> dict:
    """The whole profile document (figures, sources, any measurements) of a built-in name or a JSON file."""
    key = str(name_or_path).lower()
    key = ALIASES.get(key, key)
    if key in PROFILES:
        return json.loads(json.dumps(PROFILES[key]))  # a copy the caller may change
    if not (os.path.sep in str(name_or_path) or str(name_or_path).endswith(".json") or os.path.exists(name_or_path)):
        raise ProfileError(f"hardware profile {name_or_path!r} is unknown: the built-in ones are {known_profiles()}; "
                           f"or give a profile file (tools/calibrate_hardware.py writes one)")
    if not os.path.isfile(name_or_path):
        raise ProfileError(f"hardware profile file {name_or_path} does not exist (the built-in profiles are "
                           f"{known_profiles()})")
    with open(name_or_path) as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as e:
            raise ProfileError(f"hardware profile file {name_or_path} is not valid JSON ({e})") from None
    doc = check_profile(doc, f"hardware profile file {name_or_path}")
    doc["hardware"].setdefault("name", doc.get("name") or os.path.splitext(os.path.basename(name_or_path))[0])
    return doc


def load_profile(name_or_path: str) -> dict:
    """The :class:`Hardware` field values of a profile (a built-in name, case-insensitive, or a JSON file)."""
    hw = dict(read_profile(name_or_path)["hardware"])
    hw["gpus_per_node"] = int(hw["gpus_per_node"])
    return hw


def hardware_from_profile(name_or_path: str, **overrides) -> Hardware:
    """A :class:`Hardware` of a profile's figures; ``overrides`` (e.g. ``nodes=4``) win over them."""
    return Hardware(**{**load_profile(name_or_path), **overrides})


def write_profile(path: str, name: str, hardware: dict, sources: dict, measured: dict | None = None) -> dict:
    """Write a profile document to ``path`` (checked first, so a file written is one that loads)."""
    doc = {"format": FORMAT, "name": name, "hardware": {"name": name, **hardware}, "sources": sources}
    if measured is not None:
        doc["measured"] = measured
    check_profile(doc, f"profile {name!r}")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    return doc


# The command line's hardware flags (tools/plan_parallel.py), by their Hardware field names.
HARDWARE_FLAGS = ("gpu_memory_gb", "gpus_per_node", "nodes", "nvlink_gbps", "ib_gbps", "headroom", "achieved_tflops",
                  "peak_tflops", "hbm_gbps", "nvlink_latency_us", "ib_latency_us")


def hardware_from_flags(profile: str | None, flags: dict) -> Hardware:
    """The :class:`Hardware` of a command line: ``profile``'s figures (if one is named), then every flag
    given (``flags``: field name -> value, None where the flag was not given) over them; what neither
    gives keeps Hardware's default (an H100 SXM). Without a profile the GPU memory must be given."""
    given = {k: v for k, v in flags.items() if v is not None}
    if profile is None and "gpu_memory_gb" not in given:
        raise ProfileError("--gpu-memory-gb is required without --hardware (give the GPU memory in GiB, or a "
                           f"profile: {known_profiles()}, or a file tools/calibrate_hardware.py wrote)")
    base = load_profile(profile) if profile is not None else {"gpus_per_node": 8}
    return Hardware(**{**base, **given})


def measured_collective(name_or_path: str, kind: str, ranks: int) -> dict:
    """A calibrated profile's fit of one collective (``all_reduce``, ``all_gather``, ``reduce_scatter``,
    ``all_to_all``, ``send_recv``) among the measured group size nearest ``ranks`` (by ratio):
    ``{"ranks": n, "latency_us": a, "gbps": B}``, so a call moving ``w`` wire bytes per rank takes
    ``a + w / B``. The profile's Hardware fields are one such group's; this reads every group's."""
    fits = read_profile(name_or_path).get("measured", {}).get("collectives", {}).get(kind)
    if not fits:
        raise ProfileError(f"hardware profile {name_or_path} has no measured {kind} (the built-in profiles have no "
                           f"measurements; tools/calibrate_hardware.py writes them)")
    nearest = min(fits, key=lambda n: (max(int(n), ranks) / min(int(n), ranks), int(n)))
    return {"ranks": int(nearest), "latency_us": fits[nearest]["latency_us"], "gbps": fits[nearest]["gbps"]}
