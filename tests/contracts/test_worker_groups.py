"""Tests sharing a module-scoped fixture run in one xdist worker (tests/conftest.py groups them, the Makefile runs
``--dist loadgroup``): the fixture is built once, not once per worker. A test without such a fixture is not
grouped, so the two workers stay balanced test by test."""

import pytest


@pytest.fixture(scope="module")
def built_once():
    return object()


def test_a_test_using_a_module_fixture_is_grouped_by_its_module(built_once, request):
    mark = request.node.get_closest_marker("xdist_group")
    assert mark is not None and mark.args == (__name__,)


def test_a_test_without_one_is_not(request):
    assert request.node.get_closest_marker("xdist_group") is None


def test_make_test_schedules_by_group():
    from pathlib import Path

    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    recipe = makefile.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "-n auto" in recipe and "--dist loadgroup" in recipe
