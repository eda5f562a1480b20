# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Chat documents as chunks, placed where the chat template renders them.

Documents come in vLLM's `documents` field (rendered by the chat template) or
as message text parts marked `"chunk": true`. `mark_chunks` wraps each one's
text in private-use markers before the template runs; `chunks_prompt` cuts the
rendered text at them into the system segment, the chunks (text between two
documents is a chunk of its own) and the question, each tokenized on its own.
Their tokens must equal the whole text's: a template that merges a document's
edge into a token, or ignores, drops, nests or puts first or last a document,
is refused with a 400 saying which.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import regex as re

from vllm.renderers.chunk_split import SEGMENTS_KEY, ChunkPromptError

_START, _START_END = "\ue000", "\ue001"
_END, _END_END = "\ue002", "\ue003"
_MARKER = re.compile("[\ue000\ue002]([0-9]+)[\ue001\ue003]")
_PRIVATE = re.compile("[\ue000-\ue003]")
# The key of a message content part that marks it as a chunk.
PART_KEY = "chunk"


@dataclass(frozen=True)
class MarkedChunks:
    """What was marked for one conversation: chunk i is `names[i]`."""

    names: tuple[str, ...]


def mark_chunks(
    chat_params: Any, conversations: Sequence[list[Any]]
) -> tuple[Any, list[list[Any]], list[MarkedChunks | None]]:
    """`chat_params` and the conversations with every document and marked part
    wrapped in markers; per conversation what was marked (None: nothing)."""
    kwargs = chat_params.chat_template_kwargs or {}
    documents = kwargs.get("documents")
    names: list[str] = []
    if documents is not None:
        chat_params = dataclasses.replace(
            chat_params,
            chat_template_kwargs={**kwargs, "documents": _mark_documents(documents)},
        )
        names = [f"documents[{i}]" for i in range(len(documents))]
    out_conversations, marked = [], []
    for messages in conversations:
        messages, parts = _mark_parts(messages, first=len(names))
        out_conversations.append(messages)
        all_names = tuple(names + parts)
        marked.append(MarkedChunks(all_names) if all_names else None)
    return chat_params, out_conversations, marked


def unmark_conversation(conversation: list[Any]) -> list[Any]:
    """The rendered conversation (what the server echoes) without the markers:
    they are the chunk cache's, never the client's."""

    def clean(value: Any) -> Any:
        if isinstance(value, str):
            return _MARKER.sub("", value)
        if isinstance(value, list):
            return [clean(v) for v in value]
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        return value

    return [clean(message) for message in conversation]


def chunks_prompt(
    prompt: dict, marked: MarkedChunks, tokenizer: Any, add_special_tokens: bool
) -> dict:
    """The rendered prompt as token-id segments: system, chunks (and the
    template's text between them), question."""
    pieces = _pieces(prompt, marked)
    token_lists = [
        list(tokenizer.encode(piece, add_special_tokens=add_special_tokens and i == 0))
        for i, piece in enumerate(pieces)
    ]
    whole = tokenizer.encode("".join(pieces), add_special_tokens=add_special_tokens)
    return _segments_prompt(prompt, token_lists, list(whole))


async def chunks_prompt_async(
    prompt: dict,
    marked: MarkedChunks,
    encode_async: Callable[..., Awaitable[list[int]]],
    add_special_tokens: bool,
) -> dict:
    """`chunks_prompt` with the pieces tokenized off the event loop by
    `encode_async` (the renderer's own, as for the separator form)."""
    pieces = _pieces(prompt, marked)
    *token_lists, whole = await asyncio.gather(
        *(
            encode_async(piece, add_special_tokens=add_special_tokens and i == 0)
            for i, piece in enumerate(pieces)
        ),
        encode_async("".join(pieces), add_special_tokens=add_special_tokens),
    )
    return _segments_prompt(prompt, [list(ids) for ids in token_lists], list(whole))


def _pieces(prompt: dict, marked: MarkedChunks) -> list[str]:
    text = prompt.get("prompt")
    if not isinstance(text, str) or "prompt_token_ids" in prompt:
        raise ChunkPromptError(
            "this model's chat template renders token ids, not text: documents "
            "cannot be placed as chunks; separate them with --chunk-separator",
            parameter="documents",
        )
    return _split(text, marked.names)


def _segments_prompt(
    prompt: dict, token_lists: list[list[int]], whole: list[int]
) -> dict:
    if list(chain.from_iterable(token_lists)) != whole:
        raise ChunkPromptError(
            "the chat template's text next to a document merges with it into one "
            "token, so the documents cannot be cached apart without changing the "
            "prompt's tokens; separate them with --chunk-separator instead",
            parameter="documents",
        )
    out = {k: v for k, v in prompt.items() if k != "prompt"}
    out[SEGMENTS_KEY] = token_lists
    return out


