"""Full-sequence logits for outside verification.

    python -m k3serve.model.score --model DIR --tokens 1,2,3 [--dtype float32]

prints `{"model": ..., "tokens": [...], "dtype": ..., "logits": [[...vocab...] per token]}`.
It runs one prefill pass of the whole sequence through the same model and cache code that the
engine uses, so it is the oracle that chunked prefill, decode and disaggregated serving are
compared against.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from k3serve.model.batch import ForwardBatch, ModelCache
from k3serve.model.loader import load_model
from k3serve.model.model import KimiForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def score_tokens(model: KimiForCausalLM, token_ids: list[int], block_size: int = 64) -> torch.Tensor:
    """[len(token_ids), vocab] fp32 logits of one full-sequence forward, from a fresh cache."""
    if not token_ids:
        raise ValueError("score needs at least one token")
    vocab = model.config.vocab_size
    bad = [t for t in token_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    num_blocks = math.ceil(len(token_ids) / block_size)
    device = next(model.parameters()).device
    cache = ModelCache.allocate(model.config, num_blocks, 1, block_size, model.tp.world_size, model.dtype, device)
    batch = ForwardBatch.build([token_ids], [0], [list(range(num_blocks))], [0], block_size, device=device)
    return model.compute_logits(model(batch, cache))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k3serve.model.score", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint directory (HF format)")
    parser.add_argument("--tokens", required=True, help="comma-separated token ids, e.g. 1,2,3")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    try:
        tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    except ValueError:
        parser.error(f"--tokens must be comma-separated integers, got {args.tokens!r}")
    model = load_model(args.model, dtype=DTYPES[args.dtype], device=args.device)
    try:
        logits = score_tokens(model, tokens)
    except ValueError as e:
        parser.error(str(e))
    json.dump({"model": args.model, "tokens": tokens, "dtype": args.dtype, "logits": logits.tolist()}, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
