"""Greedy generation for several prompts over one shared page pool, in your own jitted loop.

    python examples/paged_generate.py --prompt "It is a truth" --prompt "Emma" --max-tokens 32

The paged variant of ``examples/jit_generate.py``: instead of a dense [batch, max_len] cache, the
sequences share ``model.init_paged_cache(num_pages, page_size)`` and each owns a list of pages (its
block table). Prompts of different lengths need no padding to one length and no slots beyond what
each uses. ``model.forward_paged(ids, positions, pool, slots, block_tables)`` writes every token's
key/value at its slot and attends over its own pages. The page bookkeeping below (a free list, one
new page every ``page_size`` tokens) is what ``LLM.generate``'s engine does, with a scheduler on top.
"""

import argparse
import os
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tokenizers import Tokenizer

import modelopt_jax

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", help="checkpoint directory (default: the embedded qwen2-bytes-fp8 demo)")
parser.add_argument("--prompt", action="append", help="repeatable (default: two Austen openings)")
parser.add_argument("--max-tokens", type=int, default=32)
parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
parser.add_argument("--page-size", type=int, default=16)
args = parser.parse_args()
prompts = args.prompt or ["It is a truth universally acknowledged", "Emma Woodhouse, handsome, clever"]

path = args.model or modelopt_jax.demo_checkpoint_path()
model = modelopt_jax.load(path, dtype=args.dtype)
tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
bos = model.config.bos_token_id
rows = [([bos] if bos is not None else []) + tokenizer.encode(p).ids for p in prompts]

page = args.page_size
pages_per_row = -(-(max(map(len, rows)) + args.max_tokens) // page)
pool = model.init_paged_cache(num_pages=1 + len(rows) * pages_per_row, page_size=page)  # page 0: scratch
free = list(range(1, 1 + len(rows) * pages_per_row))
tables = np.zeros((len(rows), pages_per_row), np.int32)  # row b's pages, in position order
owned = [0] * len(rows)


def slots_for(b, positions):
    """Slots of row b's positions, taking a new page from the free list when a position needs one."""
    while owned[b] * page <= max(positions):
        tables[b, owned[b]] = free.pop()
        owned[b] += 1
    positions = np.asarray(positions)
    return tables[b, positions // page] * page + positions % page


graphdef, state = nnx.split(model)


@partial(jax.jit, donate_argnums=1)  # donate the pool: updated in place, not copied
def step(state, pool, ids, positions, slots, tables, last):
    logits, pool = nnx.merge(graphdef, state).forward_paged(ids, positions, pool, slots, tables, last)
    return jnp.argmax(logits[:, 0], axis=-1), pool


t0 = time.perf_counter()
# Prefill: all prompts in one step, each padded to the longest (padding writes to the scratch page).
width = max(map(len, rows))
ids, positions, slots = (np.zeros((len(rows), width), np.int32) for _ in range(3))
for b, row in enumerate(rows):
    ids[b, :len(row)], positions[b, :len(row)] = row, np.arange(len(row))
    slots[b, :len(row)] = slots_for(b, range(len(row)))
last = np.asarray([len(r) - 1 for r in rows], np.int32)
token, pool = step(state, pool, ids, positions, slots, tables, last)
new = [[int(t)] for t in token]
# Decode: one token per row per step, each at its own position.
for i in range(args.max_tokens - 1):
    positions = np.asarray([[len(r) + i] for r in rows], np.int32)
    slots = np.stack([slots_for(b, positions[b]) for b in range(len(rows))])
    token, pool = step(state, pool, jnp.asarray(token)[:, None], positions, slots, tables, np.zeros(len(rows), np.int32))
    for b, t in enumerate(token):
        new[b].append(int(t))
elapsed = time.perf_counter() - t0
for prompt, tokens in zip(prompts, new):
    print(prompt + tokenizer.decode(tokens, skip_special_tokens=True))
print(f"[{len(rows)} prompts x {args.max_tokens} tokens in {elapsed:.2f} s incl. compilation; "
      f"{sum(owned)} of {len(free) + sum(owned)} pages used]", file=sys.stderr)
