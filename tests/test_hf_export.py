"""A fine-tuned Hugging Face export keeps what the import brought: the bos/eos/pad
ids in config.json, the original generation_config.json, the tokenizer files, through a
``--finetune`` save and an ordinary resume; generate() stops at EOS. The export refuses a
non-empty folder without --force, and the folder it was imported from always. Tiny random
models and a word-level tokenizer made here; nothing is downloaded."""
import json
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
from convert_hf import main as convert_main  # noqa: E402

from megalite.train.pretrain import pretrain  # noqa: E402

WORDS = ["<s>", "</s>", "<pad>"] + [f"w{i}" for i in range(61)]  # 64 ids: bos 0, eos 1, pad 2


def save_tokenizer(folder):
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w0")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>")
    fast.save_pretrained(folder)
    return fast


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A Llama with its tokenizer and a generation config of its own, imported, fine-tuned for
    2 iterations (--finetune) and resumed for 1 more."""
    root = tmp_path_factory.mktemp("export")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=len(WORDS),
                                      max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "hf")
    save_tokenizer(root / "hf")
    generation = json.load(open(root / "hf" / "generation_config.json"))
    json.dump({**generation, "repetition_penalty": 1.25}, open(root / "hf" / "generation_config.json", "w"))
    assert convert_main(["--direction", "import", "--hf-dir", str(root / "hf"), "--save", str(root / "ckpt")]) == 0
    argv = ["--mock-data", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
            "--lr", "1e-3", "--log-interval", "100"]
    pretrain(argv + ["--load", str(root / "ckpt"), "--finetune", "--train-iters", "2", "--save", str(root / "ft")])
    pretrain(argv + ["--load", str(root / "ft"), "--train-iters", "3", "--save", str(root / "ft")])  # resume
    return root


@pytest.mark.parametrize("iteration", [2, 3], ids=["finetune-save", "resumed-save"])
def test_saves_carry_the_source_record_and_files(imported, iteration):
    folder = imported / "ft" / f"iter_{iteration:07d}"
    source = json.load(open(folder / "metadata.json"))["source"]
    assert (source["bos_token_id"], source["eos_token_id"], source["pad_token_id"]) == (0, 1, 2)
    carried = set(os.listdir(folder / "huggingface"))
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= carried


def test_finetuned_export_keeps_special_tokens_tokenizer_and_generation_config(imported, capsys):
    out = imported / "out"
    assert convert_main(["--direction", "export", "--load", str(imported / "ft"), "--hf-dir", str(out)]) == 0
    assert "carries no tokenizer" not in capsys.readouterr().err
    config = json.load(open(out / "config.json"))
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (0, 1, 2)
    generation = json.load(open(out / "generation_config.json"))
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["repetition_penalty"]) == (0, 1, 1.25)
    for name in os.listdir(imported / "hf"):  # every tokenizer file the source had
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            assert (out / name).read_bytes() == (imported / "hf" / name).read_bytes(), name
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert tok("w5 w7")["input_ids"][-2:] == [8, 10]

    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.generation_config.eos_token_id == 1

    class EosAtThird(transformers.LogitsProcessor):  # the model "produces" EOS as its 3rd new token
        def __call__(self, ids, scores):
            if ids.shape[1] == 4 + 2:
                scores = torch.full_like(scores, -1e9)
                scores[:, 1] = 0.0
            return scores

    prompt = torch.tensor([[0, 5, 6, 7]])
    with torch.no_grad():
        new = model.generate(prompt, max_new_tokens=10, do_sample=False,
                             logits_processor=transformers.LogitsProcessorList([EosAtThird()]))[0, 4:].tolist()
    assert len(new) == 3 and new[-1] == 1, new  # stopped at EOS, not after 10 tokens


def _snapshot(folder):
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


def test_export_refuses_a_non_empty_folder_and_the_imported_one(imported, capsys):
    load = ["--direction", "export", "--load", str(imported / "ft")]
    target = imported / "busy"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    (target / "model-00001-of-00002.safetensors").write_bytes(b"stale")
    before = _snapshot(target)
    assert convert_main(load + ["--hf-dir", str(target)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not empty" in err and "--force" in err, err
    assert _snapshot(target) == before  # nothing written
    source = _snapshot(imported / "hf")
    for extra in ([], ["--force"]):  # the original model is never overwritten
        assert convert_main(load + ["--hf-dir", str(imported / "hf")] + extra) == 2
        assert "imported from" in capsys.readouterr().err
        assert _snapshot(imported / "hf") == source
    assert convert_main(load + ["--hf-dir", str(target), "--force"]) == 0  # --force: stale shards go
    names = set(os.listdir(target))
    assert "notes.txt" in names and "model-00001-of-00002.safetensors" not in names
    transformers.AutoModelForCausalLM.from_pretrained(target)


def test_a_checkpoint_without_tokenizer_says_what_to_copy(tmp_path, capsys):
    from megalite.checkpoint import save_weights_checkpoint
    from megalite.config import ModelConfig
    from megalite.model.gpt import GPTModel

    model = GPTModel(ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64,
                                 seq_length=16, position_embedding_type="rope", normalization="RMSNorm",
                                 swiglu=True, add_bias_linear=False))
    save_weights_checkpoint(str(tmp_path / "ckpt"), model)
    assert convert_main(["--direction", "export", "--load", str(tmp_path / "ckpt"),
                         "--hf-dir", str(tmp_path / "out")]) == 0
    note = [line for line in capsys.readouterr().err.splitlines() if "tokenizer" in line]
    assert len(note) == 1 and "copy tokenizer.json, tokenizer_config.json" in note[0], note


def test_a_run_trained_with_a_huggingface_tokenizer_exports_it(tmp_path, capsys):
    """No import: the tokenizer folder the run trained with is carried by the save, and the
    export takes bos/eos from it."""
    save_tokenizer(tmp_path / "tok")
    pretrain(["--mock-data", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path / "tok"),
              "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
              "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
              "--disable-bias-linear", "--micro-batch-size", "2", "--global-batch-size", "2",
              "--train-iters", "1", "--log-interval", "100", "--save", str(tmp_path / "ckpt")])
    assert convert_main(["--direction", "export", "--load", str(tmp_path / "ckpt"),
                         "--hf-dir", str(tmp_path / "out")]) == 0
    assert "carries no tokenizer" not in capsys.readouterr().err
    config = json.load(open(tmp_path / "out" / "config.json"))
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out").eos_token_id == 1


def test_a_resharded_checkpoint_still_exports_its_tokenizer(imported, capsys):
    """reshard_checkpoint carries the imported tokenizer files and ids on, as a training save does."""
    from reshard_checkpoint import reshard  # tools/ is on the path (above)

    reshard(str(imported / "ft"), str(imported / "resharded"), tp=2)
    out = imported / "out_resharded"
    assert convert_main(["--direction", "export", "--load", str(imported / "resharded"), "--hf-dir", str(out)]) == 0
    assert "carries no tokenizer" not in capsys.readouterr().err
    assert (out / "tokenizer.json").read_bytes() == (imported / "hf" / "tokenizer.json").read_bytes()
    assert json.load(open(out / "config.json"))["eos_token_id"] == 1
