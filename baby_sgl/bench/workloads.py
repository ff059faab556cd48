"""Benchmark workloads: the same seed gives the same prompts to every engine compared."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def input_tokens(self) -> int:
        return sum(map(len, self.prompts))


def random_workload(n: int, vocab: int, input_range: tuple[int, int], output_range: tuple[int, int],
                    seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(*input_range))] for _ in range(n)]
    return Workload("random", prompts, [rng.randint(*output_range) for _ in range(n)])


def shared_prefix_workload(groups: int, per_group: int, system_len: int, question_len: int, output_len: int,
                           vocab: int, seed: int) -> Workload:
    """SGLang's generated-shared-prefix: each group shares a system prompt; order is shuffled."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        system = [rng.randrange(100, vocab) for _ in range(system_len)]
        prompts += [system + [rng.randrange(100, vocab) for _ in range(question_len)] for _ in range(per_group)]
    rng.shuffle(prompts)
    return Workload("shared-prefix", prompts, [output_len] * len(prompts))


def one_batch_workload(batch: int, input_len: int, output_len: int, vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(input_len)] for _ in range(batch)]
    return Workload("one-batch", prompts, [output_len] * batch)
