"""``sgl-agentcache`` command line."""

from __future__ import annotations

import argparse
import sys


def _make_tiny_model(args: argparse.Namespace) -> int:
    from sgl_agentcache.tiny_model import make_tiny_model

    model = make_tiny_model(args.dir, vocab_size=args.vocab_size, with_tokenizer=not args.no_tokenizer)
    tok = "with tokenizer" if model.has_tokenizer else "config only (use --skip-tokenizer-init)"
    print(f"wrote tiny Llama model to {model.path} ({tok}, vocab {model.vocab_size}); "
          "serve it with --load-format dummy")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from sgl_agentcache.demo import run_demo

    return run_demo(workers=args.workers)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sgl-agentcache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    tiny = sub.add_parser("make-tiny-model", help="write a tiny random-weight Llama (config + local tokenizer)")
    tiny.add_argument("dir")
    tiny.add_argument("--vocab-size", type=int, default=512, help="tokenizer/model vocabulary size")
    tiny.add_argument("--no-tokenizer", action="store_true", help="write only the model config")
    tiny.set_defaults(func=_make_tiny_model)
    demo = sub.add_parser("demo", help="run a forked agent program against a real CPU server")
    demo.add_argument("--workers", type=int, default=4)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
