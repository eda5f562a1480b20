# SPDX-License-Identifier: Apache-2.0
"""Chat `documents` as chunks, placed where the chat template renders them.

vLLM hands a chat request's `documents` to the chat template, which renders
them its own way (Command-R, Granite and RAG templates do). With the chunk
cache on, every document becomes a chunk exactly where its text lands:

1. `mark_documents`: every string field of document i is wrapped in two
   markers of private-use characters naming i, before the template runs;
2. `documents_prompt`: in the rendered text, document i spans from its first
   start marker to its last end marker (the template's words between its
   fields included); the text before the first document is the system
   segment, the text after the last the question, and text between two
   documents (the template's separators, often numbered) a chunk of its own.
   Spaces right before a document go with it (BPE and SentencePiece put a
   word's leading space in its token). The markers are removed and every
   piece is tokenized on its own.

NOTE: the pieces' tokens must equal the tokens of the whole rendered text
(what the template gives without the chunk cache): the prompt is tokenized
twice to check it, and a template whose text around a document merges into
one token with it is refused (400), never served with other tokens.

A template that ignores `documents`, drops one, renders one twice around
another, or puts one first (no system segment) is refused with a 400 that
says which; the documents then have to go in the messages (separator form).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from vllm.renderers.chunk_split import SEGMENTS_KEY, ChunkPromptError

_START, _START_END = "\ue000", "\ue001"
_END, _END_END = "\ue002", "\ue003"
_MARKER = re.compile("[\ue000\ue002]([0-9]+)[\ue001\ue003]")
_PRIVATE = re.compile("[\ue000-\ue003]")


@dataclass(frozen=True)
class MarkedDocuments:
    """The documents of one chat request, marked for the template."""

    count: int


def mark_documents(chat_params: Any) -> tuple[Any, MarkedDocuments | None]:
    """`chat_params` with every document's fields wrapped in markers; None
    when the request has no documents (nothing to do)."""
    kwargs = chat_params.chat_template_kwargs or {}
    documents = kwargs.get("documents")
    if documents is None:
        return chat_params, None
    if not isinstance(documents, list) or not documents:
        raise ChunkPromptError("'documents' must be a non-empty list of documents",
                               parameter="documents")
    marked = []
    for i, doc in enumerate(documents):
        if not isinstance(doc, dict) or not doc or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in doc.items()):
            raise ChunkPromptError(
                f"documents[{i}] must be an object of string fields "
                '(e.g. {"title": "...", "text": "..."})', parameter="documents")
        if not any(v for v in doc.values()):
            raise ChunkPromptError(f"documents[{i}] is empty", parameter="documents")
        if any(_PRIVATE.search(v) for v in doc.values()):
            raise ChunkPromptError(
                f"documents[{i}] contains a character of U+E000..U+E003, which the "
                "chunk cache uses to find documents in the rendered prompt",
                parameter="documents")
        marked.append({k: f"{_START}{i}{_START_END}{v}{_END}{i}{_END_END}"
                       for k, v in doc.items()})
    params = dataclasses.replace(
        chat_params, chat_template_kwargs={**kwargs, "documents": marked})
    return params, MarkedDocuments(len(documents))


def documents_prompt(prompt: dict, marked: MarkedDocuments, tokenizer: Any,
                     add_special_tokens: bool) -> dict:
    """The rendered prompt as token-id segments: system, documents (and the
    template's text between them), question."""
    text = prompt.get("prompt")
    if not isinstance(text, str) or "prompt_token_ids" in prompt:
        raise ChunkPromptError(
            "this model's chat template renders token ids, not text: 'documents' "
            "cannot be placed as chunks; put them in the messages",
            parameter="documents")
    pieces = _split(text, marked.count)
    token_lists = [
        list(tokenizer.encode(piece, add_special_tokens=add_special_tokens and i == 0))
        for i, piece in enumerate(pieces)
    ]
    whole = list(tokenizer.encode("".join(pieces), add_special_tokens=add_special_tokens))
    if [t for ids in token_lists for t in ids] != whole:
        raise ChunkPromptError(
            "the chat template's text next to a document merges with it into one "
            "token, so the documents cannot be cached apart without changing the "
            "prompt's tokens; put the documents in the messages instead",
            parameter="documents")
    out = {k: v for k, v in prompt.items() if k != "prompt"}
    out[SEGMENTS_KEY] = token_lists
    return out


def _split(text: str, count: int) -> list[str]:
    """[system, doc, (between), doc, ..., question], markers removed."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for m in _MARKER.finditer(text):
        i = int(m.group(1))
        first.setdefault(i, m.start())
        last[i] = m.end()
    if not first:
        raise ChunkPromptError(
            "this model's chat template does not render 'documents'; put the "
            "documents in the messages (marked with the chunk separator) or use a "
            "template that renders them", parameter="documents")
    missing = [i for i in range(count) if i not in first]
    if missing:
        raise ChunkPromptError(
            f"the chat template drops documents {missing}: every document must "
            "appear in the prompt", parameter="documents")
    order = sorted(first, key=first.get)
    pieces = [text[:first[order[0]]]]
    for k, i in enumerate(order):
        region = text[first[i]:last[i]]
        if {int(n) for n in _MARKER.findall(region)} != {i}:
            raise ChunkPromptError(
                f"the chat template renders document {i} around another one: "
                "documents must each render in one place", parameter="documents")
        # NOTE: a space before a word belongs to the word's token in BPE and
        # SentencePiece vocabularies ("Title: Paris" -> "Title", ":", " Paris"):
        # the spaces that end the text before a document go with the document.
        before = pieces[-1]
        spaces = len(before) - len(before.rstrip(" "))
        if spaces:
            pieces[-1] = before[:-spaces]
        pieces.append(before[len(before) - spaces:] + _MARKER.sub("", region))
        if k + 1 < len(order):
            between = text[last[i]:first[order[k + 1]]]
            if between:
                pieces.append(between)
    pieces.append(text[last[order[-1]]:])
    if len(order) != count or any(_PRIVATE.search(piece) for piece in pieces):
        raise ChunkPromptError(
            "the chat messages contain characters of U+E000..U+E003, which the "
            "chunk cache uses to find documents in the rendered prompt",
            parameter="messages")
    if not pieces[0] or not pieces[-1]:
        where = "first" if not pieces[0] else "last"
        raise ChunkPromptError(
            f"the chat template renders a document {where}, with no text "
            f"{'before' if where == 'first' else 'after'} it: the chunk cache needs "
            "a system segment before the documents and a question after them",
            parameter="documents")
    return pieces
