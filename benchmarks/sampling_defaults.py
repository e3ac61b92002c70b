"""Which sampling defaults make the default model answer right as a user asks it (no settings in the
request): a real ``prism serve`` of SmolLM2-135M-Instruct (the default config's weights and dtype),
short factual questions sent through chat completions ``--samples`` times under each setting (one
request with ``n`` choices, seeded), each answer checked for the expected word; and one open prompt
("Tell me about Paris.") whose answers are checked for loops (the share of repeated 4-grams).

    python benchmarks/sampling_defaults.py                    # the recorded run (~3 min)
    python benchmarks/sampling_defaults.py --samples 10 --settings "0.2/0.9/0,1.0/1.0/0"

A setting is temperature/top_p/top_k (top_k 0: off). Prints one row per setting: the share of right
answers per question and over all, and the open prompt's repeated-4-gram share.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path

import httpx

import common
from prism_serve.api.process import free_port, start_server_process, stop_server_process

QUESTIONS = [
    ("What is the capital of France?", r"\bparis\b"),
    ("What is the capital of Japan?", r"\btokyo\b"),
    ("Which planet is known as the Red Planet?", r"\bmars\b"),
    ("Who wrote Romeo and Juliet?", r"\bshakespeare\b"),
    ("What is 2 + 2?", r"\b4\b|\bfour\b"),
    ("What gas do plants absorb from the air for photosynthesis?", r"carbon dioxide|\bco2\b"),
]
OPEN = "Tell me about Paris."
SETTINGS = "1.0/1.0/0,0.7/0.9/0,0.2/0.9/0,0.3/0.9/20,0.2/0.9/5,0.1/1.0/0,0.0/1.0/0"


def repeated_4grams(text: str) -> float:
    words = text.lower().split()
    grams = [tuple(words[i : i + 4]) for i in range(len(words) - 3)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def ask(port: int, prompt: str, setting: tuple[float, float, int], n: int, max_tokens: int) -> list[str]:
    t, p, k = setting
    body = {
        "model": "smol", "messages": [{"role": "user", "content": prompt}], "n": n, "seed": 1,
        "temperature": t, "top_p": p, "top_k": k, "max_tokens": max_tokens,
    }  # fmt: skip
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    return [c["message"]["content"] for c in r.json()["choices"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=16, help="answers per question and setting (n)")
    ap.add_argument("--settings", default=SETTINGS, help="comma-separated temperature/top_p/top_k")
    ap.add_argument("--out", type=Path, help="write every answer here (JSON)")
    args = ap.parse_args()
    settings = [tuple(float(x) for x in s.split("/")) for s in args.settings.split(",")]
    settings = [(t, p, int(k)) for t, p, k in settings]
    print(common.machine_info()["line"], flush=True)
    port = free_port()
    folder = Path(tempfile.mkdtemp(prefix="sampling-"))
    config = folder / "prism.yaml"
    config.write_text(
        'devices: [{name: "cpu:0", memory: 2GiB}]\n'
        "models: [{name: smol, pinned: true, max_num_seqs: 64}]\n"
        f"server: {{port: {port}, namespace: sampling-{port}}}\n"
    )
    proc = start_server_process(config, port, folder / "server.log")
    answers: dict = {}
    try:
        card = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"][0]
        print(f"model: {card['root']} ({card['dtype']}); {args.samples} answers per question and setting")
        print("| temperature / top_p / top_k | " + " | ".join(q.split("?")[0][-18:] for q, _ in QUESTIONS)
              + " | all right | open prompt: repeated 4-grams |")  # fmt: skip
        print("|---" * (len(QUESTIONS) + 3) + "|")
        for s in settings:
            t0 = time.perf_counter()
            rates, texts = [], {}
            for q, pattern in QUESTIONS:
                got = ask(port, q, s, args.samples, 32)
                texts[q] = got
                rates.append(sum(bool(re.search(pattern, a.lower())) for a in got) / len(got))
            opened = ask(port, OPEN, s, max(4, args.samples // 4), 96)
            texts[OPEN] = opened
            loops = sum(repeated_4grams(a) for a in opened) / len(opened)
            answers["/".join(map(str, s))] = texts
            cells = " | ".join(f"{r:.0%}" for r in rates)
            right = sum(rates) / len(rates)
            print(f"| {s[0]:g} / {s[1]:g} / {s[2]} | {cells} | **{right:.0%}** | {loops:.0%} |"
                  f"  ({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    finally:
        stop_server_process(proc)
    if args.out:
        args.out.write_text(json.dumps(answers, indent=1))


if __name__ == "__main__":
    main()
