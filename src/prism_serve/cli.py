"""The ``prism`` command. Subcommands arrive with their issues; today: ``generate``."""

from __future__ import annotations

import argparse
import sys
import time

from prism_serve.errors import PrismError


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="smollm2-135m-instruct (default, real weights), random:<preset> (synthetic), "
        "a .gguf file, or an HF-layout directory",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-model-len", type=int, default=None)


def _cmd_generate(args: argparse.Namespace) -> int:
    from prism_serve.engine.llm_engine import EngineConfig, LLMEngine
    from prism_serve.engine.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop or [],
    )
    engine = LLMEngine(
        EngineConfig(
            model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed or 0
        )
    )
    if engine.synthetic:
        print(f"[synthetic weights: {engine.weights_source}; the text is meaningless]", file=sys.stderr)
    prompt = args.prompt
    if not args.raw and engine.tokenizer.chat_template:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    engine.add_request(prompt, params)
    start = time.perf_counter()
    out = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.delta_text)
            sys.stdout.flush()
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    if out is not None and args.verbose:
        print(
            f"[{out.num_output_tokens} tokens in {elapsed:.2f}s, "
            f"{out.num_output_tokens / elapsed:.1f} tok/s, "
            f"finish_reason={out.finish_reason}]",
            file=sys.stderr,
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prism", description="prism-serve: many LLMs on few accelerators")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="print a completion of one prompt (streams to stdout)")
    g.add_argument("prompt")
    _add_engine_args(g)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    g.add_argument("-v", "--verbose", action="store_true", help="print token count and speed to stderr")
    g.set_defaults(func=_cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PrismError as e:
        print(f"prism: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
