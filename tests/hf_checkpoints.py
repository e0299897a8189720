"""What the Hugging Face interchange tests read back: the settings a converted megalite checkpoint
recorded, an export compared tensor by tensor with the model it came from, and tools/generate.py's
greedy tokens against transformers'."""
from __future__ import annotations

import json
import os
import sys

import torch

from megalite.checkpoint.convert import export_hf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import generate as generate_tool  # noqa: E402


def saved_model_settings(ckpt) -> dict:
    """The model settings a megalite checkpoint folder (``pathlib.Path``) recorded in its metadata."""
    return json.load(open(next(ckpt.glob("iter_*/metadata.json"))))["config"]["model"]


def export_round_trip(model, cls, tmp_path, config_ignore: set | None = None) -> dict:
    """Export ``tmp_path/ckpt`` to ``tmp_path/out``, read it back as ``cls``: every tensor bit-equal
    to ``model``'s; with ``config_ignore``, its configuration equal too but for those keys. Returns
    the exported config.json."""
    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    back = cls.from_pretrained(tmp_path / "out").eval()
    original = model.state_dict()
    assert set(back.state_dict()) == set(original)
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    if config_ignore is not None:
        want = {k: v for k, v in model.config.to_dict().items() if k not in config_ignore}
        got = {k: v for k, v in back.config.to_dict().items() if k not in config_ignore}
        assert got == want, {k: (got.get(k), want.get(k)) for k in set(got) | set(want) if got.get(k) != want.get(k)}
    return json.load(open(tmp_path / "out" / "config.json"))


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``prompt`` by ``n`` tokens (no end-of-text stop)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_greedy_equals_transformers(model, ckpt, prompt: list[int], n: int, capsys) -> None:
    """``python tools/generate.py --load ckpt --greedy`` continues ``prompt`` with transformers'
    greedy tokens of ``model`` (what it printed, read through ``capsys``)."""
    want = hf_greedy(model, prompt, n)
    capsys.readouterr()
    assert generate_tool.main(["--load", str(ckpt), "--prompt-ids", ",".join(map(str, prompt)),
                               "--max-new-tokens", str(n), "--greedy", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ids"] == want, ckpt
