"""Supervised fine-tuning (SFT) documents: token ids plus which tokens are trained on.

Input: JSONL, one conversation per line, in either form (chosen per line):

* ``{"prompt": "...", "response": "..."}``: ids are ``tokenize(prompt)`` (with
  BOS first when the tokenizer adds one) followed by ``tokenize(response)``;
  the response tokens are trained on.  No chat template is applied: write
  ``messages`` lines for that.
* ``{"messages": [{"role": "...", "content": "..."}, ...]}``: with a Hugging
  Face tokenizer folder that has a chat template (``chat_template`` of
  ``tokenizer_config.json`` or ``chat_template.jinja``), the conversation is
  rendered with jinja2 as ``transformers``' ``apply_chat_template`` renders it
  (``messages``, ``add_generation_prompt=False``, the special-token strings
  ``bos_token``/``eos_token``/..., ``raise_exception``, ``strftime_now``, the
  ``tojson`` filter, ``trim_blocks``/``lstrip_blocks``) and the text is
  tokenized without adding BOS (the template writes it), so the ids are those
  of ``apply_chat_template(messages, tokenize=True)``.  Trained tokens: for
  the assistant message ``i``, the characters from the end of
  ``render(messages[:i], add_generation_prompt=True)`` (the prompt up to and
  including the assistant header) to the end of ``render(messages[:i+1])``
  (its content and the template's end-of-turn text).  Both renderings must be
  prefixes of the whole conversation's; a token is trained on when its first
  character lies in such a span (from the tokenizer's offsets).
  Without a template (or with a SentencePiece tokenizer) the fallback is
  ``"role: content"`` lines: ``"user: hi\\nassistant: "`` is prompt, the
  assistant content is response, and the pieces are tokenized one by one.

Every document ends with the EOD token (appended unless the ids already end
with it), trained on when the conversation ends with a response.  The loss mask
of a document (uint8, 1 = trained on) is stored as a second indexed dataset,
``PREFIX_loss_mask``, with the same document sizes as ``PREFIX``; the GPT
dataset cuts the same windows from it.
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Iterator

import numpy as np

from megalite.data.documents import check_input

FORMAT_HINT = ('each line must be {"prompt": "...", "response": "..."} or '
               '{"messages": [{"role": "...", "content": "..."}, ...]}')


def loss_mask_prefix(prefix: str) -> str:
    """Where the loss mask of dataset ``prefix`` lives."""
    return prefix + "_loss_mask"


def iter_sft_records(path: str) -> Iterator[tuple[int, dict]]:
    """``(line number, record)`` for each non-blank line of a JSONL file."""
    check_input(path)
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno} is not valid JSON ({exc.msg}); "
                                 f"{FORMAT_HINT}.") from None
            yield lineno, record


def _where(path: str, lineno: int) -> str:
    return f"{path}:{lineno}"


def parse_record(record, path: str, lineno: int) -> list[dict] | tuple[str, str]:
    """A ``messages`` list or a ``(prompt, response)`` pair, checked."""
    where = _where(path, lineno)
    if isinstance(record, dict) and "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in messages):
            raise ValueError(f"{where}: \"messages\" must be a list of {{\"role\": str, "
                             f"\"content\": str}} objects.")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{where}: the conversation has no assistant turn, so no token of it "
                             f"would be trained on. Fix: add the assistant's reply, or drop the line.")
        return messages
    if isinstance(record, dict) and "prompt" in record and "response" in record:
        prompt, response = record["prompt"], record["response"]
        if not isinstance(prompt, str) or not isinstance(response, str):
            raise ValueError(f"{where}: \"prompt\" and \"response\" must be strings.")
        return prompt, response
    found = sorted(record) if isinstance(record, dict) else type(record).__name__
    raise ValueError(f"{where} is neither SFT format (found {found}): {FORMAT_HINT}.")


def compile_chat_template(template: str, source: str):
    """A jinja2 template set up as ``transformers`` sets up chat templates."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers' assistant marker):
        rendered as its body; the spans are found by prefix rendering instead."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"The chat template of {source} does not compile: {exc.message} "
                         f"(template line {exc.lineno}). Fix the template.") from None


