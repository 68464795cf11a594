"""Topic patterns (gateway/core/selection.py), pure: the matcher against a plain recursive
reference and RabbitMQ's documented examples, the hostile shapes that stalled the regex it
replaces (checked by result and by the words walked, never by a clock), and the normal form
and the 255-byte bound callers store and check patterns by."""

import functools
from typing import List

import pytest
from hypothesis import given, settings, strategies as st

from gateway.core import selection
from gateway.core.selection import (MAX_PATTERN_BYTES, TopicMatcher, checked_pattern, normalized, selects_every_key,
                                    topic_pattern)

from .support import examples


def words(text: str) -> List[str]:
    """RabbitMQ's split: "" has no words; every other text its dot-separated ones, empty or not."""
    return text.split(".") if text else []


def reference(pattern: str, key: str) -> bool:
    """The obvious recursion, memoised over (pattern word, key word)."""
    p, k = words(pattern), words(key)

    @functools.cache
    def match(i: int, j: int) -> bool:
        if i == len(p):
            return j == len(k)
        if p[i] == "#":
            return match(i + 1, j) or (j < len(k) and match(i, j + 1))
        return j < len(k) and p[i] in ("*", k[j]) and match(i + 1, j + 1)

    return match(0, 0)


def matches(pattern: str, key: str) -> bool:
    return topic_pattern(pattern)(key.encode("utf-8"))


def j(*parts: str) -> str:
    return ".".join(parts)


KEY_128 = j(*["a"] * 128)  # 255 bytes: the most words a key can have
assert len(KEY_128) == MAX_PATTERN_BYTES


# -- the matcher -------------------------------------------------------------------------------
@settings(max_examples=examples(2000))
@given(st.lists(st.sampled_from(["a", "b", "", "*", "#"]), max_size=12),
       st.lists(st.sampled_from(["a", "b", ""]), max_size=12))
def test_the_matcher_matches_as_the_reference(pattern_words, key_words):
    pattern, key = j(*pattern_words), j(*key_words)
    expected = reference(pattern, key)
    assert matches(pattern, key) == expected, (pattern, key)
    # the normal form selects the same keys, and is its own normal form
    assert matches(normalized(pattern), key) == expected, (pattern, normalized(pattern), key)
    assert normalized(normalized(pattern)) == normalized(pattern)
    # one step per word of the key at most, on a state set no wider than the pattern
    states, walked = TopicMatcher(pattern).walk(key.encode())
    assert walked <= len(words(key)) and states < 2 ** (len(words(pattern)) + 1)


@pytest.mark.parametrize("pattern,key,expected", [
    # the tutorial's (www.rabbitmq.com/tutorials/tutorial-five-python)
    ("*.orange.*", "quick.orange.rabbit", True), ("*.*.rabbit", "quick.orange.rabbit", True),
    ("*.orange.*", "lazy.orange.elephant", True), ("lazy.#", "lazy.orange.elephant", True),
    ("*.orange.*", "quick.orange.fox", True), ("*.*.rabbit", "quick.orange.fox", False),
    ("lazy.#", "lazy.brown.fox", True), ("*.orange.*", "lazy.brown.fox", False),
    ("*.*.rabbit", "lazy.pink.rabbit", True), ("lazy.#", "lazy.pink.rabbit", True),
    ("*.orange.*", "quick.brown.fox", False), ("lazy.#", "quick.brown.fox", False),
    ("*.orange.*", "orange", False), ("*.orange.*", "quick.orange.new.rabbit", False),
    ("*.*.rabbit", "quick.orange.new.rabbit", False), ("lazy.#", "lazy.orange.new.rabbit", True),
    ("*.orange.*", "lazy.orange.new.rabbit", False), ("lazy.#", "lazy", True),
    # '#' and its repeats: any key, the empty one too
    ("#", "", True), ("#", "a", True), ("#", "a.b.c", True), ("#.#", "", True), ("#.#", "a.b", True),
    ("#.#.#", "a", True),
    ("a.#.b", "a.b", True), ("a.#.b", "a.x.b", True), ("a.#.b", "a.x.y.b", True), ("a.#.b", "a", False),
    ("a.#.b", "a.b.c", False), ("a.#.b", "ab", False), ("#.a", "a", True), ("#.a", "x.y.a", True),
    ("#.a", "a.x", False), ("a.#.a", "a", False), ("a.#.a", "a.a", True),
    ("*.#", "", False), ("*.#", "a", True), ("#.*", "a.b", True), ("#.*.#", "", False), ("#.*.#", "a", True),
    # the empty key has no words; the empty pattern matches it and nothing else
    ("", "", True), ("", "a", False), ("", ".", False), ("*", "", False), ("a", "", False),
    # empty words are words
    ("a..b", "a..b", True), ("a..b", "a.b", False), ("a.*.b", "a..b", True), ("*", ".", False),
    ("*.*", ".", True), (".", ".", True), ("#", ".", True), ("a.", "a.", True), ("a.", "a", False),
    (".a", ".a", True), ("#.", "a.b.", True), ("#.", "a.b", False), ("a.#", "a.", True),
    # a word of the key spelled like a wildcard is a literal
    ("#", "#", True), ("*", "*", True), ("a", "*", False), ("a.*", "a.#", True),
])
def test_rabbitmqs_examples(pattern, key, expected):
    assert reference(pattern, key) == expected, (pattern, key)
    assert matches(pattern, key) == expected, (pattern, key)