def _wrap(i: int, text: str) -> str:
    return f"{_START}{i}{_START_END}{text}{_END}{i}{_END_END}"


def _check_text(name: str, text: str) -> None:
    if _PRIVATE.search(text):
        raise ChunkPromptError(
            f"{name} contains a character of U+E000..U+E003, which the chunk "
            "cache uses to find documents in the rendered prompt",
            parameter=name.split("[", 1)[0],
        )


def _mark_documents(documents: Any) -> list[dict[str, str]]:
    if not isinstance(documents, list) or not documents:
        raise ChunkPromptError(
            "'documents' must be a non-empty list of documents", parameter="documents"
        )
    marked = []
    for i, doc in enumerate(documents):
        fields = list(doc.items()) if isinstance(doc, dict) else []
        if not fields or not all(isinstance(x, str) for kv in fields for x in kv):
            raise ChunkPromptError(
                f"documents[{i}] must be an object of string fields "
                '(e.g. {"title": "...", "text": "..."})',
                parameter="documents",
            )
        if not any(v for v in doc.values()):
            raise ChunkPromptError(f"documents[{i}] is empty", parameter="documents")
        for v in doc.values():
            _check_text(f"documents[{i}]", v)
        marked.append({k: _wrap(i, v) for k, v in doc.items()})
    return marked


def _mark_parts(messages: list[Any], first: int) -> tuple[list[Any], list[str]]:
    """The messages with every content part marked `"chunk": true` wrapped
    (chunk indices from `first` on); the names of those parts."""
    names: list[str] = []
    out = []
    for m, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(
            isinstance(p, dict) and PART_KEY in p for p in content
        ):
            out.append(message)
            continue
        parts = []
        for p, part in enumerate(content):
            if not isinstance(part, dict) or PART_KEY not in part:
                parts.append(part)
                continue
            name = f"messages[{m}].content[{p}]"
            flag = part[PART_KEY]
            if not isinstance(flag, bool):
                raise ChunkPromptError(
                    f"{name}.{PART_KEY} must be true or false", parameter="messages"
                )
            part = {k: v for k, v in part.items() if k != PART_KEY}
            if flag:
                text = part.get("text")
                if part.get("type") != "text" or not isinstance(text, str) or not text:
                    raise ChunkPromptError(
                        f"{name} is marked as a chunk but is not a non-empty text part",
                        parameter="messages",
                    )
                _check_text(name, text)
                part["text"] = _wrap(first + len(names), text)
                names.append(name)
            parts.append(part)
        out.append({**message, "content": parts})
    return out, names


def _split(text: str, names: tuple[str, ...]) -> list[str]:
    """[system, chunk, (between), chunk, ..., question], markers removed."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for m in _MARKER.finditer(text):
        i = int(m.group(1))
        first.setdefault(i, m.start())
        last[i] = m.end()
    if not first:
        raise ChunkPromptError(
            "this model's chat template does not render 'documents'; put the "
            'documents in the messages (text parts marked "chunk": true, or '
            "separated by --chunk-separator) or use a template that renders them",
            parameter="documents",
        )
    missing = [names[i] for i in range(len(names)) if i not in first]
    if missing:
        raise ChunkPromptError(
            f"the chat template drops {', '.join(missing)}: every document must "
            "appear in the prompt",
            parameter="documents",
        )
    order = sorted(first, key=first.__getitem__)
    pieces = [text[: first[order[0]]]]
    for k, i in enumerate(order):
        region = text[first[i] : last[i]]
        if {int(n) for n in _MARKER.findall(region)} != {i}:
            raise ChunkPromptError(
                f"the chat template renders {names[i]} around another document: "
                "documents must each render in one place",
                parameter="documents",
            )
        # BPE and SentencePiece put a word's leading space in its token
        # ("Title: Paris" -> "Title", ":", " Paris"): the spaces go with the chunk.
        before = pieces[-1]
        spaces = len(before) - len(before.rstrip(" "))
        if spaces:
            pieces[-1] = before[:-spaces]
        pieces.append(before[len(before) - spaces :] + _MARKER.sub("", region))
        if k + 1 < len(order):
            between = text[last[i] : first[order[k + 1]]]
            if between:
                pieces.append(between)
    pieces.append(text[last[order[-1]] :])
    if len(order) != len(names) or any(_PRIVATE.search(piece) for piece in pieces):
        raise ChunkPromptError(
            "the chat messages contain characters of U+E000..U+E003, which the "
            "chunk cache uses to find documents in the rendered prompt",
            parameter="messages",
        )
    if not pieces[0] or not pieces[-1]:
        where = "first" if not pieces[0] else "last"
        raise ChunkPromptError(
            f"the chat template renders a document {where}, with no text "
            f"{'before' if where == 'first' else 'after'} it: the chunk cache needs "
            "a system segment before the documents and a question after them",
            parameter="documents",
        )
    return pieces
