"""Prefix caching, measured two ways in one run, each against the same thing with the cache off.

``agent`` (default): the traffic agents and chats send. 8 conversations of 8 turns, 8 in flight
(one client per conversation, each turn sent when the previous answer arrived), over one shared
system prompt with a tool list of about 1,500 tokens; each turn appends a user message of 100-300
tokens to the whole history (earlier answers included) and asks for 32 greedy tokens. Sent to
`prism serve` (SmolLM2-135M-Instruct fp32, one device with every core) twice, with
``prefix_caching`` on and off. Prints TTFT p50/p95 (all turns, and turns after the first), the
run's wall time, the cached share of prompt tokens, `busy` (cores other processes than this
client kept busy meanwhile: the server's, and anything else), and whether every answer is identical.

``return``: a model evicted between rounds and activated again by the next request, with its
cached prefixes kept in host memory at the eviction (``policy.kept_prefix_bytes`` default) and
without (0). Conversations over the shared system prompt send one turn each per round, one at a
time; before every round but the first the model is unloaded (admin route). Prints the TTFT of each
round's first request (the one that waits for the activation) and the activation's seconds (from
``/v1/models``' ``last_activation``), p50 of both runs and their ratios, and whether every answer is
identical.

``decode``: the engine alone on the elastic pool, nothing shared (distinct random prompts): decode
tokens per second with the cache on and off, alternated over several rounds, so that the cost of
hashing and registering blocks shows.

    python benchmarks/prefix_cache.py                 # agent and decode
    python benchmarks/prefix_cache.py --parts return --conversations 4 --turns 6
    python benchmarks/prefix_cache.py --parts agent --vllm     # and vLLM's server on the same turns
    python benchmarks/prefix_cache.py --parts agent --conversations 8 --turns 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

import common
from prism_serve.api.process import free_port, start_server_process, stop_server_process

MODEL = "smollm2-135m-instruct"
WORDS = [
    "order", "ship", "port", "route", "cargo", "invoice", "customs", "delay", "weather", "vessel", "berth",
    "crane", "container", "pallet", "manifest", "freight", "carrier", "schedule", "tracking", "warehouse",
    "truck", "rail", "import", "export", "tariff", "broker", "insurance", "claim", "damage", "inspection",
    "seal", "temperature", "reefer", "hazardous", "label", "dock", "gate", "yard",
]  # fmt: skip


def system_prompt(rng: random.Random, tokens_hint: int = 1500) -> str:
    """A system prompt with a tool list, about ``tokens_hint`` tokens of SmolLM2's tokenizer."""
    tools = []
    for i in range(24):
        props = {
            w: {"type": "string", "description": " ".join(rng.choices(WORDS, k=6))}
            for w in rng.sample(WORDS, 3)
        }
        tools.append({
            "type": "function",
            "function": {"name": f"tool_{i}_{rng.choice(WORDS)}",
                         "description": " ".join(rng.choices(WORDS, k=12)),
                         "parameters": {"type": "object", "properties": props}},
        })  # fmt: skip
    text = "You are the operations assistant of a shipping company. Use the tools when needed.\n"
    text += "Tools:\n" + json.dumps(tools)
    # SmolLM2's BPE: about 4 characters per token of this JSON; trim to the hint
    return text[: tokens_hint * 4]


def conversations(n: int, turns: int, seed: int) -> tuple[str, list[list[str]]]:
    rng = random.Random(seed)
    system = system_prompt(rng)
    users = [
        [" ".join(rng.choices(WORDS, k=rng.randint(100, 300))) + "?" for _ in range(turns)] for _ in range(n)
    ]
    return system, users


async def converse(
    client: httpx.AsyncClient,
    url: str,
    system: str | list[dict],
    users: list[str],
    max_tokens: int,
    keep_history: bool = False,
    history: list[str] | None = None,
) -> list[dict]:
    """One conversation, turn after turn; each turn's TTFT, usage and answer. ``system`` may be the
    history so far (a list of messages, extended in place with ``keep_history``). ``history``: the
    assistant messages the history carries instead of the server's answers (so that two servers
    get the same requests)."""
    if isinstance(system, str):
        messages = [{"role": "system", "content": system}]
    else:
        messages = system if keep_history else list(system)
    out = []
    for text in users:
        messages.append({"role": "user", "content": text})
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        start = time.perf_counter()
        ttft = None
        answer, usage = [], None
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for c in chunk.get("choices", []):
                    if c["delta"].get("content"):
                        ttft = ttft if ttft is not None else time.perf_counter() - start
                        answer.append(c["delta"]["content"])
        content = "".join(answer)
        messages.append({"role": "assistant", "content": content if history is None else history[len(out)]})
        out.append({"ttft": ttft if ttft is not None else time.perf_counter() - start, "usage": usage,
                    "answer": content})  # fmt: skip
    return out