def test_matching_uses_no_regex():
    assert not hasattr(selection, "re")
    assert isinstance(topic_pattern("a.#"), TopicMatcher)


# -- the hostile shapes ------------------------------------------------------------------------
HOSTILE = [
    # what stalled every gateway: the regex tried every way of sharing 8 words among 24 '#'
    (j(*["#"] * 24, "z"), [j(*["a"] * 8), j(*["a"] * 7, "z"), j("z", *["a"] * 7), j(*["z"] * 8), KEY_128]),
    # 127 '#' alternating with literals (507 bytes, beyond the bound callers check), and as
    # many as fit in 255 bytes, against keys of 255 bytes
    (j(*["#", "a"] * 127), [KEY_128, j(*["a"] * 127, "b"), j("b", *["a"] * 127)]),
    (j(*["#", "a"] * 63, "#", "b"), [KEY_128, j(*["a"] * 127, "b"), j(*["b"] * 127, "a")]),
    (j(*["#", "a"] * 64), [KEY_128, j(*["a"] * 63), j(*["a"] * 64), j(*["a"] * 65), "." * 127]),
    (j(*["#", ""] * 64), ["." * 127, "." * 62, "." * 63, KEY_128]),
    (j(*["#"] * 127, "z"), [KEY_128, j(*["a"] * 127, "z")]),
    (j(*["*", "#"] * 64), [KEY_128, j(*["a"] * 63), j(*["a"] * 64)]),
    (j(*["*"] * 127, "z"), [KEY_128, j(*["a"] * 127, "z")]),
    (j(*["*"] * 128), [KEY_128, j(*["a"] * 127), "." * 127]),
    (KEY_128, [KEY_128, j(*["a"] * 127, "b")]),
    ("x" * 255, ["x" * 255, "x" * 254, "x" * 254 + "y"]),
    ("#.z", [KEY_128, j(*["a"] * 127, "z")]),
]


@pytest.mark.parametrize("pattern,keys", HOSTILE, ids=lambda v: v[:12] + f"..({len(v)})" if isinstance(v, str) else "")
def test_hostile_patterns_match_in_one_step_per_word(pattern, keys):
    matcher = TopicMatcher(pattern)
    width = len(words(normalized(pattern))) + 1
    for key in keys:
        assert len(key) <= MAX_PATTERN_BYTES
        assert matcher(key.encode()) == reference(pattern, key), (pattern, key)
        states, walked = matcher.walk(key.encode())
        assert walked <= len(words(key)) and states.bit_length() <= width, (pattern, key)


def test_a_word_that_cannot_match_or_a_last_hash_ends_the_walk_early():
    assert TopicMatcher("b.#").walk(KEY_128.encode()) == (0, 1)  # dead at the first word
    assert TopicMatcher("a.#").walk(KEY_128.encode())[1] == 1  # past 'a', anything goes
    assert TopicMatcher("#").walk(KEY_128.encode())[1] == 0
    assert TopicMatcher("#.z").walk(KEY_128.encode())[1] == 128  # 'z' may come last: every word


# -- the normal form and the bound -------------------------------------------------------------
@pytest.mark.parametrize("pattern,normal", [
    ("#.#.#", "#"), ("#.#", "#"), ("#", "#"), ("#.*.#", "*.#"), ("#.*", "*.#"), ("*.#", "*.#"),
    ("*.#.*.#.*", "*.*.*.#"), ("a.#.#.b", "a.#.b"), ("a.#.*.#.*.b", "a.*.*.#.b"), ("#.a.#", "#.a.#"),
    ("*.*", "*.*"), ("", ""), ("a..b", "a..b"), ("#..#", "#..#"), (".#.#.", ".#."), ("*.orange.*", "*.orange.*"),
])
def test_patterns_normalise_runs_of_wildcards(pattern, normal):
    assert normalized(pattern) == normal
    assert checked_pattern(pattern) == normal


@pytest.mark.parametrize("pattern,every", [
    ("#", True), ("#.#", True), ("#.#.#", True), ("", False), ("*", False), ("*.#", False), ("#.*", False),
    ("a.#", False), ("#.a", False), ("#..#", False),
])
def test_selects_every_key_only_for_hash(pattern, every):
    assert selects_every_key(pattern) == every


def test_patterns_longer_than_a_routing_key_are_refused():
    assert MAX_PATTERN_BYTES == 255
    assert checked_pattern("x" * 255) == "x" * 255
    assert checked_pattern(j(*["#"] * 128)) == "#"  # 255 bytes
    for pattern in ("x" * 256, "é" * 128, j(*["#"] * 128) + "a"):  # 256 bytes of UTF-8
        with pytest.raises(ValueError) as caught:
            checked_pattern(pattern)
        reason = str(caught.value)
        assert "255 bytes" in reason and "256" in reason and "\n" not in reason
    assert checked_pattern("é" * 127) == "é" * 127  # 254 bytes
