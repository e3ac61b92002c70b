"""Forced tool calls validate against their schemas: ``--calls`` random tool schemas (nested objects,
enums, arrays, optional fields, numbers with bounds, strings with lengths and patterns, booleans),
drawn by a hypothesis strategy with a fixed seed, each sent to a real ``prism serve`` of the default
model as the one tool of a chat completion with tool_choice naming it (half of them) or
``required`` (the other half, with a second tool beside it); every call's arguments are checked
with jsonschema against its tool's parameters.

    python benchmarks/tool_schemas.py                  # 500 calls (~5 min on 2 cores)
    python benchmarks/tool_schemas.py --calls 50

Prints the share of calls that validate (target 100%), how many answers were cut by max_tokens,
and one failing schema and answer if any.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import string
import tempfile
from pathlib import Path

import httpx
from jsonschema import Draft202012Validator

import common
from prism_serve.api.process import free_port, start_server_process, stop_server_process

KEYS = ["name", "city", "count", "tags", "unit", "when", "price", "items", "kind", "note", "enabled", "level",
        "owner", "size", "color", "score"]  # fmt: skip


def leaf(rng: random.Random) -> dict:
    kind = rng.choice(["string", "integer", "number", "boolean", "enum", "pattern"])
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(3, 24)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 100, 1e6])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "celsius", "fahrenheit", "low", "high", "auto"],
                                   rng.randint(2, 4))}  # fmt: skip
    return {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}


def schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema: 1-4 properties, some required, some nested (objects, arrays)."""
    props = {}
    for key in rng.sample(KEYS, rng.randint(1, 4)):
        roll = rng.random()
        if roll < 0.2 and depth < 2:
            props[key] = schema(rng, depth + 1)
        elif roll < 0.4 and depth < 2:
            item = schema(rng, depth + 1) if rng.random() < 0.3 else leaf(rng)
            props[key] = {"type": "array", "items": item, "minItems": rng.randint(0, 1),
                          "maxItems": rng.randint(1, 3)}  # fmt: skip
        else:
            props[key] = leaf(rng)
    required = sorted(rng.sample(list(props), rng.randint(0, len(props))))
    out = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        out["required"] = required
    return out


def name_of(rng: random.Random) -> str:
    return "fn_" + "".join(rng.choice(string.ascii_lowercase) for _ in range(6))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    print(common.machine_info()["line"], flush=True)
    rng = random.Random(args.seed)
    cases = []
    for i in range(args.calls):
        params = schema(rng)
        fn = {"name": name_of(rng), "description": "A tool.", "parameters": params}
        tool = {"type": "function", "function": fn}
        if i % 2 == 0:
            tools, choice = [tool], {"type": "function", "function": {"name": tool["function"]["name"]}}
        else:
            other = {"type": "function", "function": {"name": name_of(rng), "parameters": schema(rng)}}
            tools, choice = [tool, other], "required"
        cases.append((tools, choice))
    port = free_port()
    folder = Path(tempfile.mkdtemp(prefix="tool-schemas-"))
    config = folder / "prism.yaml"
    config.write_text('devices: {count: 2, memory: 2GiB}\nmodels: [{name: smol, max_num_seqs: 64}]\n'
                      f"server: {{port: {port}, namespace: toolschemas-{port}}}\n")  # fmt: skip
    proc = start_server_process(config, port, folder / "server.log")

    def call(case):
        tools, choice = case
        ask = [{"role": "user", "content": "Call the tool with sensible values."}]
        body = {"model": "smol", "messages": ask,
                "tools": tools, "tool_choice": choice, "parallel_tool_calls": False,
                "max_tokens": args.max_tokens, "temperature": 1.0, "seed": 7}  # fmt: skip
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        return r.json()["choices"][0]

    try:
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            answers = list(pool.map(call, cases))
    finally:
        stop_server_process(proc)
    valid = cut = 0
    failure = None
    for (tools, _), a in zip(cases, answers, strict=True):
        calls = a["message"].get("tool_calls") or []
        if a["finish_reason"] == "length":
            cut += 1
        by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        ok = len(calls) == 1 and calls[0]["function"]["name"] in by_name
        if ok:
            args_ = json.loads(calls[0]["function"]["arguments"])
            ok = not list(Draft202012Validator(by_name[calls[0]["function"]["name"]]).iter_errors(args_))
        valid += ok
        if not ok and failure is None:
            failure = (tools, a)
    print(f"{valid} of {len(cases)} forced calls validate against their schemas ({valid / len(cases):.1%}); "
          f"{cut} cut by max_tokens ({args.max_tokens})")  # fmt: skip
    for a in answers:
        if a["finish_reason"] == "length":
            text = a["message"].get("content") or json.dumps(a["message"].get("tool_calls"))
            print(f"cut: {text[:240]!r} ... {text[-120:]!r}")
    if failure:
        print("first failure:", json.dumps(failure)[:2000])


if __name__ == "__main__":
    main()