def fixed_answers(n: int, turns: int, seed: int) -> list[list[str]]:
    """Canned assistant messages, about 32 tokens each, for histories that do not depend on a
    server's answers."""
    rng = random.Random(seed + 1)
    return [[" ".join(rng.choices(WORDS, k=24)) + "." for _ in range(turns)] for _ in range(n)]


def drive_agent(url: str, args: argparse.Namespace, fixed: bool = False) -> dict:
    """The agent workload against the server at ``url`` (warmed up first): its figures. ``fixed``:
    the histories carry canned answers, the same whatever the server answers."""
    system, users = conversations(args.conversations, args.turns, args.seed)
    canned = fixed_answers(args.conversations, args.turns, args.seed) if fixed else [None] * len(users)
    httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=300)
    common.wait_quiet(30, 0.3)

    async def main():
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(
                *(
                    converse(client, url, system, u, args.max_tokens, history=h)
                    for u, h in zip(users, canned, strict=True)
                )
            )

    start, t0 = common.cpu_seconds(), time.perf_counter()
    convs = asyncio.run(main())
    wall = time.perf_counter() - t0
    load = common.other_load_since(start, wall)
    turns = [t for conv in convs for t in conv]
    later = [t for conv in convs for t in conv[1:]]
    prompt = sum(t["usage"]["prompt_tokens"] for t in turns)
    cached = sum(((t["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0) for t in turns)
    return {
        "wall_s": wall, "other_load": load,
        "ttft_p50": statistics.median(t["ttft"] for t in turns),
        "ttft_p95": statistics.quantiles([t["ttft"] for t in turns], n=20)[-1],
        "later_ttft_p50": statistics.median(t["ttft"] for t in later),
        "prompt_tokens": prompt, "cached_share": cached / prompt,
        "mean_prompt": prompt / len(turns),
        "output_tokens": sum(t["usage"]["completion_tokens"] for t in turns),
        "answers": [[t["answer"] for t in conv] for conv in convs],
    }  # fmt: skip


def run_agent(cache: bool, args: argparse.Namespace, tmp: Path, fixed: bool = False) -> dict:
    port = free_port()
    cfg = tmp / f"prism-{cache}.yaml"
    cfg.write_text(
        "devices: [{name: 'cpu:0', memory: 6GiB, workers: 1}]\n"
        f"models: [{{name: {MODEL}, source: {MODEL}, dtype: float32, max_model_len: 8192, max_num_seqs: 16, "
        f"ttft_slo: 600, tpot_slo: 60, prefix_caching: {str(cache).lower()}}}]\n"
    )
    proc = start_server_process(cfg, port, tmp / f"prism-{cache}.log")
    try:
        return drive_agent(f"http://127.0.0.1:{port}", args, fixed)
    finally:
        stop_server_process(proc)


def run_agent_vllm(args: argparse.Namespace, tmp: Path) -> dict:
    """The agent workload against vLLM's OpenAI server (its prefix cache on, its default), fp32,
    bound to ``args.vllm_bind`` cores (default every core), with canned histories (fixed_answers)."""
    from serve_throughput import export_tokenizer, vllm_server

    python = args.vllm_python or str(common.vllm_server_python())
    with vllm_server(python, export_tokenizer(tmp / "tokenizer"), tmp, args, max_model_len=8192) as (url, _):
        return drive_agent(url, args, fixed=True)


ADMIN_KEY = "bench-admin"


def run_return(keep: bool, args: argparse.Namespace, tmp: Path) -> dict:
    """Rounds of one turn per conversation, sequential, the model unloaded before each round but
    the first: each round's first TTFT and the activation it waited for."""
    port = free_port()
    cfg = tmp / f"prism-return-{keep}.yaml"
    cfg.write_text(
        f"server: {{admin_key: {ADMIN_KEY}}}\n"
        "devices: [{name: 'cpu:0', memory: 6GiB, workers: 1}]\n"
        f"policy: {{kept_prefix_bytes: {'1GiB' if keep else 0}}}\n"
        f"models: [{{name: {MODEL}, source: {MODEL}, dtype: float32, max_model_len: 8192, max_num_seqs: 16, "
        "ttft_slo: 600, tpot_slo: 60}]\n"
    )
    proc = start_server_process(cfg, port, tmp / f"prism-return-{keep}.log")
    url = f"http://127.0.0.1:{port}"
    system, users = conversations(args.conversations, args.turns, args.seed)
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    first_ttft, activation, restored, answers = [], [], [], []
    try:
        with httpx.Client(timeout=600) as http:
            http.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})

            async def round_of(histories: list[list[dict]], turn: int) -> list[dict]:
                out = []
                async with httpx.AsyncClient() as client:
                    for h, u in zip(histories, users, strict=True):
                        (r,) = await converse(client, url, h, [u[turn]], args.max_tokens, keep_history=True)
                        out.append(r)
                return out

            histories = [[{"role": "system", "content": system}] for _ in users]
            for turn in range(args.turns):
                if turn:
                    r = http.post(
                        f"{url}/v1/admin/models/{MODEL}/unload", headers=admin, json={"force": False}
                    )
                    r.raise_for_status()
                common.wait_quiet(10, 0.3)
                results = asyncio.run(round_of(histories, turn))
                answers.append([r["answer"] for r in results])
                if turn:
                    card = next(m for m in http.get(f"{url}/v1/models").json()["data"] if m["id"] == MODEL)
                    first_ttft.append(results[0]["ttft"])
                    activation.append(card["last_activation"]["seconds"])
                    restored.append(card["last_activation"]["restored_prefix_blocks"])
    finally:
        stop_server_process(proc)
    return {
        "first_ttft": first_ttft, "activation": activation, "restored": restored, "answers": answers,
    }  # fmt: skip


def run_decode(args: argparse.Namespace) -> dict:
    """Decode tokens/s of the engine on the elastic pool, cache on vs off, nothing shared."""
    from prism_serve.engine.config import EngineConfig
    from prism_serve.engine.llm_engine import LLMEngine
    from prism_serve.engine.sampling_params import SamplingParams
    from prism_serve.engine.weights import load_weights
    from prism_serve.memory.kv_pool import PoolConfig
    from prism_serve.memory.ledger import ledger_dir

    weights = load_weights(MODEL)
    namespace = f"bench{time.time_ns()}"  # this run's own device ledger, removed at the end
    engines = {
        cache: LLMEngine(
            EngineConfig(
                dtype="float32",
                max_num_seqs=32,
                prefix_caching=cache,
                elastic_kv=PoolConfig(device_budget_bytes=4 * 2**30, ledger_namespace=namespace),
            ),
            weights=weights,
        )
        for cache in (False, True)
    }
    rng = random.Random(args.seed)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    rates: dict[bool, list[float]] = {False: [], True: []}
    for rnd in range(args.rounds):
        for cache in (False, True) if rnd % 2 == 0 else (True, False):
            engine = engines[cache]
            for _ in range(32):  # distinct prompts: nothing to share
                engine.add_request([rng.randrange(1000, 40000) for _ in range(64)], params)
            while engine.num_waiting or any(
                s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
            ):
                engine.step()  # prefill first: only decode steps are timed
            common.wait_quiet(10, 0.3)
            tokens, t0 = 0, time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
                tokens += engine.last_step_tokens
            rates[cache].append(tokens / (time.perf_counter() - t0))
    for e in engines.values():
        e.close()
    for path in ledger_dir().glob(f"prism-ledger-{namespace}-*"):
        path.unlink()
    return {cache: statistics.median(r) for cache, r in rates.items()} | {"rounds": args.rounds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="agent,decode")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm", action="store_true", help="agent: also against vLLM's OpenAI server (CPU build)")
    p.add_argument("--vllm-python", help="a Python with vLLM (default: .venv-vllm-server)")
    p.add_argument("--vllm-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND (default: both cores)")
    p.add_argument("--vllm-model", help=argparse.SUPPRESS)
    p.add_argument("--skip-off", action="store_true", help="agent: leave out the run with the cache off")
    args = p.parse_args()
    parts = args.parts.split(",")
    print("machine:", common.machine_info()["line"])
    if "agent" in parts:
        with tempfile.TemporaryDirectory() as d:
            off = run_agent(False, args, Path(d)) if not args.skip_off else None
            on = run_agent(True, args, Path(d))
            # against vLLM: canned histories, so both servers get the same requests
            on_fixed = run_agent(True, args, Path(d), fixed=True) if args.vllm else None
            vllm = run_agent_vllm(args, Path(d)) if args.vllm else None
        n = args.conversations
        print(f"\nagent workload: {n} conversations x {args.turns} turns, c{n}, "
              f"mean prompt {on['mean_prompt']:.0f} tokens, "
              f"{args.max_tokens} greedy output tokens")  # fmt: skip
        print(
            f"{'':14}{'wall s':>9}{'TTFT p50':>10}{'TTFT p95':>10}{'later p50':>11}{'cached':>8}{'busy':>6}"
        )
        rows = [("cache off", off), ("cache on", on), ("on, canned", on_fixed), ("vLLM, canned", vllm)]
        for name, r in [(n, r) for n, r in rows if r is not None]:
            print(f"{name:14}{r['wall_s']:9.1f}{r['ttft_p50']:10.3f}{r['ttft_p95']:10.3f}"
                  f"{r['later_ttft_p50']:11.3f}{r['cached_share']:8.1%}{r['other_load']:6.2f}")  # fmt: skip
        if off is not None:
            same = on["answers"] == off["answers"]
            print(f"on/off: TTFT p50 {on['ttft_p50'] / off['ttft_p50']:.3f}x, later turns' TTFT p50 "
                  f"{on['later_ttft_p50'] / off['later_ttft_p50']:.3f}x, "
                  f"wall {on['wall_s'] / off['wall_s']:.3f}x; "
                  f"greedy answers identical: {same}")  # fmt: skip
        if vllm:
            same = sum(a == b for c, d in zip(on_fixed["answers"], vllm["answers"], strict=True)
                       for a, b in zip(c, d, strict=True))  # fmt: skip
            rate = (on_fixed["output_tokens"] / on_fixed["wall_s"]) / (vllm["output_tokens"] / vllm["wall_s"])
            print(f"prism/vLLM, same requests (canned histories): TTFT p50 "
                  f"{on_fixed['ttft_p50'] / vllm['ttft_p50']:.3f}x, output tok/s {rate:.3f}x, "
                  f"wall {on_fixed['wall_s'] / vllm['wall_s']:.3f}x; greedy answers equal: {same} of "
                  f"{args.conversations * args.turns}")  # fmt: skip
    if "return" in parts:
        with tempfile.TemporaryDirectory() as d:
            none = run_return(False, args, Path(d))
            kept = run_return(True, args, Path(d))
        print(f"\nevicted and back: {args.conversations} conversations, one turn each per round, "
              f"{args.turns} rounds, the model unloaded before each round but the first")  # fmt: skip
        med = {name: {k: statistics.median(r[k]) for k in ("first_ttft", "activation", "restored")}
               for name, r in (("not kept", none), ("kept", kept))}  # fmt: skip
        print(f"{'':22}{'first TTFT p50':>15}{'activation p50':>15}{'restored blocks':>16}")
        for name, m in med.items():
            print(
                f"{'prefixes ' + name:22}{m['first_ttft']:15.3f}{m['activation']:15.3f}{m['restored']:16.0f}"
            )
        k, n = med["kept"], med["not kept"]
        print(f"kept/not kept: first TTFT p50 {k['first_ttft'] / n['first_ttft']:.3f}x, "
              f"activation p50 {k['activation'] / n['activation']:.3f}x; "
              f"greedy answers identical: {kept['answers'] == none['answers']}")  # fmt: skip
    if "decode" in parts:
        r = run_decode(args)
        print(
            "\ndecode, elastic pool, 32 distinct 64-token prompts x 128 tokens, "
            f"median of {r['rounds']} rounds:"
        )
        print(
            f"cache off {r[False]:.1f} tok/s, cache on {r[True]:.1f} tok/s: on/off {r[True] / r[False]:.3f}x"
        )


if __name__ == "__main__":
    main()