class SFTEncoder:
    """Turns SFT records into ``(ids, mask)`` (see the module docstring)."""

    def __init__(self, tokenizer, path: str = "<input>"):
        self.tokenizer = tokenizer
        self.path = path
        if tokenizer.eod is None:
            raise ValueError(f"SFT documents end with the end-of-document token, but {tokenizer!r} "
                             f"has none. Fix: name one (eos_token in tokenizer_config.json).")
        template = getattr(tokenizer, "chat_template", None)
        has_offsets = hasattr(tokenizer, "encode_with_offsets")
        self.source = getattr(tokenizer, "path", repr(tokenizer))
        self.template = (compile_chat_template(template, self.source)
                         if template and has_offsets else None)
        self.special = dict(getattr(tokenizer, "special_tokens", {}))

    def render(self, messages, add_generation_prompt: bool, lineno: int) -> str:
        import jinja2
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        tools=None, documents=None, **self.special)
        except jinja2.TemplateError as exc:
            raise ValueError(f"{_where(self.path, lineno)}: the chat template of {self.source} "
                             f"failed: {exc}") from None

    def _piece(self, text: str, first: bool) -> list[int]:
        if getattr(self.tokenizer, "add_bos", False):
            return list(self.tokenizer.tokenize(text, add_bos=first))
        return list(self.tokenizer.tokenize(text))

    def _pieces(self, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
        ids, mask = [], []
        for k, (text, trained) in enumerate(pieces):
            piece = self._piece(text, k == 0)
            ids += piece
            mask += [int(trained)] * len(piece)
        return ids, mask

    def _templated(self, messages: list[dict], lineno: int) -> tuple[list[int], list[int]]:
        full = self.render(messages, False, lineno)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], True, lineno)
            upto = self.render(messages[:i + 1], False, lineno)
            if not (full.startswith(before) and full.startswith(upto) and len(before) <= len(upto)):
                raise ValueError(
                    f"{_where(self.path, lineno)}: the chat template of {self.source} does not "
                    f"render the conversation up to message {i} as a prefix of the whole "
                    f"conversation, so the assistant tokens cannot be located. Fix: use a template "
                    f"whose rendering of a conversation's start is a prefix of the whole.")
            spans.append((len(before), len(upto)))
        ids, offsets = self.tokenizer.encode_with_offsets(full)
        starts = np.asarray([start for start, _ in offsets], dtype=np.int64)
        mask = np.zeros(len(ids), dtype=np.int64)
        for lo, hi in spans:
            mask |= (starts >= lo) & (starts < hi)
        return list(ids), mask.tolist()

    def encode(self, lineno: int, record) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, mask)`` of one record: int64 ids ending with EOD, uint8 mask."""
        parsed = parse_record(record, self.path, lineno)
        if isinstance(parsed, tuple):
            ids, mask = self._pieces([(parsed[0], False), (parsed[1], True)])
            ends_with_response = True
        elif self.template is not None:
            ids, mask = self._templated(parsed, lineno)
            ends_with_response = parsed[-1]["role"] == "assistant"
        else:
            pieces, prompt = [], ""
            for message in parsed:
                if message["role"] == "assistant":
                    pieces += [(prompt + "assistant: ", False), (message["content"], True)]
                    prompt = "\n"
                else:
                    prompt += f"{message['role']}: {message['content']}\n"
            if prompt.strip():
                pieces.append((prompt, False))
            ids, mask = self._pieces([p for p in pieces if p[0]])
            ends_with_response = parsed[-1]["role"] == "assistant"
        if not ids or ids[-1] != self.tokenizer.eod:
            ids.append(self.tokenizer.eod)
            mask.append(int(ends_with_response))
        return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8)


_worker_encoder: SFTEncoder | None = None


def init_sft_worker(config: dict, path: str) -> None:
    """Pool initializer: each worker builds its own tokenizer and encoder."""
    from megalite.data.tokenizer import build_tokenizer
    global _worker_encoder
    _worker_encoder = SFTEncoder(build_tokenizer(**config), path)


def encode_in_sft_worker(item: tuple[int, dict]) -> tuple[np.ndarray, np.ndarray]:
    return _worker_encoder.encode(*item)
