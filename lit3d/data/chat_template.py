"""Conversations → token ids and which of them are answers, with the chat template of a local HF tokenizer folder.

The template (``tokenizer_config.json``'s ``chat_template``, or a ``chat_template.jinja`` beside it) is rendered with
Jinja as HuggingFace renders it. An assistant turn's answer is what rendering the conversation up to and including
that turn adds to rendering it up to the turn before, with the generation prompt: the answer's text and the
template's end-of-turn marker, which the model must learn to produce. Tokens are marked by their character offsets.
A template may end the conversation's last turn with another marker than the same turn followed by more (gpt-oss's
harmony format ends the final answer with ``<|return|>``, an earlier one with ``<|end|>``): such an answer runs to
where the two renderings part, and on through the special token that ends it in the whole conversation.

NOTE: rendered here with jinja2 (a dependency of torch) rather than by `transformers`, which is an optional extra.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

ROLES = ("system", "user", "assistant", "tool")


class ChatTemplate:
    """A local HuggingFace tokenizer folder's (or its ``tokenizer.json``'s) tokenizer and chat template."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        file = Path(path) if Path(path).is_file() else Path(path) / "tokenizer.json"
        folder = file.parent
        if not file.is_file():
            raise FileNotFoundError(f"chat data needs a tokenizer folder with tokenizer.json: {str(path)!r} has none")
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        source = _template_source(folder, config)
        self.tokenizer = Tokenizer.from_file(str(file))
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "pad_token")}
        added = self.tokenizer.get_added_tokens_decoder().items()
        self.special_tokens = {i: token.content for i, token in added if token.special}  # by id: markers, not text
        eos = self.special["eos_token"]
        self.pad_id = self.tokenizer.token_to_id(self.special["pad_token"] or eos or "") or 0
        self.template = _environment().from_string(source)
        self.folder = folder

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special)

    def encode(self, messages: list[dict[str, str]]) -> tuple[np.ndarray, np.ndarray]:
        """The conversation's token ids and, per token, whether it belongs to an assistant's answer."""
        text, spans = self.answer_spans(messages)
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        starts = np.array([start for start, _ in encoding.offsets], dtype=np.int64)
        answer = np.zeros(len(starts), dtype=bool)
        for begin, end in spans:
            answer |= (starts >= begin) & (starts < end)
        return np.asarray(encoding.ids, dtype=np.int32), answer

    def answer_spans(self, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of its answers."""
        text, spans = self.render(messages), []
        for turn, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:turn], add_generation_prompt=True)
            through = self.render(messages[: turn + 1])
            end = len(through) if text.startswith(through) else self._end_in_whole(text, through, len(before))
            if not (through.startswith(before) and text.startswith(before)) or end is None:
                raise ValueError(
                    f"the chat template of {str(self.folder)!r} does not render a conversation's beginning as the "
                    f"beginning of the whole (at turn {turn}), so its answers cannot be told apart"
                )
            spans.append((len(before), end))
        return text, spans

    def _end_in_whole(self, text: str, through: str, begin: int) -> int | None:
        """Where an answer that ``through`` ends with one special token (its last-turn marker) ends in ``text``, the
        whole conversation: through the special token ``text`` has where the two part (None if they differ in more)."""
        special = self.special_tokens.values()
        parted = max((len(through) - len(token) for token in special if through.endswith(token)), default=0)
        ends_whole = [token for token in special if text.startswith(token, parted)]
        if parted <= begin or not text.startswith(through[:parted]) or not ends_whole:
            return None
        return parted + max(map(len, ends_whole))


def _template_source(folder: Path, config: dict[str, Any]) -> str:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    if not template:
        raise ValueError(
            f"the tokenizer folder {str(folder)!r} has no chat template (tokenizer_config.json's chat_template or "
            "chat_template.jinja); chat data needs one"
        )
    return template


def _token_text(token: Any) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _environment() -> Any:
    from jinja2 import nodes
    from jinja2.exceptions import TemplateError
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` (HuggingFace's marks of the answers): rendered as it is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", Generation]
    )
    environment.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
    environment.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    return environment


def conversation(row: dict[str, Any], where: str) -> list[dict[str, str]]:
    """A row of chat data as its turns: its ``messages``, or its ``prompt`` and ``response`` (and ``system``)."""
    if "messages" in row:
        messages = row["messages"]
    elif "prompt" in row and "response" in row:
        messages = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}]
        if row.get("system"):
            messages.insert(0, {"role": "system", "content": row["system"]})
    else:
        raise ValueError(f"{where} has columns {sorted(row)}: chat data needs 'messages', or 'prompt' and 'response'")
    for turn, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLES or not isinstance(message.get("content"), str):
            raise ValueError(
                f"{where}, turn {turn}: role {role!r} is not one of {', '.join(ROLES)}, or its content is not text"
            )
    if not any(message["role"] == "assistant" for message in messages):
        raise ValueError(f"{where} has no assistant turn: nothing to train on")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def read_rows(path: str) -> list[dict[str, Any]]:
    """The rows of a ``.jsonl``/``.json`` or ``.parquet`` file; any other file is refused, not read as text."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"chat data file {path!r} does not exist")
    if file.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(file).to_pylist()
    if file.suffix == ".jsonl":
        lines = enumerate(file.read_text().splitlines(), 1)
        return [json_value(line, path, number) for number, line in lines if line.strip()]
    if file.suffix == ".json":
        rows = json_value(file.read_text(), path)
        return rows if isinstance(rows, list) else [rows]
    raise ValueError(f"chat data file {path!r}: the format must be .jsonl, .json or .parquet, not {file.suffix!r}")


def json_value(text: str, path: str, line: int | None = None) -> Any:
    """``text`` parsed as JSON; malformed, a `ValueError` naming the file and its line (``line``: the text is that
    line of the file, as in JSON Lines)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{path}, line {line or error.lineno}, column {error.colno}: not valid JSON ({error.msg})"
        ) from None
