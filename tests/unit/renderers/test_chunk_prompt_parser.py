# SPDX-License-Identifier: Apache-2.0
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.renderers.chunk_prompt_parser import (
    ChunkedPromptParser,
    find_separator_starts,
)
from vllm.v1.core.chunk_structures import ChunkedPrompt, SegmentSpan


def make_parser(sep="##", max_chunks=8, max_chunk_tokens=64) -> ChunkedPromptParser:
    return ChunkedPromptParser(sep, max_chunks, max_chunk_tokens)


def segments_of(prompt: ChunkedPrompt) -> list[list[int]]:
    return [prompt.segment_tokens(i) for i in range(prompt.num_segments)]


# ------------------------------------------------------------------ text


def test_no_separator_is_not_a_chunked_prompt(toy_tokenizer):
    parser = make_parser()
    assert parser.parse_text("just a question", toy_tokenizer) is None
    assert parser.split_text("a # b") is None


def test_each_segment_tokenized_alone_bos_only_first(toy_tokenizer):
    parser = make_parser()
    prompt = parser.parse_text(
        "You are helpful.##Paris doc##Berlin doc##Q?", toy_tokenizer
    )
    enc = toy_tokenizer.encode
    expected = [
        enc("You are helpful.", add_special_tokens=True),
        enc("Paris doc", add_special_tokens=False),
        enc("Berlin doc", add_special_tokens=False),
        enc("Q?", add_special_tokens=False),
    ]
    assert segments_of(prompt) == expected
    bos = toy_tokenizer.bos_token_id
    assert prompt.token_ids[0] == bos
    assert bos not in prompt.token_ids[1:]
    assert prompt.num_chunks == 2
    assert prompt.system_span == SegmentSpan(0, len(expected[0]))
    assert prompt.question_span.end == len(prompt.token_ids)
    # The separator's token never survives.
    assert parser.separator_token_ids(toy_tokenizer)[0] not in prompt.token_ids


def test_same_document_same_tokens_anywhere(toy_tokenizer):
    parser = make_parser()
    a = parser.parse_text("sys one##The fox##Paris##q", toy_tokenizer)
    b = parser.parse_text("other system##Paris##The fox##another q", toy_tokenizer)
    assert a.segment_tokens(1) == b.segment_tokens(2)
    assert a.segment_tokens(2) == b.segment_tokens(1)


@pytest.mark.parametrize(
    "spaced",
    [
        "sys ## doc one ## q",
        "sys  ##\n doc one \t##  q",
        "sys\u3000##\u00a0doc one\n##q",
    ],
)
def test_whitespace_next_to_separator_is_stripped(toy_tokenizer, spaced):
    parser = make_parser()
    tight = parser.parse_text("sys##doc one##q", toy_tokenizer)
    assert parser.parse_text(spaced, toy_tokenizer) == tight


def test_whitespace_away_from_separators_is_kept():
    parser = make_parser()
    assert parser.split_text("  sys ## a  b ## q  ") == ["  sys", "a  b", "q  "]


def test_separator_at_start_gives_bos_only_system(toy_tokenizer):
    # With a BOS-adding tokenizer the (text-empty) system segment is [BOS].
    prompt = make_parser().parse_text("##doc##q", toy_tokenizer)
    assert prompt.segment_tokens(0) == [toy_tokenizer.bos_token_id]


class _NoSpecialTokens:
    """Wraps a tokenizer so that no special token is ever added."""

    def __init__(self, inner):
        self.inner = inner

    def encode(self, text, add_special_tokens=True):
        return self.inner.encode(text, add_special_tokens=False)


def test_separator_at_start_without_bos_is_an_empty_segment(toy_tokenizer):
    with pytest.raises(ValueError, match=r"segment 0 is empty.*at least 1 token"):
        make_parser().parse_text("##doc##q", _NoSpecialTokens(toy_tokenizer))


def test_separator_at_end_is_an_empty_question(toy_tokenizer):
    with pytest.raises(ValueError, match=r"segment 2 is empty"):
        make_parser().parse_text("sys##doc## ", toy_tokenizer)


