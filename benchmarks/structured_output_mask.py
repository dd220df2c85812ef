"""Per-step cost of structured outputs for a decode batch: `constrained` of `rows` requests under a JSON schema.

    python benchmarks/structured_output_mask.py [--rows 32] [--constrained 8] [--vocab 512 163840]
        [--steps 200] [--device cpu] [--out results.json]

One decode step's sampling as `LLMEngine.step` does it, on random logits [rows, V] (the model is not what this
measures), greedy rows:

    free         no request is constrained: the sampler alone (what a batch without a constraint pays)
    constrained  `constrained` rows under a JSON schema (an object of an integer, an enum and a string): their
                 bitmask filled (`StructuredOutputs.token_mask`), copied and applied in the sampler, the sampled
                 tokens accepted into the matchers; a request whose output completed is replaced by a new one

The two modes take turns step by step. Prints the median microseconds of a step, the constraint's share
(constrained - free) and its parts (fill, apply, accept), each a median over the same steps. Vocabularies: 512 is
the tiny model's tokenizer; a larger one is synthetic (the tiny one's tokens, then distinct lowercase words,
numbers, punctuation runs and CJK pieces, with and without a leading space, as a BPE vocabulary has), so the fill
cost at K3's 163840 ids is of the right order, not Kimi's own.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from k3serve.engine.sampler import Sampler
from k3serve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from k3serve.engine.structured_output import StructuredOutputs
from k3serve.model.checkpoint import make_checkpoint
from k3serve.model.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "kind": {"enum": ["alpha", "beta", "gamma"]},
                                           "note": {"type": "string", "maxLength": 40}},
          "required": ["id", "kind", "note"], "additionalProperties": False}


@dataclass
class SyntheticVocabulary:
    """The tiny tokenizer's ids (special tokens and stop ids included) followed by generated pieces up to
    `vocab_size`: what `StructuredOutputs` reads of a tokenizer."""

    tiny: Tokenizer
    vocab_size: int

    def __post_init__(self) -> None:
        pieces = set(self.tiny.token_bytes(list(range(self.tiny.vocab_size))))
        self._bytes = list(self.tiny.token_bytes(list(range(self.tiny.vocab_size))))
        letters = "etaoinshrdlcumwfgypbvkjxqz"
        for piece in _generated_pieces(letters):
            if len(self._bytes) == self.vocab_size:
                break
            if piece not in pieces:
                pieces.add(piece)
                self._bytes.append(piece)
        self.stop_token_ids, self.special_token_ids = self.tiny.stop_token_ids, self.tiny.special_token_ids
        self.eos_token_id = self.tiny.eos_token_id

    def token_bytes(self, ids: list[int]) -> list[bytes]:
        return [self._bytes[i] for i in ids]


def _generated_pieces(letters: str):
    cjk = [chr(c) for c in range(0x4E00, 0x4E00 + 3000)]
    for n in itertools.count(1):
        for word in itertools.product(letters[: 8 + 2 * n], repeat=min(n, 4)):
            text = "".join(word)
            yield text.encode()
            yield (" " + text).encode()
            yield text.capitalize().encode()
        yield from (str(i).encode() for i in range(10 ** min(n, 3)))
        yield from ((" " + "".join(p)).encode() for p in itertools.product("{}[]:,\"'.()", repeat=min(n, 3)))
        yield from ("".join(p).encode() for p in itertools.product(cjk[: 60 * n], repeat=min(n, 2)))


def new_request(outputs: StructuredOutputs, request_ids: itertools.count) -> str:
    request_id = f"c{next(request_ids)}"
    outputs.add(request_id, SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams(json=SCHEMA)))
    return request_id


def measure(tokenizer, vocab: int, rows: int, num_constrained: int, steps: int, device: str) -> dict[str, float]:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=gen).to(device)
    params = [SamplingParams(temperature=0.0) for _ in range(rows)]
    empty, generators = [[] for _ in range(rows)], [None] * rows
    outputs = StructuredOutputs(tokenizer, vocab, pin_memory=device.startswith("cuda"))
    request_ids = itertools.count()
    constrained = [new_request(outputs, request_ids) for _ in range(num_constrained)]  # the first rows
    free_rows = [f"free{i}" for i in range(rows - num_constrained)]
    samplers = {"free": Sampler(), "constrained": Sampler()}
    times: dict[str, list[float]] = {k: [] for k in ("free", "constrained", "fill", "apply_and_sample", "accept")}

    def clock() -> float:
        if logits.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    for _ in range(steps):
        start = clock()
        samplers["free"].sample(logits, params, empty, empty, generators)
        times["free"].append(clock() - start)

        ids = constrained + free_rows
        start = clock()
        mask = outputs.token_mask(ids)
        filled = clock()
        sampled = samplers["constrained"].sample(logits, params, empty, empty, generators, token_mask=mask)
        applied = clock()
        verdict = outputs.accept_sampled(dict(zip(ids, sampled.sampled_token_ids)))
        end = clock()
        assert not verdict.failed, verdict.failed
        times["constrained"].append(end - start)
        times["fill"].append(filled - start)
        times["apply_and_sample"].append(applied - filled)
        times["accept"].append(end - applied)
        for i, request_id in enumerate(constrained):
            if request_id in verdict.terminated:
                outputs.release(request_id)
                constrained[i] = new_request(outputs, request_ids)
    result = {f"{k}_us": statistics.median(v[steps // 10:]) * 1e6 for k, v in times.items()}
    result["constraint_share_us"] = result["constrained_us"] - result["free_us"]
    result["requests_completed"] = next(request_ids) - num_constrained
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--constrained", type=int, default=8)
    parser.add_argument("--vocab", type=int, nargs="+", default=[512, 163840])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model-cache", default="/tmp/k3serve-bench-tiny")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model_dir = Path(args.model_cache)
    if not (model_dir / "tokenizer.json").is_file():
        make_checkpoint("k3-tiny", model_dir, seed=0)
    tiny = Tokenizer.from_dir(model_dir)
    results = {}
    for vocab in args.vocab:
        tokenizer = tiny if vocab == tiny.vocab_size else SyntheticVocabulary(tiny, vocab)
        row = measure(tokenizer, vocab, args.rows, args.constrained, args.steps, args.device)
        results[str(vocab)] = row
        print(f"V={vocab:>6}  {args.constrained}/{args.rows} rows constrained  "
              + "  ".join(f"{k}={v:.1f}" for k, v in row.items()), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
