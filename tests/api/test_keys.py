"""API and admin keys are compared in constant time (api/errors.py key_matches), with the same
answers as plain comparison."""

from __future__ import annotations

import inspect

from prism_serve.api import admin, serving
from prism_serve.api.errors import key_matches


def test_key_matches_answers_as_membership():
    keys = ["sk-one", "sk-two", None]
    assert key_matches("sk-two", keys) and key_matches("sk-one", keys)
    assert not key_matches("sk-on", keys) and not key_matches("sk-one ", keys) and not key_matches("", keys)
    assert not key_matches("sk-one", []) and not key_matches("None", [None])
    assert key_matches("ключ", ["ключ"])  # any text a header may carry


def test_the_routes_compare_keys_only_through_it():
    for module in (serving, admin):
        source = inspect.getsource(module)
        assert "key_matches(token" in source
        assert "token not in" not in source and "token != " not in source and "token in " not in source
