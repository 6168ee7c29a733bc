"""The `pdserve` command line.

`pdserve generate` runs a single in-process engine (no Ray, no network) and streams the output.
Errors caused by the user's input are one line on stderr and exit status 2; nothing else prints a
traceback unless `--debug` is given.
"""

import argparse
import logging
import sys
from collections.abc import Sequence

from pdserve.config import load_engine_config
from pdserve.engine import LLMEngine, SamplingParams
from pdserve.errors import PdserveError

EXIT_USAGE = 2


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="LLM serving with PD disaggregation"
    )
    parser.add_argument("--debug", action="store_true", help="log verbosely and show tracebacks")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate from a prompt with an in-process engine")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--model", help="Hugging Face model directory (default: built-in tiny model)")
    gen.add_argument("--config", help="YAML config file (its `engine:` section is used)")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user chat message")
    gen.add_argument("--dtype", default=None, help="auto | float32 | bfloat16 | float16")
    gen.add_argument("--device", default=None, help="cpu | cuda")
    return parser


def _generate(args: argparse.Namespace) -> int:
    config = load_engine_config(
        args.config, overrides={"model": args.model, "dtype": args.dtype, "device": args.device}
    )
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
    )
    engine = LLMEngine.from_config(config)
    tokenizer = engine.tokenizer
    prompt = (
        tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
        if args.chat
        else args.prompt
    )
    finish_reason = None
    for output in engine.stream(prompt, params):
        sys.stdout.write(output.new_text)
        sys.stdout.flush()
        finish_reason = output.finish_reason
    sys.stdout.write("\n")
    print(f"[finish_reason={finish_reason}]", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return _generate(args)
    except PdserveError as e:
        if args.debug:
            raise
        print(f"pdserve: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
