"""What the Hugging Face interchange tests read back: the settings a converted megalite checkpoint
recorded, and an export compared tensor by tensor with the model it came from."""
from __future__ import annotations

import json

import torch

from megalite.checkpoint.convert import export_hf


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
