"""Short matches of a schema's patterns (engine/structured/pattern_samples.py): the finish search's ways out of
strings."""

from __future__ import annotations

import re

import pytest

from engine.structured.pattern_samples import MAX_LENGTH, pattern_sample, required_keys, schema_samples


@pytest.mark.parametrize(
    "pattern",
    [
        r"\.png$",
        "http://schema.org",
        r"^(.+\/)+(.+)\.(ya?ml)(@.+)?$",
        r"^[\S]+@[\S]+\.[\S]{2,}$",
        r"^[0-9]{4}-(0[1-9]|1[012])-(0[1-9]|[12][0-9]|3[01])$",
        r'^[^"]+$',
        r"^[A-Z]{2}[0-9]{3}$",
        r"^.*\$\{\{(.|[\r\n])*\}\}.*$",
        r"^([\r\n]|a)b$",
        r"\\d+",
        r"^(?:x|yy)+z{3}$",
        r"[^a-z]",
        r"\w+\W\d\D\s",
    ],
)
def test_the_sample_matches_its_pattern(pattern: str) -> None:
    sample = pattern_sample(pattern)
    assert sample is not None and re.search(pattern, sample), (pattern, sample)
    assert '"' not in sample and len(sample) <= MAX_LENGTH


@pytest.mark.parametrize("pattern", [r"(?=a)b", r"(a)\1", r"^[\r\n]+$", "(", r"^a{100}$"])
def test_no_sample_where_none_is_short_and_plain(pattern: str) -> None:
    assert pattern_sample(pattern) is None  # look-ahead, back-reference, only control characters, invalid, long


def test_schema_samples_are_json_escaped_and_unique() -> None:
    schema = {
        "properties": {"a": {"pattern": r"^\\d$"}, "b": {"pattern": r"^\\d$"}, "c": {"pattern": "^x$"}},
        "patternProperties": {"^k": {"type": "string", "pattern": "^[a-c]{2}$"}},
    }
    assert sorted(schema_samples(schema)) == sorted(["\\\\d", "x", "aa"])


def test_required_keys_are_json_escaped_and_unique() -> None:
    schema = {
        "required": ["a", 'q"'],
        "properties": {"a": {"required": ["b", "a"]}, "c": {"required": "x"}},
        "items": [{"required": ["d"]}],
    }
    assert sorted(required_keys(schema)) == sorted(["a", 'q\\"', "b", "d"])
