"""Every error prism-serve raises on purpose names the OpenAI error type of its HTTP status: a
client's mistake (4xx) is never reported as an internal error, and a 5xx never blames the client."""

from __future__ import annotations

import importlib
import pkgutil

import prism_serve
from prism_serve.errors import PrismError

# the error types OpenAI's API and vLLM's answer with, by status
TYPES = {
    400: {"invalid_request_error"},
    401: {"authentication_error"},
    403: {"permission_denied"},
    404: {"model_not_found", "not_found_error"},
    409: {"conflict"},
    429: {"rate_limit_exceeded"},
    500: {"internal_error"},
    503: {"service_unavailable"},
    504: {"timeout"},
}


def _subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub, *_subclasses(sub)}
    return out


def test_each_errors_type_matches_its_status():
    for module in pkgutil.walk_packages(prism_serve.__path__, "prism_serve."):
        importlib.import_module(module.name)  # every module: every PrismError subclass defined
    errors = _subclasses(PrismError)
    assert len(errors) > 30  # the walk found them
    wrong = {
        f"{e.__module__}.{e.__name__}": (e.status_code, e.error_type)
        for e in errors
        if e.error_type not in TYPES.get(e.status_code, ())
    }
    assert wrong == {}
