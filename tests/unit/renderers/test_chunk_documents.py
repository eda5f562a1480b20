# SPDX-License-Identifier: Apache-2.0
"""Chat `documents` as chunks where the template renders them
(vllm/renderers/chunk_documents.py), with real jinja2 templates and a real
(offline) tokenizer: the pieces, their tokens equal to the whole rendered
prompt's, and every refusal."""

import jinja2
import pytest

from vllm.exceptions import VLLMValidationError
from vllm.renderers.chunk_documents import documents_prompt, mark_documents
from vllm.renderers.chunk_split import SEGMENTS_KEY, ChunkPromptError
from vllm.renderers.params import ChatParams
from tests.unit.conftest import build_toy_tokenizer

# A RAG template in the style of Command-R / Granite: numbered documents
# between the system prompt and the conversation.
RAG = ("System: {{ messages[0].content }}\n"
       "{% for d in documents %}Document {{ loop.index }}: {{ d.title }}\n{{ d.text }}\n"
       "{% endfor %}User: {{ messages[-1].content }}\nAssistant:")
MESSAGES = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Where is the tower?"}]
DOCS = [{"title": "Paris", "text": "The Eiffel Tower is in Paris."},
        {"title": "Berlin", "text": "## The Brandenburg Gate ## is in Berlin."}]


def render(template, params):
    return jinja2.Template(template).render(messages=MESSAGES,
                                            **params.chat_template_kwargs)


def pieces(template=RAG, docs=DOCS):
    params, marked = mark_documents(ChatParams(chat_template_kwargs={"documents": docs}))
    tok = build_toy_tokenizer()
    out = documents_prompt({"prompt": render(template, params)}, marked, tok, False)
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
        plain, add_special_tokens=False)
    assert "prompt" not in out


def test_no_documents_no_change():
    params = ChatParams(chat_template_kwargs={"add_generation_prompt": True})
    assert mark_documents(params) == (params, None)


@pytest.mark.parametrize("template,message", [
    ("System: {{ messages[0].content }}\nUser: {{ messages[-1].content }}",
     "does not render 'documents'"),
    ("S: x {{ documents[0].text }} q", "drops documents \\[1\\]"),
    ("S: {% for d in documents %}{{ d.title }} {% endfor %}"
     "{% for d in documents %}{{ d.text }} {% endfor %}q", "around another one"),
    ("{% for d in documents %}{{ d.text }}\n{% endfor %}q", "renders a document first"),
    ("S: {% for d in documents %}\n{{ d.text }}{% endfor %}", "renders a document last"),
])
def test_templates_that_cannot_place_documents_are_refused(template, message):
    with pytest.raises(ChunkPromptError, match=message) as e:
        pieces(template)
    assert isinstance(e.value, VLLMValidationError)


@pytest.mark.parametrize("docs,message", [
    ([], "non-empty list"),
    ([{"text": 3}], "string fields"),
    (["just a string"], "string fields"),
    ([{"title": "", "text": ""}], "documents\\[0\\] is empty"),
    ([{"text": "a \ue000 b"}], "U\\+E000"),
])
def test_bad_documents_are_refused(docs, message):
    with pytest.raises(ChunkPromptError, match=message):
        mark_documents(ChatParams(chat_template_kwargs={"documents": docs}))


def test_a_token_across_a_document_edge_is_refused():
    # No space or newline between the template's word and the document: the
    # tokenizer merges "Doc" into the document's first word.
    template = "S: x\n{% for d in documents %}Doc{{ d.text }}\n{% endfor %}q"
    with pytest.raises(ChunkPromptError, match="merges with it into one token"):
        pieces(template, [{"text": "ument one"}])
