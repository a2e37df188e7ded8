"""The selection value: built by name at a facade, checked before anything is opened."""

from __future__ import annotations

import dataclasses

import pytest

import tracedb
from tracedb.selection import Selection


def test_tracedb_exports_the_selection_the_library_takes() -> None:
    assert tracedb.Selection is Selection
    assert "Selection" in tracedb.__all__


def _facade(
    trace_ids=None,
    group=None,
    episode=None,
    after=None,
    complete_groups=None,
    tags=None,
    through=None,
    policy=None,
    max_staleness=None,
    stale=None,
    unknown=None,
    include_dropped=None,
    include_eval=None,
    max_groups=None,
    columns=None,
) -> Selection:
    return Selection.of(locals())


def test_of_takes_each_field_by_name_and_nothing_else() -> None:
    values = {name: f"value-{i}" for i, name in enumerate(Selection.FIELDS)}
    built = _facade(**values, columns=["tokens"])
    assert dataclasses.asdict(built) == values
    assert Selection.of({name: None for name in Selection.FIELDS}).everything
    with pytest.raises(KeyError):
        Selection.of({"trace_ids": None})  # a facade that lacks a field is a programming error


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"after": -1}, "after is a watermark"),
        ({"through": "5"}, "through is a watermark"),
        ({"complete_groups": 0}, "complete_groups is a group size"),
        ({"tags": {"step": (1, "x")}}, "tag 'step'"),
        ({"max_staleness": 1}, "max_staleness needs policy"),
        ({"policy": 3, "max_staleness": -1}, "max_staleness is a number of policy versions"),
        ({"policy": 3, "max_staleness": 1, "stale": "keep"}, "stale is one of"),
        ({"unknown": "keep"}, "give policy and max_staleness too"),
        ({"include_dropped": "yes"}, "include_dropped is True or False"),
        ({"max_groups": 0}, "max_groups is a number of groups"),
    ],
)
def test_check_names_the_field_that_holds_a_bad_value(fields: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        Selection(**fields).check()


def test_check_returns_a_good_selection_unchanged() -> None:
    good = Selection(after=3, complete_groups=4, tags={"step": (1, None)}, policy=5, max_staleness=1, stale="mask")
    assert good.check() is good
