"""Command line: ``python -m modelopt_jax {inspect,generate} ...`` (also installed as ``modelopt-jax``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _inspect(args) -> int:
    from modelopt_jax.inspect import format_report, inspect_checkpoint

    report = inspect_checkpoint(args.path)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _generate(args) -> int:
    import jax

    import modelopt_jax
    from modelopt_jax.greedy import eos_ids, greedy_continue
    from modelopt_jax.inspect import format_report, inspect_checkpoint

    path = args.model or modelopt_jax.demo_checkpoint_path()
    if not args.quiet:
        print(format_report(inspect_checkpoint(path)), end="\n\n")
    tokenizer_path = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tokenizer_path):
        raise SystemExit(f"{path}: no tokenizer.json; pass token ids with --ids instead of --prompt")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_path)
    t0 = time.perf_counter()
    model = modelopt_jax.load(path, dtype=args.dtype, backend=args.backend)
    t1 = time.perf_counter()
    ids = tokenizer.encode(args.prompt, add_special_tokens=True).ids
    bos = model.config.bos_token_id
    if bos is not None and (not ids or ids[0] != bos):
        ids = [bos] + ids
    stop = [] if args.ignore_eos else eos_ids(path)
    new = greedy_continue(model, ids, args.max_tokens, pad_id=model.config.pad_token_id or 0, stop_ids=stop)
    t2 = time.perf_counter()
    print(args.prompt + tokenizer.decode(new, skip_special_tokens=True))
    print(f"[{jax.default_backend()} {args.dtype}: load {t1 - t0:.2f}s, {len(new)} tokens (greedy, "
          f"cache-less) in {t2 - t1:.2f}s incl. compile]", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m modelopt_jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="describe a checkpoint (format, schemes, scales, bytes, warnings)")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_inspect)
    g = sub.add_parser("generate", help="greedy text continuation (default model: the embedded demo)")
    g.add_argument("--model", help="checkpoint directory (default: embedded qwen2-bytes-fp8 demo)")
    g.add_argument("--prompt", default="It is a truth universally acknowledged")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--backend", default="auto")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--quiet", action="store_true", help="skip the checkpoint report")
    g.set_defaults(func=_generate)
    args = parser.parse_args(argv)
    from modelopt_jax.errors import ModelOptJaxError

    try:
        return args.func(args)
    except (ModelOptJaxError, ValueError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
