"""Input factories shared by tests and benchmarks: random pools, sequences and steps."""

from __future__ import annotations

import copy
import random

import torch

from kvcanary.layout import ByteSource, KvLayout
from kvcanary import checks
from kvcanary.step import Step

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def paged_layout(num_blocks: int, block_size: int, row: int = 32, nsrc: int = 2, seed: int = 0,
                 device: torch.device | str = "cpu") -> KvLayout:
    g = torch.Generator().manual_seed(seed)
    return KvLayout(tuple(
        ByteSource.from_tensor(f"s{i}", torch.randint(0, 256, (num_blocks, block_size, row), dtype=torch.uint8,
                                                      generator=g).to(device), page_size=block_size)
        for i in range(nsrc)
    ))


def random_step(
    rng: random.Random,
    num_slots: int,
    block_size: int,
    lens: list[tuple[int, int]],
    kind: str = "block",
    pad_rows: int = 0,
    pad_tokens: bool = False,
    window: int | None = None,
    book: bool = False,
) -> tuple[Step, list[list[int]]]:
    """A step whose rows have ``(cached, new)`` lengths; slots are distinct blocks drawn at random.
    With ``book`` the expected tokens are rows of a wider token record, in shuffled order among
    rows of other requests, with tokens of later positions past each row's own (``expected_rows``).

    Returns the step and each row's token stream (cached + new).
    """
    blocks_needed = [-(-(c + n) // block_size) for c, n in lens]
    perm = rng.sample(range(num_slots // block_size), sum(blocks_needed))
    rows = len(lens) + pad_rows
    width = max([c + n for c, n in lens] + [1])
    tab = torch.zeros(rows, -(-width // block_size), dtype=torch.int64)
    stoks, offs, toks, poss, slots = [], [0], [], [], []
    k = 0
    for r, ((c, n), nb) in enumerate(zip(lens, blocks_needed)):
        tab[r, :nb] = torch.tensor(perm[k : k + nb])
        k += nb
        seq = [rng.randrange(1 << 16) for _ in range(c + n)]
        stoks.append(seq)
        for p in range(c, c + n):
            toks.append(seq[p])
            poss.append(p)
            s = int(tab[r, p // block_size]) * block_size + p % block_size
            slots.append(-1 if pad_tokens and rng.random() < 0.2 else s)
        offs.append(len(toks))
    offs += [len(toks)] * pad_rows
    exp = torch.full((rows, width), -1, dtype=torch.int64)
    for r, seq in enumerate(stoks):
        exp[r, : len(seq)] = torch.tensor(seq, dtype=torch.int64)
    cached = torch.tensor([c for c, _ in lens] + [rng.randrange(5) for _ in range(pad_rows)])
    erows = None
    if book:
        n = rows + rng.randint(1, 4)
        erows = torch.tensor(rng.sample(range(n), rows))
        rec = torch.randint(0, 1 << 16, (n, width + rng.randint(0, 9)), generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        for r, seq in enumerate(stoks):
            rec[erows[r], : len(seq)] = exp[r, : len(seq)]
        for r in range(len(stoks), rows):  # padding rows: a request's record all the same
            rec[erows[r]] = -1
        exp = rec
    kw: dict = {"block_table": tab, "block_size": block_size}
    if kind == "token":
        pos = torch.arange(tab.shape[1] * block_size)
        kw = {"slot_table": tab[:, pos // block_size] * block_size + pos % block_size}
    step = Step(
        cached_lens=cached,
        new_offsets=torch.tensor(offs),
        new_tokens=torch.tensor(toks, dtype=torch.int64),
        new_positions=torch.tensor(poss, dtype=torch.int64),
        new_slots=torch.tensor(slots, dtype=torch.int64),
        row_valid=torch.arange(rows) < len(lens),
        expected_tokens=exp,
        expected_rows=erows,
        # the write-input stream: mostly right, some unknown (-1), a few wrong
        expected_new_tokens=torch.tensor([rng.choice([t] * 8 + [-1, t + 1]) for t in toks], dtype=torch.int64),
        read_starts=None if window is None else (cached - window).clamp_min(0),
        **kw,
    )
    return step, stoks


def prefill_of(step: Step, stoks: list[list[int]]) -> Step:
    """The step that wrote the cached part of ``step``'s rows as one prefill from position 0."""
    offs, toks, poss = [0], [], []
    for r, seq in enumerate(stoks):
        c = int(step.cached_lens[r])
        toks += seq[:c]
        poss += list(range(c))
        offs.append(len(toks))
    nvalid = len(stoks)
    rows = torch.arange(nvalid)
    poss_t = torch.tensor(poss, dtype=torch.int64)
    row_of = torch.repeat_interleave(rows, torch.tensor([o2 - o1 for o1, o2 in zip(offs, offs[1:])]))
    return Step(
        cached_lens=torch.zeros(nvalid, dtype=torch.int64),
        new_offsets=torch.tensor(offs),
        new_tokens=torch.tensor(toks, dtype=torch.int64),
        new_positions=poss_t,
        new_slots=step.lookup(row_of, poss_t),
        slot_table=step.slot_table[:nvalid] if step.slot_table is not None else None,
        block_table=step.block_table[:nvalid] if step.block_table is not None else None,
        block_size=step.block_size,
    )


def step_to(step: Step, device: torch.device | str) -> Step:
    """``step`` with every tensor field moved to ``device`` (in place; returned for chaining)."""
    for f in step.__dataclass_fields__:
        v = getattr(step, f)
        if isinstance(v, torch.Tensor):
            setattr(step, f, v.to(device))
    return step


def clone_step(step: Step) -> Step:
    """A copy of ``step`` whose tensors are copies too."""
    out = copy.copy(step)
    for f in step.__dataclass_fields__:
        v = getattr(step, f)
        if isinstance(v, torch.Tensor):
            setattr(out, f, v.clone())
    return out


def make_layout(kind: str, nb: int, bs: int, seed: int) -> KvLayout:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randint(-3000, 3000, shape, generator=g).to(torch.float16).to(DEV)

    if kind == "paged":
        return KvLayout(tuple(ByteSource.from_tensor(f"l{i}", rnd(nb, bs, 2, 8), page_size=bs) for i in range(2)))
    if kind == "packed":
        t = rnd(nb, 2, bs, 2, 8)
        return KvLayout(tuple(ByteSource.from_tensor(h, t[:, i], page_size=bs) for i, h in enumerate("kv")))
    if kind == "head_major":
        return KvLayout((ByteSource.from_tensor("k", rnd(nb, 2, bs, 8).permute(0, 2, 1, 3), page_size=bs),))
    if kind == "partial":
        return KvLayout((ByteSource.from_tensor("k", rnd(nb, bs, 4, 16), page_size=bs, read_bytes=32),))
    if kind == "mixed":  # page sizes 1 and bs; rows of 12, 80 (two tiles) and 2 x 16 words: partial tiles
        return KvLayout((ByteSource.from_tensor("flat", rnd(nb * bs, 48)),
                         ByteSource.from_tensor("wide", rnd(nb, bs, 320), page_size=bs),
                         ByteSource.from_tensor("heads", rnd(nb, 2, bs, 64).permute(0, 2, 1, 3), page_size=bs)))
    from kvcanary import layouts

    # vLLM CPU, 2 layers in one allocation, one head (corrupt() indexes slot_bytes as [rows, row_bytes]; many
    # heads, whose views have a group dim, are in test_layouts.py): K in 2-byte elements bs apart, V 16-byte rows
    if kind == "vec":
        t = rnd(2, nb, 1, bs, 16)
        return layouts.vllm_cpu_vec([t[0], t[1]], bs, 1, 8)
    if kind == "amx":  # bf16: K 4-byte pairs interleaved across 16 tokens, V 2-byte elements of token pairs
        t = rnd(2, nb, 1, bs, 32).to(torch.bfloat16)
        return layouts.vllm_cpu_amx([t[0], t[1]], bs, 1, 16)
    return KvLayout()  # metadata only


def corrupt(rng, stamps, layout, step):
    for _ in range(rng.randint(1, 4)):
        what = rng.choice(["stamp", "byte", "table", "token", "unknown"])
        if what == "unknown":  # slots the canary lost track of: counted, not checked, chains reseeded
            for _ in range(rng.randint(1, 6)):
                stamps[rng.randrange(stamps.shape[0])] = torch.tensor(checks.UNKNOWN_STAMP)
        elif what == "stamp":
            stamps[rng.randrange(stamps.shape[0]), rng.randrange(4)] ^= 1 << rng.randrange(63)
        elif what == "byte" and layout.sources:
            src = rng.choice(layout.sources)
            row = src.slot_bytes(rng.randrange(stamps.shape[0]))
            row[rng.randrange(src.rows), rng.randrange(src.row_bytes)] ^= 1 << rng.randrange(8)
        elif what == "table":
            t = step.table
            t[rng.randrange(t.shape[0]), rng.randrange(t.shape[1])] = rng.randrange(-1, int(t.max()) + 2)
        elif step.expected_tokens is not None:
            step.expected_tokens[rng.randrange(step.expected_tokens.shape[0])] += 1
