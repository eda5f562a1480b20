# SPDX-License-Identifier: Apache-2.0
"""Chat documents as chunks where the template renders them
(vllm/renderers/chunk_documents.py): `documents` and content parts marked
"chunk", with real jinja2 templates and a real (offline) tokenizer: the
pieces, their tokens equal to the whole rendered prompt's, and every refusal."""

import asyncio

import jinja2
import pytest
from vllm.exceptions import VLLMValidationError
from vllm.renderers.chunk_documents import (
    chunks_prompt,
    chunks_prompt_async,
    mark_chunks,
)
from vllm.renderers.chunk_split import SEGMENTS_KEY, ChunkPromptError
from vllm.renderers.params import ChatParams

from tests.unit.conftest import build_toy_tokenizer

# A RAG template in the style of Command-R / Granite: numbered documents
# between the system prompt and the conversation.
RAG = (
    "System: {{ messages[0].content }}\n"
    "{% for d in documents %}Document {{ loop.index }}: {{ d.title }}\n{{ d.text }}\n"
    "{% endfor %}User: {{ messages[-1].content }}\nAssistant:"
)
MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Where is the tower?"},
]
DOCS = [
    {"title": "Paris", "text": "The Eiffel Tower is in Paris."},
    {"title": "Berlin", "text": "## The Brandenburg Gate ## is in Berlin."},
]


def pieces(template=RAG, docs=DOCS, messages=MESSAGES):
    kwargs = {} if docs is None else {"documents": docs}
    params, (messages,), (marked,) = mark_chunks(
        ChatParams(chat_template_kwargs=kwargs), [messages]
    )
    text = jinja2.Template(template).render(
        messages=messages, **params.chat_template_kwargs
    )
    tok = build_toy_tokenizer()
    out = chunks_prompt({"prompt": text}, marked, tok, False)

    async def encode(text, add_special_tokens):
        return tok.encode(text, add_special_tokens=add_special_tokens)

    # The async path (the renderer's async tokenizer) gives the same prompt.
    assert (
        asyncio.run(chunks_prompt_async({"prompt": text}, marked, encode, False)) == out
    )
    return [tok.decode(ids) for ids in out[SEGMENTS_KEY]], out


def test_every_document_is_a_chunk_where_the_template_renders_it():
    texts, out = pieces()
    assert texts == [
        "System: Answer briefly.\nDocument 1:",
        " Paris\nThe Eiffel Tower is in Paris.",  # a word's space goes with it
        "\nDocument 2:",  # the template's words between two documents: a chunk
        " Berlin\n## The Brandenburg Gate ## is in Berlin.",  # the separator is text
        "\nUser: Where is the tower?\nAssistant:",
    ]
    # The tokens are the template's own (what it gives without the chunk cache).
    tok = build_toy_tokenizer()
    plain = jinja2.Template(RAG).render(messages=MESSAGES, documents=DOCS)
    assert [t for ids in out[SEGMENTS_KEY] for t in ids] == tok.encode(
        plain, add_special_tokens=False
    )
    assert "prompt" not in out


def test_no_documents_no_change():
    params = ChatParams(chat_template_kwargs={"add_generation_prompt": True})
    assert mark_chunks(params, [MESSAGES]) == (params, [MESSAGES], [None])


# ChatML-like, content parts joined with a newline (vLLM's "string" format).
CHATML = (
    "{% for m in messages %}<|{{ m.role }}|>\n"
    "{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{{ p.text }}{% if not loop.last %}\n{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}<|assistant|>\n"
)


def test_content_parts_marked_chunk_are_chunks_and_the_rest_the_question():
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {
            "role": "user",
            "content": [
                {
                    "type": "text",
                    "text": "Doc one: the tower is in Paris.",
                    "chunk": True,
                },
                {"type": "text", "text": "## Doc two ##", "chunk": True},
                {"type": "text", "text": "Where is the tower?"},
            ],
        },
    ]
    texts, _ = pieces(CHATML, None, messages)
    assert texts == [
        "<|system|>\nAnswer briefly.\n<|user|>\n",
        "Doc one: the tower is in Paris.",
        "\n",
        "## Doc two ##",
        "\nWhere is the tower?\n<|assistant|>",  # (jinja drops the last newline)
    ]


@pytest.mark.parametrize(
    "part,message",
    [
        ({"type": "text", "text": "x", "chunk": "yes"}, "must be true or false"),
        ({"type": "text", "text": "", "chunk": True}, "not a non-empty text part"),
        (
            {"type": "image_url", "image_url": {"url": "u"}, "chunk": True},
            "not a non-empty text part",
        ),
    ],
)
def test_bad_marked_parts_are_refused(part, message):
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "q"}]}]
    with pytest.raises(ChunkPromptError, match=message):
        mark_chunks(ChatParams(), [messages])


def test_a_part_marked_false_is_plain_text():
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "sys"},
                {"type": "text", "text": "d", "chunk": False},
                {"type": "text", "text": "q"},
            ],
        }
    ]
    _, (out,), (marked,) = mark_chunks(ChatParams(), [messages])
    assert marked is None and out[0]["content"][1] == {"type": "text", "text": "d"}


@pytest.mark.parametrize(
    "template,message",
    [
        (
            "System: {{ messages[0].content }}\nUser: {{ messages[-1].content }}",
            "does not render 'documents'",
        ),
        ("S: x {{ documents[0].text }} q", "drops documents\\[1\\]"),
        (
            "S: {% for d in documents %}{{ d.title }} {% endfor %}"
            "{% for d in documents %}{{ d.text }} {% endfor %}q",
            "around another document",
        ),
        (
            "{% for d in documents %}{{ d.text }}\n{% endfor %}q",
            "renders a document first",
        ),
        (
            "S: {% for d in documents %}\n{{ d.text }}{% endfor %}",
            "renders a document last",
        ),
    ],
)
def test_templates_that_cannot_place_documents_are_refused(template, message):
    with pytest.raises(ChunkPromptError, match=message) as e:
        pieces(template)
    assert isinstance(e.value, VLLMValidationError)


@pytest.mark.parametrize(
    "docs,message",
    [
        ([], "non-empty list"),
        ([{"text": 3}], "string fields"),
        (["just a string"], "string fields"),
        ([{"title": "", "text": ""}], "documents\\[0\\] is empty"),
        ([{"text": "a \ue000 b"}], "U\\+E000"),
    ],
)
def test_bad_documents_are_refused(docs, message):
    with pytest.raises(ChunkPromptError, match=message):
        mark_chunks(ChatParams(chat_template_kwargs={"documents": docs}), [MESSAGES])


def test_a_token_across_a_document_edge_is_refused():
    # No space or newline between the template's word and the document: the
    # tokenizer merges "Doc" into the document's first word.
    template = "S: x\n{% for d in documents %}Doc{{ d.text }}\n{% endfor %}q"
    with pytest.raises(ChunkPromptError, match="merges with it into one token"):
        pieces(template, [{"text": "ument one"}])
