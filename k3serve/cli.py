"""The `k3serve` command line. Each subcommand imports its implementation lazily, so `--help`
is instant and a command never pays for another's dependencies."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import UnionType
from typing import TYPE_CHECKING, Any, Literal, Union, get_args, get_origin

from k3serve.model.packaged import DEFAULT_MODEL

if TYPE_CHECKING:
    from k3serve.cluster.config import ServeConfig


def _make_checkpoint(args: argparse.Namespace) -> int:
    from k3serve.model.checkpoint import make_checkpoint
    from k3serve.progress import stage

    from k3serve.model.config import ConfigError

    layers = "" if args.layers is None else f", first {args.layers} layers"
    try:
        if args.drafter is not None:
            from k3serve.model.draft.checkpoint import make_drafter_checkpoint

            if args.target is None:
                raise ConfigError("--drafter needs --target, the checkpoint directory of the model it drafts for")
            with stage(f"writing a random {args.drafter} drafter for {args.target} (seed {args.seed}) to {args.out}"):
                make_drafter_checkpoint(args.drafter, args.target, args.out, seed=args.seed,
                                        echo_weight=args.echo_weight)
            return 0
        with stage(f"writing the {args.preset} checkpoint (seed {args.seed}{layers}, random weights) to {args.out}"):
            make_checkpoint(args.preset, args.out, seed=args.seed, num_layers=args.layers, device=args.device,
                            echo_weight=args.echo_weight)
    except ConfigError as exc:
        print(f"k3serve make-checkpoint: {exc}", file=sys.stderr)
        return 2
    return 0


def _score(args: argparse.Namespace) -> int:
    from k3serve.model import score

    return score.main(["--model", args.model, "--tokens", args.tokens, "--dtype", args.dtype])


def _plan(args: argparse.Namespace) -> int:
    from k3serve.engine.config import EngineArgs
    from k3serve.engine.memory import describe_plan
    from k3serve.model.config import ConfigError, ModelConfig
    from k3serve.model.presets import PRESETS, preset_config

    try:
        config = preset_config(args.model) if args.model in PRESETS else ModelConfig.from_dir(args.model)
    except ConfigError as exc:
        print(f"k3serve plan: {exc} (--model takes a checkpoint directory or a preset: {', '.join(PRESETS)})",
              file=sys.stderr)
        return 2
    try:
        engine_args = EngineArgs(
            model=args.model, device="cuda", tensor_parallel_size=args.tp, dtype=args.dtype,
            max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
            gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
            max_num_batched_tokens=args.max_num_batched_tokens,
            decode_context_parallel_size=args.decode_context_parallel_size,
        )
    except ValueError as exc:
        print(f"k3serve plan: {exc}", file=sys.stderr)
        return 2
    rows = describe_plan(config, engine_args, int(args.device_memory_gib * 2**30))
    width = max(len(k) for k, _ in rows)
    print(f"per-rank memory plan for {args.model}")
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from k3serve import LLM, SamplingParams
    from k3serve.progress import stage

    with stage(f"loading {args.model} (a preset's checkpoint is written on first use)", out=sys.stderr):
        llm = LLM(model=args.model, max_model_len=args.max_model_len)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    for out in llm.generate(args.prompt, params):
        print(f"{out.prompt!r} -> {out.outputs[0].text!r} ({out.outputs[0].finish_reason})")
    return 0


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """What `k3serve serve` runs: the --config file's values, then the flags given on top."""
    from k3serve.cluster.config import ServeConfig

    flags = {k: v for k, v in vars(args).items() if k not in ("command", "func", "config")}
    return ServeConfig.load(args.config, **flags)


def _serve(args: argparse.Namespace) -> int:
    from k3serve.cluster.serve import run

    return run(serve_config(args))


def _status(args: argparse.Namespace) -> int:
    import os

    from k3serve.cluster.config import API_KEY_ENV
    from k3serve.cluster.status import print_status

    return print_status(args.url, args.api_key or os.environ.get(API_KEY_ENV), as_json=args.json)


def _add_serve_options(p: argparse.ArgumentParser) -> None:
    """`serve`'s options: one a ServeConfig field, by the same name, in its order, the engine arguments (EngineOptions)
    in a group of their own. A flag's help (the field's description), type, choices (a Literal's) and the default the help shows
    come from the field: the help cannot drift from what serving does. A boolean is a pair, `--NAME/--no-NAME` (as
    vLLM's `--enable-prefix-caching/--no-enable-prefix-caching`); a tuple of ints is comma-separated. Each flag itself
    defaults to None: only a flag given overrides --config's value (`serve_config`)."""
    from k3serve.cluster.config import API_KEY_ENV, EngineOptions, ServeConfig

    cli_notes = {"api_key": f"; a flag shows in `ps`: prefer ${API_KEY_ENV}, read when neither this flag nor "
                            "--config gives a key"}
    engine = p.add_argument_group("engine arguments", "one value for every engine; a --prefill-NAME / --decode-NAME "
                                  "form sets NAME for that pool's engines alone")
    for name, field in ServeConfig.model_fields.items():
        text = (field.description or "") + cli_notes.get(name, "")
        if field.default is not None:  # a None default is for the description to explain
            text += f" (default: {_shown(field.default)})"
        group = engine if name in EngineOptions.model_fields else p
        flag, kind = "--" + name.replace("_", "-"), _value_kind(field.annotation)
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, help=text.replace("%", "%%"))
            continue
        group.add_argument(flag, type=_int_list if kind is tuple else kind, choices=_choices(field.annotation),
                           metavar="N,N,..." if kind is tuple else None, help=text.replace("%", "%%"))


