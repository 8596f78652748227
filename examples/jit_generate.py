"""Greedy generation with your own jitted prefill and decode step (copy and modify freely).

    python examples/jit_generate.py --prompt "It is a truth" --max-tokens 64

modelopt_jax gives you a pure cached forward, ``forward(state, ids, positions, cache)``; the loop,
the jit boundaries and the sampling rule below are yours. ``LLM.generate`` does the same, batched.
"""

import argparse
import os
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
from tokenizers import Tokenizer

import modelopt_jax
from modelopt_jax.checkpoint.hf_config import eos_ids

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", help="checkpoint directory (default: the embedded qwen2-bytes-fp8 demo)")
parser.add_argument("--prompt", default="It is a truth universally acknowledged")
parser.add_argument("--max-tokens", type=int, default=64)
parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
args = parser.parse_args()

path = args.model or modelopt_jax.demo_checkpoint_path()
model = modelopt_jax.load(path, dtype=args.dtype)
tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
ids = tokenizer.encode(args.prompt).ids
if model.config.bos_token_id is not None and ids[:1] != [model.config.bos_token_id]:
    ids = [model.config.bos_token_id] + ids  # the byte-level demo tokenizer adds no BOS itself
stop = set(eos_ids(path))

forward, state = modelopt_jax.make_cached_forward(model)  # pure: (state, ids, positions, cache)
cache = modelopt_jax.init_cache(model, batch=1, max_len=len(ids) + args.max_tokens)


@partial(jax.jit, donate_argnums=1)  # donate the cache: updated in place, not copied
def prefill(state, cache, ids):  # ids [1, T] -> first new token [1], filled cache
    positions = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
    last = jnp.array([ids.shape[1] - 1])  # only the last prompt token's logits are needed
    logits, cache = forward(state, ids, positions, cache, logit_positions=last)
    return jnp.argmax(logits[:, -1], axis=-1), cache


@partial(jax.jit, donate_argnums=1)
def decode(state, cache, token, position):  # token [1] at position [] -> next token [1]
    logits, cache = forward(state, token[:, None], jnp.full((1, 1), position), cache)
    return jnp.argmax(logits[:, -1], axis=-1), cache


t0 = time.perf_counter()
token, cache = prefill(state, cache, jnp.asarray([ids], jnp.int32))
new = [int(token[0])]
for position in range(len(ids), len(ids) + args.max_tokens - 1):
    if new[-1] in stop:
        break
    token, cache = decode(state, cache, token, jnp.int32(position))
    new.append(int(token[0]))
elapsed = time.perf_counter() - t0
print(args.prompt + tokenizer.decode(new, skip_special_tokens=True))
print(f"[{len(new)} tokens in {elapsed:.2f} s incl. compilation]", file=sys.stderr)
