"""The `k3serve` command line. Each subcommand imports its implementation lazily, so `--help`
is instant and a command never pays for another's dependencies."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path



def _make_checkpoint(args: argparse.Namespace) -> int:
    from k3serve.model.checkpoint import make_checkpoint

    out = make_checkpoint(args.preset, args.out, seed=args.seed)
    print(f"wrote {args.preset} checkpoint (seed {args.seed}) to {out}")
    return 0


def _score(args: argparse.Namespace) -> int:
    from k3serve.model import score

    return score.main(["--model", args.model, "--tokens", args.tokens, "--dtype", args.dtype])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="k3serve",
        description="Serve Kimi-K3-architecture models (KDA + MLA + latent MoE) with prefill/decode "
        "disaggregation. Run `k3serve COMMAND --help` for the options of a command.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "make-checkpoint",
        help="write a deterministic HF-format checkpoint of a small preset (random weights, real format)",
        description="Write config.json, sharded safetensors in the published K3 naming (MXFP4 routed experts) "
        "and a small trained BPE tokenizer. Same preset + seed = same bytes.",
    )
    p.add_argument("--preset", default="k3-tiny", help="preset name (default: k3-tiny)")
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights (default: 0)")
    p.set_defaults(func=_make_checkpoint)

    p = sub.add_parser("score", help="print the full-sequence logits of a token list as JSON")
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--tokens", required=True, help="comma-separated token ids")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.set_defaults(func=_score)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
