"""Schemathesis against the real server: requests generated from /openapi.json, valid ones
(positive) and ones that break the schema (negative), for every route. The server must answer
none with a 5xx, every answer must match the schema (status, content type, body), schema-breaking
requests must be refused, and afterwards nothing may be left running or waiting.

The example count per route and mode is bounded for CI; ``PRISM_FUZZ_EXAMPLES`` raises it (the
2,000-request run in docs/results.md, "Soak, fuzzing and hostile input"). Generated bodies keep
``max_tokens`` small and, half the time, name a served model, so requests reach the engine
instead of stopping at 404."""

from __future__ import annotations

import os
import random
from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from prism_serve.api.protocol import INT64_MAX
from tests.api.conftest import ADMIN_KEY
from tests.api.test_hostile import assert_idle, serves

EXAMPLES = int(os.environ.get("PRISM_FUZZ_EXAMPLES", "25"))
MODELS = ("tiny", "smol", "smol-b")
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def tame(case, rng: random.Random) -> None:
    """Keep generated work small on a CPU: clamp valid token budgets, and point a valid model field at
    a served model half the time (path parameters too). Values that break the schema stay as they
    are, so negative cases remain negative."""
    body = case.body
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            v = body.get(key)
            # only valid budgets: one past the schema's maximum must stay, or a negative case
            # turns into a valid request that schemathesis still counts as one to be refused
            if type(v) is int and 4 < v <= INT64_MAX:
                body[key] = rng.randint(1, 4)
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = rng.randint(1, 4)  # else a request runs to the end of the context
        if isinstance(body.get("model"), str) and body["model"] and rng.random() < 0.5:
            body["model"] = rng.choice(MODELS)
    query = case.query if isinstance(case.query, dict) else {}
    for key, value in query.items():
        # no query parameter here is an array: a list of one value (or none) goes on the wire as a
        # valid request (or as nothing), so a negative case must send it at least twice to stay one
        if isinstance(value, list) and len(value) < 2:
            query[key] = (value or [""]) * 2
    params = case.path_parameters or {}
    for key in ("model", "name"):
        if isinstance(params.get(key), str) and rng.random() < 0.5:
            params[key] = rng.choice(MODELS)


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_generated_requests_get_well_formed_answers(server, api_schema, mode):
    rng = random.Random(0)
    statuses: Counter = Counter()
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}  # the admin key serves every route
    checks = CHECKS + ([negative_data_rejection] if mode == "negative" else [])
    generation = schemathesis.GenerationMode(mode)
    for result in api_schema.get_all_operations():
        op = result.ok()

        @given(case=op.as_strategy(generation_mode=generation))
        @settings(max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        def run(case) -> None:
            tame(case, rng)
            response = case.call(base_url=server.url, headers=headers, timeout=120)
            statuses[response.status_code] += 1
            case.validate_response(response, checks=checks)

        try:
            run()
        except Unsatisfiable:
            assert mode == "negative"  # a route without parameters or body has no invalid request
    print(f"{mode}: {sum(statuses.values())} requests, statuses {dict(sorted(statuses.items()))}")
    assert sum(statuses.values()) >= EXAMPLES  # the generator really ran
    assert not any(code >= 500 for code in statuses)
    if mode == "positive":
        assert statuses[200] > 0  # some generated requests were served, not only refused
    for model in MODELS:  # the admin routes were fuzzed too: nothing may stay pinned or half-loaded
        httpx_unpin(server, model)
    assert_idle(server)
    serves(server)


def httpx_unpin(server, model: str) -> None:
    import httpx

    r = httpx.post(f"{server.base_url}/admin/models/{model}/unpin",
                   headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True,
                                  "top_logprobs": 2}),
        ("/v1/completions", {"prompt": "The capital of France is", "logprobs": 2, "echo": True}),
    ],
    ids=["chat", "completion"],
)  # fmt: skip
def test_logprobs_answers_match_the_schema(server, api_schema, path, body):
    """The schema documents the logprobs the routes send (it once said they were always null; the
    fuzzer found it only when it happened to ask for logprobs)."""
    case = api_schema[path]["POST"].Case(body={"model": "smol", "max_tokens": 3, **body})
    response = case.call(base_url=server.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["logprobs"]  # really there, not null
    case.validate_response(response, checks=[status_code_conformance, response_schema_conformance])
