"""Decode attention that reads a prefix shared by several requests once ("cascade" attention).

Requests that matched the same radix-tree path hold the very same KV slots for that prefix.
Attending to it separately per request gathers and scores the same keys again and again; a
decode batch of 64 requests behind one 1024-token system prompt would copy 64 x 1024 slots per
layer. Instead, each group's queries attend to the shared slots together (one short query
sequence per group), every request attends to its own remaining slots, and the two partial
results are merged exactly with their log-sum-exps.

A slot is owned by one tree node, so two rows holding the same slot at position j hold the same
slots at every position before j: the first slot identifies a group, and the common prefix is
the leading run of positions where all members agree.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

# Shorter common prefixes are read per request: a second attention call would cost more.
MIN_SHARED_LEN = 32


@dataclass
class SharedPrefixes:
    kv_indices: torch.Tensor  # [G, C] each group's shared slots, padded
    mask: torch.Tensor  # [G, 1, 1, C] 0 for a shared slot, -inf for padding
    members: torch.Tensor  # [G, M] batch rows of each group, padded by repeating a member
    rows: torch.Tensor  # [S] batch rows that belong to a group
    flat: torch.Tensor  # [S] where each of those rows sits in the flattened [G * M] layout
    lens: list[int]  # per batch row: how many leading slots come from its group (0 if none)


def find_shared_prefixes(rows: torch.Tensor, seq_lens: list[int], dtype: torch.dtype) -> SharedPrefixes | None:
    """rows: [B, L] the batch's KV slot table (host tensor). None when nothing worth sharing."""
    by_first: dict[int, list[int]] = defaultdict(list)
    for b, first in enumerate(rows[:, 0].tolist()):
        by_first[first].append(b)
    groups = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        # Each request's last slot is its own new token, so at most seq_len - 1 can be shared.
        limit = min(seq_lens[b] for b in members) - 1
        block = rows[members, :limit]
        agree = (block == block[0]).all(0)
        n = int(agree.int().cumprod(0).sum())
        if n >= MIN_SHARED_LEN:
            groups.append((members, n))
    if not groups:
        return None
    width = max(len(m) for m, _ in groups)
    longest = max(n for _, n in groups)
    kv_indices = torch.zeros(len(groups), longest, dtype=rows.dtype)
    mask = torch.full((len(groups), 1, 1, longest), float("-inf"), dtype=dtype)
    members_t = torch.zeros(len(groups), width, dtype=torch.int64)
    flat_rows, flat, lens = [], [], [0] * len(seq_lens)
    for g, (members, n) in enumerate(groups):
        kv_indices[g, :n] = rows[members[0], :n]
        mask[g, ..., :n] = 0
        members_t[g] = torch.tensor(members + [members[0]] * (width - len(members)))
        for m, b in enumerate(members):
            flat_rows.append(b)
            flat.append(g * width + m)
            lens[b] = n
    return SharedPrefixes(kv_indices, mask, members_t, torch.tensor(flat_rows), torch.tensor(flat), lens)


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Softmax attention over keys A and B from its two halves: out [..., D], lse [...]."""
    total = torch.logaddexp(lse_a, lse_b)
    wa = (lse_a - total).exp().unsqueeze(-1)
    wb = (lse_b - total).exp().unsqueeze(-1)
    return (out_a.float() * wa + out_b.float() * wb).to(out_a.dtype)
