"""The cache in your own loop: multi-turn chats served by a model call, greedy sampling and a
scheduler of this file's own, over jhicache's two-tier prefix cache (`CacheTiers`).

    python examples/own_loop.py [CHECKPOINT]  # Qwen2, Qwen3 or Llama 3; none: a tiny
                                              # random one (jhicache installed, or PYTHONPATH=.)

Two chats take turns on a device pool that holds about one of them, so a later turn finds its
cached prefix evicted to the host tier by the other chat's turn (the cache wrote it back when
it evicted it): this loop loads it back, its forward's attention waiting layer by layer on the
device for the copies (the load gate). Nothing here reaches into the cache: page ids are all
it hands out, and the loop's own requests hold them.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from collections.abc import Callable, Sequence

import jax.numpy as jnp
import numpy as np
from jhicache.models import (
    CausalLM,
    ModelPrograms,
    build_metadata,
    init_random,
    load_pretrained,
    pack_tokens,
    preset_config,
    save_checkpoint,
)

from jhicache.cache import CacheTiers, LoadTicket, Node, PoolLayout, PrefixCache

PAGE = 16  # tokens per KV page
DEVICE_TOKENS = 128  # the device pool: 8 pages, about one chat
HOST_TOKENS = 512  # the host pool under it
MAX_NEW = 8  # tokens generated per turn
BUCKET = 64  # prefill steps are padded to a multiple of this many tokens (fewer compiles)


@dataclasses.dataclass
class Running:
    """A turn in flight: its tokens, the device pages holding their KV, the cached prefix it
    locked (`node`, pages `[:shared]` are the cache's), and where its host hit came from."""

    tokens: list[int]
    pages: list[int]
    node: Node
    shared: int
    device_hit: int
    host_hit: int


class OwnLoop:
    """A model, its greedy sampling and a one-request-at-a-time scheduler over the cache."""

    def __init__(self, model: CausalLM) -> None:
        config = model.config
        layout = PoolLayout(num_layers=config.num_hidden_layers,
                            num_pages=DEVICE_TOKENS // PAGE + 1,  # + the reserved page 0
                            page_size=PAGE, num_kv_heads=config.num_key_value_heads,
                            head_dim=config.head_dim, dtype=model.dtype)
        self.tiers = CacheTiers.build(layout, host_pages=HOST_TOKENS // PAGE)
        self.cache: PrefixCache = self.tiers.cache
        self.programs = ModelPrograms(model)
        self.host_hit_tokens = 0

    def forward(self, tokens: Sequence[int], start: int, pages: list[int], gate: int,
                decode: bool) -> int:
        """Computes `tokens` at positions `start`.. into `pages` (the KV of positions before
        `start` is there already); returns the greedy next token. `gate`: the load flags'
        number each layer's attention waits for (0: none)."""
        pool = self.tiers.device_pool
        rows = 1 if decode else -(-len(tokens) // BUCKET) * BUCKET
        meta = build_metadata([start], [len(tokens)], [pages], page_size=PAGE, num_tokens=rows,
                              num_reqs=1, max_pages=DEVICE_TOKENS // PAGE, decode_only=decode)
        meta = dataclasses.replace(meta, load_flags=pool.load_flags,
                                   load_seq=jnp.asarray([gate], jnp.int32))
        last = jnp.asarray([len(tokens) - 1], jnp.int32)
        logits, k, v = self.programs.forward(tuple(pool.k), tuple(pool.v),
                                             pack_tokens([list(tokens)], rows), meta, last)
        pool.update(0, k, v, compute=logits)  # the pool's arrays were donated
        return int(jnp.argmax(logits[0]))  # greedy: the lowest id among equal logits

    def admit(self, prompt: list[int]) -> tuple[Running, list[LoadTicket]]:
        """Matches the prompt's cached prefix and locks it, loads its host run back, allocates
        the pages of the rest and of the turn's output; returns the loads to wait for."""
        match = self.cache.match(prompt, leave_last=True)  # >= 1 token left to compute
        node, pages = match.last_device_node, list(match.device_pages)
        self.cache.lock(node)  # first: the allocations below must not evict it
        tickets = list(match.loading)  # loads still landing in the device prefix
        ticket = self.cache.load_back(match)  # None: no host hit, or not worth loading
        if ticket is not None:
            self.cache.lock(match.last_node)
            self.cache.unlock(node)
            node = match.last_node
            pages += ticket.device_pages
            tickets.append(ticket)
        need = -(-(len(prompt) + MAX_NEW) // PAGE) - len(pages)
        more = self.cache.alloc_device(need)  # evicts unlocked prefixes (to host) if needed
        if more is None:
            raise RuntimeError("the device pool cannot hold this turn")
        host_hit = (len(pages) - len(match.device_pages)) * PAGE
        return Running(list(prompt), pages + more, node, len(pages), match.device_len,
                       host_hit), tickets

    def finish(self, run: Running) -> None:
        """Hands the turn's computed full pages to the cache (the last token's KV was never
        computed), frees the rest and unlocks its prefix."""
        full = (len(run.tokens) - 1) // PAGE
        known = self.cache.insert(run.tokens[:full * PAGE], run.pages[:full])
        # pages [shared, known) duplicate the tree's; [known, full) are the tree's now
        self.cache.free_device(run.pages[run.shared:known // PAGE] + run.pages[full:])
        self.cache.unlock(run.node)

    def turn(self, prompt: list[int]) -> list[int]:
        """One chat turn: the prompt's prefill, then `MAX_NEW - 1` decode steps."""
        with self.cache.step() as step:  # finished copies retire
            run, tickets = self.admit(prompt)
            gate = step.start_loads(tickets)  # the loads start; their gate for the forward
            start = run.shared * PAGE
            run.tokens.append(self.forward(prompt[start:], start, run.pages, gate, False))
        # leaving the step: the write-backs queued by its evictions start
        while len(run.tokens) < len(prompt) + MAX_NEW:
            with self.cache.step():
                position = len(run.tokens) - 1
                run.tokens.append(self.forward(run.tokens[-1:], position, run.pages, 0, True))
        self.finish(run)
        self.host_hit_tokens += run.host_hit
        print(f"turn of {len(prompt)} tokens: {run.device_hit} from device, {run.host_hit} "
              f"loaded from host, output {run.tokens[len(prompt):]}")
        return run.tokens[len(prompt):]


def user_turns(vocab_size: int, chats: int = 2, turns: int = 3,
               seed: int = 0) -> list[list[list[int]]]:
    """Each chat's user messages (random token ids): a 40-token system prompt and first
    message, then 24-token messages."""
    rng = np.random.default_rng(seed)
    return [[rng.integers(1, vocab_size, 40 if t == 0 else 24).tolist() for t in range(turns)]
            for _ in range(chats)]


def converse(generate: Callable[[list[int]], list[int]],
             messages: list[list[list[int]]]) -> list[list[int]]:
    """Runs the chats' turns round-robin through `generate(prompt) -> new tokens`; returns
    each chat's whole history."""
    histories: list[list[int]] = [[] for _ in messages]
    for t in range(len(messages[0])):
        for chat, turns in enumerate(messages):
            prompt = histories[chat] + turns[t]
            histories[chat] = prompt + generate(prompt)
    return histories


def random_checkpoint(directory: str) -> str:
    """A tiny random Qwen2 checkpoint (float32, untied head: a tied random head would just
    echo the last token)."""
    config = dataclasses.replace(preset_config("tiny"), tie_word_embeddings=False)
    save_checkpoint(init_random(config, seed=1), config, directory)
    return directory


def run(path: str) -> tuple[OwnLoop, list[list[int]]]:
    """The chats of `user_turns` through `OwnLoop` over the checkpoint at `path`; returns the
    loop (its cache idle: every copy landed, every page accounted for) and the histories."""
    model = load_pretrained(path, dtype=jnp.float32)
    loop = OwnLoop(model)
    histories = converse(loop.turn, user_turns(model.config.vocab_size))
    loop.cache.flush()  # every copy lands
    loop.cache.check_invariants()  # every page owned once, none held: nothing leaked
    return loop, histories


def main(argv: Sequence[str]) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        loop, _ = run(argv[0] if argv else random_checkpoint(scratch))
    stats = loop.cache.stats()
    print(f"host hits: {loop.host_hit_tokens} tokens; write-backs {stats['write_back_ops']}, "
          f"load-backs {stats['load_back_ops']}")


if __name__ == "__main__":
    main(sys.argv[1:])
