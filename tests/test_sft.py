"""Supervised fine-tuning data: prompt/response and chat (messages) JSONL to token ids plus a
loss mask on the response tokens, the chat template rendered as transformers renders it, the
errors, and fine-tuning an imported Hugging Face model whose loss is the mean over response
tokens alone."""
import json
import os
import sys

import numpy as np
import pytest
import torch

tokenizers = pytest.importorskip("tokenizers")

from megalite.data.indexed_dataset import IndexedDataset  # noqa: E402
from megalite.data.preprocess import preprocess  # noqa: E402
from megalite.data.sft import SFTEncoder, loss_mask_prefix  # noqa: E402
from megalite.data.tokenizer import build_tokenizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
from preprocess_data import main as preprocess_main  # noqa: E402

SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{{ bos_token }}{% for m in messages %}"
          "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
          "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
          "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "It is 4."}, {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "Six, of course."}]
TEXTS = ["What is 2+2? It is 4. And 3+3? Six, of course. Be brief.",
         "the quick brown fox jumps over the lazy dog", "def f(x): return x + 1"] * 4


def save_folder(folder, template=CHATML, eos="</s>"):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "add_bos_token": True}
    if eos:
        config["eos_token"] = eos
    if template:
        config["chat_template"] = template
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return str(folder)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_folder(tmp_path_factory.mktemp("tok") / "chatml")


def runs(ids, mask):
    """The token runs with mask 1, as lists of ids."""
    out, current = [], []
    for i, m in zip(ids, mask):
        if m:
            current.append(int(i))
        elif current:
            out, current = out + [current], []
    return out + ([current] if current else [])


def test_chat_template_renders_as_transformers_and_masks_the_assistant_turns(folder):
    transformers = pytest.importorskip("transformers")
    tok = build_tokenizer("HuggingFaceTokenizer", folder)
    ids, mask = SFTEncoder(tok).encode(1, {"messages": CHAT})
    reference = transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(CHAT, tokenize=True)
    reference = list(reference["input_ids"] if hasattr(reference, "keys") else reference)
    assert ids.tolist() == reference + [tok.eod]  # the template writes no EOD: it is appended
    # trained on: each assistant content with its end of turn (the header is prompt), and the EOD
    spans = [tok.detokenize(run) for run in runs(ids, mask)]
    assert spans == ["It is 4.<|im_end|>\n", "Six, of course.<|im_end|>\n</s>"]
    prompt = tok.detokenize([i for i, m in zip(ids, mask) if not m])
    assert prompt == ("<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?"
                      "<|im_end|>\n<|im_start|>assistant\n<|im_start|>user\nAnd 3+3?<|im_end|>\n"
                      "<|im_start|>assistant\n")
    assert mask.dtype == np.uint8
    # transformers' {% generation %} marker renders as its body
    marked = CHATML.replace("{{ m['content'] }}", "{% if m['role'] == 'assistant' %}{% generation %}"
                            "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}")
    tok.chat_template = marked
    assert SFTEncoder(tok).encode(1, {"messages": CHAT})[0].tolist() == ids.tolist()


