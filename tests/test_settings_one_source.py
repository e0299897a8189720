"""Settings defined once (issue 37, item 1): what a checkpoint fixes, and the data iterators of a config.

* ``checkpoint/settings.py`` ``FIXED`` is the one list of the model settings a checkpoint fixes:
  ``--load`` adopts each of them, and the load's shape check (``checkpoint/core.py``
  ``check_config``) refuses a checkpoint that differs in any of them. The tests check the two
  behaviours field by field, so a field added to one and not the other fails here, and that every
  entry names a real flag and a real ``ModelConfig`` field.
* ``data.builder.build_data_iterators_from(config, ...)`` is the one reading of a run's config
  into the data iterators (pretrain and the dry run both call it): its micro-batches equal the
  explicit keyword call's with every data, model and training setting that matters.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megalite.arguments import build_parser
from megalite.checkpoint.core import check_config
from megalite.checkpoint.format import CheckpointError
from megalite.checkpoint.settings import FIXED, adopt_checkpoint_model
from megalite.config import Config, ConfigError, DataConfig, ModelConfig, TrainConfig
from megalite.data.builder import build_data_iterators, build_data_iterators_from

# learned positions: max_position_embeddings is checked too (RoPE models skip it)
MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16)


class _Other:
    """A saved value equal to no setting of the run."""

    def __eq__(self, other):
        return isinstance(other, _Other)

    def __repr__(self):
        return "<other>"


def test_every_fixed_setting_is_a_flag_of_a_model_field():
    """Each entry of FIXED is a ModelConfig field set by a real flag whose destinations it names."""
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    options = {opt: action.dest for action in build_parser()._actions for opt in action.option_strings}
    for field, (flag, dests) in FIXED.items():
        assert field in model_fields, field
        if flag is None:  # a setting no flag sets (attention_kind): only a config or a checkpoint sets it
            assert dests == (), field
            continue
        assert flag in options, (field, flag)
        assert options[flag] in dests, (field, flag, options[flag], dests)


@pytest.mark.parametrize("field", sorted(FIXED))
def test_the_load_check_refuses_every_fixed_setting(field):
    """A checkpoint differing from the run in one fixed setting is refused by the shape check, naming it."""
    saved = dataclasses.asdict(MODEL)
    check_config(saved, MODEL)  # the same model loads
    saved[field] = _Other()
    with pytest.raises(CheckpointError, match=f"{field}: checkpoint <other>"):
        check_config(saved, MODEL)


# vocab: the tokenizer decides; a setting without a flag has no flag to contradict the checkpoint
@pytest.mark.parametrize("field", sorted(f for f, (flag, _) in FIXED.items() if flag and f != "vocab_size"))
def test_load_adopts_or_refuses_every_fixed_setting(field):
    """``--load`` refuses a flag contradicting the checkpoint's value of each fixed setting."""
    flag, dests = FIXED[field]
    saved = dataclasses.asdict(MODEL)
    saved[field] = _Other()
    with pytest.raises(ConfigError, match=f"{flag}: the checkpoint has <other>"):
        adopt_checkpoint_model(dataclasses.replace(MODEL), saved, {dests[0]}, MODEL.vocab_size, "ckpt")


def _batches(iterator, n=3):
    return [next(iterator) for _ in range(n)]


def test_iterators_from_a_config_equal_the_explicit_call():
    """Every setting the helper reads reaches the iterators: packed documents on, non-default split,
    seed, sizes, ranks, samples and the consumed offset; compared batch by batch with the keyword call."""
    config = Config(model=dataclasses.replace(MODEL, vocab_size=50, seq_length=12),
                    train=TrainConfig(micro_batch_size=2, global_batch_size=8, seed=7),
                    data=DataConfig(mock_data=True, split="90,10,0", reset_position_ids=True,
                                    reset_attention_mask=True, eod_mask_loss=True, eod_token=3))
    run = dict(dp_rank=1, dp_size=2, train_samples=32, valid_samples=8, test_samples=0, consumed_train_samples=8)
    got = build_data_iterators_from(config, **run)
    want = build_data_iterators(data_prefix=None, mock=True, split="90,10,0", vocab_size=50, seq_length=12,
                                seed=7, micro_batch_size=2, eod_token=3, reset_position_ids=True,
                                reset_attention_mask=True, eod_mask_loss=True, **run)
    assert got[2] is None and want[2] is None
    for mine, theirs in zip(got[:2], want[:2]):
        for a, b in zip(_batches(mine), _batches(theirs)):
            assert a.keys() == b.keys() and "doc_start" in a
            for key in a:
                torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)