def test_consecutive_separators_are_an_empty_chunk(toy_tokenizer):
    with pytest.raises(ValueError, match=r"segment 1 is empty"):
        make_parser().parse_text("sys####doc##q", toy_tokenizer)
    with pytest.raises(ValueError, match=r"segment 2 is empty"):
        make_parser().parse_text("sys##doc## ##q", toy_tokenizer)


def test_separator_characters_inside_words():
    parser = make_parser()
    # A single '#' is text; '###' splits at the leftmost '##' like str.split.
    assert parser.split_text("C# rocks##F# too##q") == ["C# rocks", "F# too", "q"]
    assert parser.split_text("a###b") == ["a", "#b"]
    assert parser.split_text("x##y#") == ["x", "y#"]


def test_unicode_text_and_separator(toy_tokenizer):
    parser = make_parser(sep="§§")
    prompt = parser.parse_text("系统提示§§文档一：北京 🙂§§问题？", toy_tokenizer)
    enc = toy_tokenizer.encode
    assert segments_of(prompt) == [
        enc("系统提示", add_special_tokens=True),
        enc("文档一：北京 🙂", add_special_tokens=False),
        enc("问题？", add_special_tokens=False),
    ]
    assert toy_tokenizer.decode(prompt.segment_tokens(1)) == "文档一：北京 🙂"


def test_max_chunks(toy_tokenizer):
    parser = make_parser(max_chunks=2)
    assert parser.parse_text("s##a##b##q", toy_tokenizer).num_chunks == 2
    with pytest.raises(ValueError, match=r"3 chunks .*--max-chunks 2"):
        parser.parse_text("s##a##b##c##q", toy_tokenizer)
    with pytest.raises(ValueError, match=r"--max-chunks 2"):
        parser.parse_token_ids([1, 9, 2, 9, 3, 9, 4, 9, 5], [9])


def test_max_chunk_tokens_names_segment_and_limit(toy_tokenizer):
    parser = make_parser(max_chunk_tokens=4)
    with pytest.raises(
        ValueError,
        match=r"segment 1 has 5 tokens, more than "
        r"--max-chunk-tokens 4",
    ):
        parser.parse_token_ids([1, 9, 2, 3, 4, 5, 6, 9, 7], [9])
    with pytest.raises(ValueError, match=r"segment 0 has \d+ tokens"):
        parser.parse_text("a long system prompt here##d##q", toy_tokenizer)
    # The question is not cached, hence not bound by the chunk limit.
    prompt = parser.parse_token_ids([1, 9, 2, 9, 3, 4, 5, 6, 7, 8], [9])
    assert prompt.question_span.num_tokens == 6


@pytest.mark.parametrize("sep", ["", " ##", "## ", "\n"])
def test_invalid_separator(sep):
    with pytest.raises(ValueError, match="separator"):
        ChunkedPromptParser(sep, 8, 64)


def test_invalid_limits():
    with pytest.raises(ValueError, match="--max-chunk-tokens >= 1, not 8 and 0"):
        ChunkedPromptParser("##", 8, 0)


# ---------------------------------------------------------------- tokens


def test_token_level_split_drops_separator_ids():
    prompt = make_parser().parse_token_ids([1, 2, 7, 8, 3, 7, 8, 4, 5], [7, 8])
    assert prompt.token_ids == [1, 2, 3, 4, 5]
    assert prompt.spans == (SegmentSpan(0, 2), SegmentSpan(2, 3), SegmentSpan(3, 5))


@pytest.mark.parametrize(
    "as_input",
    [list, np.asarray, torch.tensor, lambda x: torch.tensor(x, dtype=torch.int32)],
)
def test_token_level_accepts_lists_arrays_tensors(as_input):
    prompt = make_parser().parse_token_ids(as_input([1, 7, 8, 2, 7, 8, 3]), [7, 8])
    assert segments_of(prompt) == [[1], [2], [3]]