def _shown(default: object) -> str:
    return f"{default:g}" if isinstance(default, float) else str(default)


def _value_types(annotation: Any) -> set[Any]:
    """What a field's value may be, None aside: `int | None` -> {int}."""
    if get_origin(annotation) in (Union, UnionType):
        return set(get_args(annotation)) - {type(None)}
    return {annotation}


def _value_kind(annotation: Any) -> type:
    """bool, int, float or tuple (of ints) for such a field (None allowed or not), so argparse parses and rejects
    a bad value; else str."""
    kinds = {get_origin(k) or k for k in _value_types(annotation)}
    return kinds.pop() if kinds in ({bool}, {int}, {float}, {tuple}) else str


def _choices(annotation: Any) -> tuple[Any, ...] | None:
    """A Literal field's values (None allowed or not); None for any other field."""
    (kind, *others) = _value_types(annotation)
    return get_args(kind) if not others and get_origin(kind) is Literal else None


def _int_list(text: str) -> tuple[int, ...]:
    """`1,2,4,8` -> (1, 2, 4, 8)."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="k3serve",
        description="Serve Kimi-K3-architecture models (KDA + MLA + latent MoE) with prefill/decode "
        "disaggregation. Run `k3serve COMMAND --help` for the options of a command.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "make-checkpoint",
        help="write a deterministic HF-format checkpoint of a preset (random weights, real format)",
        description="Write config.json, sharded safetensors in the published K3 naming (MXFP4 routed experts) "
        "and a small trained BPE tokenizer. Same preset + seed = same bytes.",
    )
    p.add_argument("--preset", default="k3-tiny", help="preset name (default: k3-tiny)")
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights (default: 0)")
    p.add_argument("--layers", type=int, help="keep the preset's first N layers, K3's layer pattern kept (default: all; "
                   "k3-rank-slice has 12)")
    p.add_argument("--device", help="where the weights are drawn: cpu or cuda (default: the CPU for a small preset, "
                   "the same bytes everywhere; else CUDA, e.g. k3-rank-slice)")
    p.add_argument("--drafter", choices=["eagle", "dspark"], help="write a random speculative decoding drafter of "
                   "this method for --target instead of a preset (its vocabulary and hidden size)")
    p.add_argument("--target", type=Path, help="with --drafter: the target model's checkpoint directory")
    p.add_argument("--echo-weight", type=float, default=0.0, help="a model that repeats its last token (target: that "
                   "multiple of the embedding added to the lm_head; drafter: one that proposes it): speculative "
                   "decoding's tests and benchmarks (default: 0, plain random weights)")
    p.set_defaults(func=_make_checkpoint)

    p = sub.add_parser("score", help="print the full-sequence logits of a token list as JSON")
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--tokens", required=True, help="comma-separated token ids")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.set_defaults(func=_score)

    p = sub.add_parser(
        "plan",
        help="print the per-rank memory budget of a model at a TP size",
        description="Weights, MLA KV bytes per token, KDA state bytes per request and how many tokens and "
        "requests fit per rank, to size a deployment (e.g. Kimi-K3 on GB300: --tp 8 --device-memory-gib 279).",
    )
    p.add_argument("--model", default="kimi-k3", help="checkpoint directory or preset (default: kimi-k3)")
    p.add_argument("--tp", type=int, default=8, help="tensor-parallel size (default: 8)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device-memory-gib", type=float, default=279.0, help="memory per device (default: GB300, 279 GiB)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=4096, help="sizes the CUDA graphs' block tables")
    p.add_argument("--max-num-batched-tokens", type=int, help="a step's base token budget (default: the engine's for "
                   "this device memory); sizes the prefill activations set aside")
    p.add_argument("--enforce-eager", action="store_true", help="plan without CUDA graphs (no pad slot, no pool)")
    p.add_argument("--decode-context-parallel-size", type=int, default=1,
                   help="ranks that split each request's MLA latent KV by sequence, dividing --tp (default: 1); the "
                   "plan sets the context that fits against the same engine without it")
    p.set_defaults(func=_plan)

    p = sub.add_parser("generate", help="generate text offline for one or more prompts (no server)")
    p.add_argument("prompt", nargs="+", help="prompt text")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"checkpoint directory, shipped model or small preset (default: {DEFAULT_MODEL})")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.set_defaults(func=_generate)

    p = sub.add_parser(
        "serve",
        help="serve the OpenAI API (disaggregated prefill/decode pools, or colocated)",
        description="Start prefill and decode pools (or one colocated engine) and an OpenAI-compatible ingress. "
        "Flags override --config YAML (keys: the flag names with underscores); the defaults are ServeConfig's.",
    )
    _add_serve_options(p)
    p.add_argument("--config", type=Path, help="YAML file with any of the options above")
    p.set_defaults(func=_serve)

    p = sub.add_parser("status", help="health, model, and a table of the pools' replicas (usage, engine settings) "
                       "and the last minute's latency of a running server")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--json", action="store_true", help="print the status as JSON, for scripts")
    p.add_argument("--api-key", help="the server's API key, for /v1/models (default: $K3SERVE_API_KEY)")
    p.set_defaults(func=_status)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
