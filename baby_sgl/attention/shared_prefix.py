"""Decode attention that reads a prefix shared by several requests once ("cascade" attention).

Requests that matched the same radix-tree path hold the very same KV slots for that prefix.
Attending to it separately per request gathers and scores the same keys again and again; a
decode batch of 64 requests behind one 1024-token system prompt would copy 64 x 1024 slots per
layer. Instead, each group's queries attend to the shared slots together (one short query
sequence per group), every request attends to its own remaining slots, and the two partial
results are merged with their log-sum-exps (exact up to rounding).

A slot is owned by one tree node, so two rows holding the same slot at position j hold the same
slots at every position before j; the grouping still checks every slot it shares. Groups are
found by splitting the batch where rows first differ, so requests that share a long prefix are
grouped even when others share only the first few slots with them.
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
    kv_lens: torch.Tensor  # [G] how many of them each group has
    mask: torch.Tensor  # [G, 1, 1, C] 0 for a shared slot, -inf for padding
    members: torch.Tensor  # [G, M] batch rows of each group, padded by repeating a member
    rows: torch.Tensor  # [S] batch rows that belong to a group
    flat: torch.Tensor  # [S] where each of those rows sits in the flattened [G * M] layout
    lens: list[int]  # per batch row: how many leading slots come from its group (0 if none)


def find_shared_prefixes(rows: torch.Tensor, seq_lens: list[int], dtype: torch.dtype,
                         device: torch.device | str = "cpu") -> SharedPrefixes | None:
    """rows: [B, L] the batch's KV slot table (host tensor); the result's tensors are put on
    `device`. None when nothing is worth sharing."""
    # Each request's last slot is its own new token, so at most seq_len - 1 can be shared.
    limits = [n - 1 for n in seq_lens]
    groups: list[tuple[list[int], int]] = []
    _group(rows, limits, list(range(len(seq_lens))), 0, groups)
    if not groups:
        return None
    width = max(len(m) for m, _ in groups)
    longest = max(n for _, n in groups)
    kv_indices = torch.zeros(len(groups), longest, dtype=rows.dtype, device="cpu")  # built here, then moved
    mask = torch.full((len(groups), 1, 1, longest), float("-inf"), dtype=dtype, device="cpu")
    members_t = torch.zeros(len(groups), width, dtype=torch.int64, device="cpu")
    flat_rows, flat, lens = [], [], [0] * len(seq_lens)
    for g, (members, n) in enumerate(groups):
        kv_indices[g, :n] = rows[members[0], :n]
        mask[g, ..., :n] = 0
        members_t[g] = torch.tensor(members + [members[0]] * (width - len(members)), device="cpu")
        for m, b in enumerate(members):
            flat_rows.append(b)
            flat.append(g * width + m)
            lens[b] = n
    kv_lens = torch.tensor([n for _, n in groups], device=device)
    return SharedPrefixes(kv_indices.to(device), kv_lens, mask.to(device), members_t.to(device),
                          torch.tensor(flat_rows, device=device), torch.tensor(flat, device=device), lens)


def _group(rows: torch.Tensor, limits: list[int], members: list[int], start: int,
           groups: list[tuple[list[int], int]]) -> list[int]:
    """Members agree on the slots before `start`. Finds how far they all agree, groups the
    subsets that agree further (recursively: a prompt that shares only a BOS or a chat header
    with the rest must not stop the others sharing their long prefix), and groups what is left
    at the common length if that is worth it. Appends (members, length) to `groups`; returns
    the members it placed in none."""
    end = min(limits[b] for b in members)
    block = rows[members, start:end]
    n = start + int((block == block[0]).all(0).int().cumprod(0).sum())
    by_next: dict[int, list[int]] = defaultdict(list)
    left: list[int] = []
    at_n = rows[members, n].tolist()  # n < every seq_len, so inside the table
    for b, slot in zip(members, at_n):  # at position n they differ, or some have nothing more to share
        (left if limits[b] <= n else by_next[slot]).append(b)
    for sub in by_next.values():
        left += _group(rows, limits, sub, n, groups) if len(sub) > 1 else sub
    if len(left) > 1 and n >= MIN_SHARED_LEN:
        groups.append((left, n))
        return []
    return left


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Softmax attention over keys A and B from its two halves: out [..., D], lse [...]."""
    total = torch.logaddexp(lse_a, lse_b)
    wa = (lse_a - total).exp().unsqueeze(-1)
    wb = (lse_b - total).exp().unsqueeze(-1)
    return (out_a.float() * wa + out_b.float() * wb).to(out_a.dtype)