def test_token_level_no_separator_or_too_short():
    parser = make_parser()
    assert parser.parse_token_ids([1, 2, 3], [7, 8]) is None
    assert parser.parse_token_ids([7], [7, 8]) is None
    assert parser.parse_token_ids([1, 7, 2, 8], [7, 8]) is None
    with pytest.raises(ValueError, match="must not be empty"):
        parser.parse_token_ids([1, 2], [])


def test_token_level_overlapping_matches_are_leftmost_non_overlapping():
    # Mirrors "a###b".split("##") == ["a", "#b"].
    starts = find_separator_starts(np.array([1, 5, 5, 5, 2]), np.array([5, 5]))
    assert starts.tolist() == [1]
    starts = find_separator_starts(np.array([5, 5, 5, 5, 1]), np.array([5, 5]))
    assert starts.tolist() == [0, 2]
    prompt = make_parser().parse_token_ids([1, 5, 5, 5, 2], [5, 5])
    assert segments_of(prompt) == [[1], [5, 2]]


def test_token_level_edge_separators_are_empty_segments():
    parser = make_parser()
    with pytest.raises(ValueError, match="segment 0 is empty"):
        parser.parse_token_ids([9, 1, 9, 2], [9])
    with pytest.raises(ValueError, match="segment 2 is empty"):
        parser.parse_token_ids([1, 9, 2, 9], [9])
    with pytest.raises(ValueError, match="segment 1 is empty"):
        parser.parse_token_ids([1, 9, 9, 2], [9])


def test_text_and_token_level_agree(toy_tokenizer):
    parser = make_parser()
    text = "Be brief.##The fox doc##Paris doc##Which capital?"
    from_text = parser.parse_text(text, toy_tokenizer)
    sep_ids = parser.separator_token_ids(toy_tokenizer)
    joined: list[int] = []
    for i in range(from_text.num_segments):
        if i:
            joined += sep_ids
        joined += from_text.segment_tokens(i)
    assert parser.parse_token_ids(joined, sep_ids) == from_text


# ------------------------------------------------------------ properties

_SEGMENT_TEXT = (
    st.text(
        alphabet=st.characters(blacklist_characters="#", blacklist_categories=("Cs",)),
        min_size=1,
        max_size=12,
    )
    .map(str.strip)
    .filter(bool)
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_SEGMENT_TEXT, min_size=2, max_size=6))
def test_text_round_trip(segments):
    parser = make_parser()
    assert parser.split_text("##".join(segments)) == segments


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.text(alphabet="abc xyz", min_size=1, max_size=8).map(str.strip).filter(bool),
        min_size=2,
        max_size=5,
    ),
    st.lists(st.sampled_from(["", " ", "  ", "\n", "\t "]), min_size=10, max_size=10),
)
def test_whitespace_around_separator_never_changes_tokens(
    toy_tokenizer, segments, pads
):
    tokenizer = toy_tokenizer
    parser = make_parser()
    tight = "##".join(segments)
    spaced = "".join(
        (pads[2 * i - 1] + "##" + pads[2 * i] if i else "") + seg
        for i, seg in enumerate(segments)
    )
    assert parser.parse_text(spaced, tokenizer) == parser.parse_text(tight, tokenizer)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.lists(st.integers(0, 6), min_size=1, max_size=10), min_size=2, max_size=8
    ),
    st.sampled_from([[7], [7, 8], [8, 7, 8]]),
)
def test_token_round_trip(segments, sep):
    # Segment ids never contain separator ids, so joins cannot fake a match.
    joined: list[int] = []
    for i, seg in enumerate(segments):
        joined += (sep if i else []) + seg
    prompt = make_parser(max_chunks=10, max_chunk_tokens=10).parse_token_ids(
        joined, sep
    )
    assert segments_of(prompt) == segments


def test_separator_that_encodes_to_nothing_is_rejected(toy_tokenizer):
    class Empty:
        def encode(self, text, add_special_tokens=True):
            return []

    with pytest.raises(ValueError, match="encodes to no tokens"):
        make_parser().separator_token_ids(Empty())