def test_preprocess_writes_ids_and_loss_mask(folder, tmp_path):
    """prompt/response and messages lines in one file; the fallback without a template."""
    path = tmp_path / "sft.jsonl"
    lines = [{"prompt": "What is 2+2?", "response": " It is 4."}, {"messages": CHAT}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    tok = build_tokenizer("HuggingFaceTokenizer", folder)
    summary = preprocess(str(path), str(tmp_path / "sft"), tok, json_format="sft")
    ds, mask = IndexedDataset(str(tmp_path / "sft")), IndexedDataset(loss_mask_prefix(str(tmp_path / "sft")))
    assert len(ds) == 2 and np.array_equal(ds.sizes, mask.sizes) and mask.dtype == np.uint8
    prompt = [tok.bos] + tok.tokenize("What is 2+2?", add_bos=False)
    response = tok.tokenize(" It is 4.", add_bos=False) + [tok.eod]
    assert ds[0].tolist() == prompt + response
    assert mask[0].tolist() == [0] * len(prompt) + [1] * len(response)  # 0 on every prompt token
    chat_ids, chat_mask = SFTEncoder(tok).encode(2, {"messages": CHAT})
    assert ds[1].tolist() == chat_ids.tolist() and mask[1].tolist() == chat_mask.tolist()
    assert summary["response_tokens"] == int(mask.tokens.sum()) and summary["eod_inside"] == 0
    # two worker processes (each rebuilding tokenizer and template) write the same bytes
    preprocess(str(path), str(tmp_path / "sft2"), tok, json_format="sft", workers=2)
    for suffix in ("", "_loss_mask"):
        for ext in (".bin", ".idx"):
            assert (tmp_path / f"sft{suffix}{ext}").read_bytes() == (tmp_path / f"sft2{suffix}{ext}").read_bytes()

    plain = build_tokenizer("HuggingFaceTokenizer", save_folder(tmp_path / "plain", template=None))
    ids, m = SFTEncoder(plain).encode(1, {"messages": CHAT[1:3] + [{"role": "user", "content": "ok"}]})
    pieces = [("user: What is 2+2?\nassistant: ", 0, True), ("It is 4.", 1, False), ("\nuser: ok\n", 0, False)]
    expected = [(plain.tokenize(text, add_bos=bos), trained) for text, trained, bos in pieces]
    assert ids.tolist() == [i for piece, _ in expected for i in piece] + [plain.eod]
    assert m.tolist() == [t for piece, t in expected for _ in piece] + [0]  # ends on a prompt: EOD not trained


def test_bad_input_is_one_message_naming_the_line(folder, tmp_path, capsys):
    def run(lines, model=folder):
        path = tmp_path / "bad.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        with pytest.raises(SystemExit) as exit_info:
            preprocess_main(["--input", str(path), "--output-prefix", str(tmp_path / "bad"),
                             "--json-format", "sft", "--tokenizer-type", "HuggingFaceTokenizer",
                             "--tokenizer-model", model])
        assert exit_info.value.code == 2
        return capsys.readouterr().err.strip()

    good = {"prompt": "a", "response": "b"}
    err = run([good, {"text": "plain pretraining text"}])
    assert f"{tmp_path}/bad.jsonl:2 is neither SFT format (found ['text']): each line must be " \
           '{"prompt": "...", "response": "..."} or {"messages": [{"role": "...", "content": "..."}, ...]}' in err
    err = run([good, good, {"messages": [{"role": "user", "content": "hi"}]}])
    assert "bad.jsonl:3: the conversation has no assistant turn, so no token of it would be trained on" in err
    err = run([{"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]}])
    assert "bad.jsonl:1: the chat template of" in err and "failed: unknown role robot" in err
    broken = save_folder(tmp_path / "broken", template="{% for m in messages %}{{ m.content }}")
    err = run([good], broken)
    assert "does not compile: Unexpected end of template" in err and "(template line 1)" in err
    assert not os.path.exists(str(tmp_path / "bad.bin"))  # nothing half-written is left
    noeos = save_folder(tmp_path / "noeos", eos=None)
    err = run([good], noeos)
    assert "SFT documents end with the end-of-document token, but HuggingFaceTokenizer" in err
    # training with a packed-document flag and a tokenizer without EOD: refused at startup
    from megalite.config import ConfigError
    from megalite.train.pretrain import pretrain
    with pytest.raises(ConfigError, match=r"--reset-attention-mask needs an end-of-document \(EOD\) token .* "
                                          r"\(HuggingFaceTokenizer .*noeos\) has none"):
        pretrain(["--mock-data", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", noeos,
                  "--reset-attention-mask", "--train-iters", "1"])


# -- fine-tuning an imported Hugging Face model on SFT data ------------------------------------------

SEQ, MICRO = 32, 2


@pytest.fixture(scope="module")
def finetune_setup(folder, tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from megalite.checkpoint.convert import import_hf
    root = tmp_path_factory.mktemp("sft_train")
    tok = build_tokenizer("HuggingFaceTokenizer", folder)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=tok.vocab_size,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(root / "hf")
    import_hf(str(root / "hf"), str(root / "ckpt"))
    lines = [{"messages": CHAT}, {"prompt": "What is 2+2?", "response": " It is 4."},
             {"prompt": "2+2?", "response": " 4."}, {"messages": CHAT[1:3]}, {"prompt": "x", "response": "f"}] * 3
    (root / "sft.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    preprocess(str(root / "sft.jsonl"), str(root / "sft"), tok, json_format="sft")
    argv = ["--finetune", "--load", str(root / "ckpt"), "--data-path", str(root / "sft"), "--split", "1",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", folder, "--seq-length", str(SEQ),
            "--micro-batch-size", str(MICRO), "--global-batch-size", str(MICRO), "--train-iters", "1",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "100"]
    return model, tok, argv, str(root / "sft")


def first_batch(tok, prefix, **flags):
    from megalite.data.builder import build_data_iterators
    train, _, _ = build_data_iterators(data_prefix=prefix, mock=False, split="1", vocab_size=tok.vocab_size,
                                       seq_length=SEQ, seed=1234, micro_batch_size=MICRO, dp_rank=0, dp_size=1,
                                       train_samples=MICRO, valid_samples=0, test_samples=0,
                                       eod_token=tok.eod, **flags)
    return next(train)


def reference_loss(model, batch, per_document: bool) -> float:
    """Mean over the loss mask of the Hugging Face model's per-token losses; ``per_document``:
    each document of a row run on its own (what --reset-attention-mask means)."""
    losses = torch.zeros(batch["tokens"].shape)
    with torch.no_grad():
        for r in range(batch["tokens"].shape[0]):
            bounds = sorted(set(batch["doc_start"][r].tolist())) + [SEQ] if per_document else [0, SEQ]
            for lo, hi in zip(bounds[:-1], bounds[1:]):
                logits = model(batch["tokens"][r:r + 1, lo:hi],
                               position_ids=batch["position_ids"][r:r + 1, lo:hi]).logits[0].float()
                losses[r, lo:hi] = torch.nn.functional.cross_entropy(logits, batch["labels"][r, lo:hi],
                                                                     reduction="none")
    mask = batch["loss_mask"]
    return float((losses * mask).sum() / mask.sum())


def test_finetune_loss_is_the_mean_over_response_tokens(finetune_setup):
    """One step of pretrain_gpt.py --finetune on the SFT data reports the mean of the per-token
    losses over response labels alone (the HF model computes them), with positions reset."""
    from megalite.train.pretrain import pretrain
    model, tok, argv, prefix = finetune_setup
    flags = {"reset_position_ids": True, "eod_mask_loss": True}
    log = pretrain(argv + ["--reset-position-ids", "--eod-mask-loss"])
    batch = first_batch(tok, prefix, **flags)
    mask = batch["loss_mask"]
    assert 0 < mask.sum() < mask.numel()  # prompt labels are left out
    expected = reference_loss(model, batch, per_document=False)
    assert abs(log[0]["loss"] - expected) < 1e-5 * expected, (log[0]["loss"], expected)
    everything = reference_loss(model, {**batch, "loss_mask": torch.ones_like(mask)}, per_document=False)
    assert abs(everything - expected) > 1e-3  # the mask matters


def test_finetune_with_reset_attention_mask_attends_within_documents(finetune_setup):
    """With all three flags the step's loss is the response-token mean of each document run
    on its own by the Hugging Face model."""
    from megalite.train.pretrain import pretrain
    model, tok, argv, prefix = finetune_setup
    log = pretrain(argv + ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"])
    batch = first_batch(tok, prefix, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    expected = reference_loss(model, batch, per_document=True)
    assert abs(reference_loss(model, batch, per_document=False) - expected) > 1e-4  # documents matter
    assert abs(log[0]["loss"] - expected) < 1e-5 * expected, (log[0]["loss"], expected)
