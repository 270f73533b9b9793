"""Length grouping with several micro-batches a step (issue 60): narrow micro-batches, dealt so that every
optimizer step still spans the lengths a random step does. One micro-batch a step keeps the 4-step windows
(tests/test_trainer_speed.py, "no wasted padding")."""

from __future__ import annotations

import random
import statistics

import pytest

from hpsearch.trainer.batching import GROUP_WINDOW_STEPS, micro_batches


def _lengths(n: int = 4096, seed: int = 0) -> list[int]:
    """Token counts shaped like SST-2's (many 3-10 token phrases, a long tail to 64)."""
    rng = random.Random(seed)
    return [min(64, 3 + int(rng.expovariate(1 / 10))) for _ in range(n)]


def _steps(batches: list[list[int]], per_step: int) -> list[list[int]]:
    return [[i for b in batches[s : s + per_step] for i in b] for s in range(0, len(batches), per_step)]


def _padding(lengths: list[int], batches: list[list[int]]) -> float:
    """Padded tokens per real token, each micro-batch padded to its own longest row."""
    return sum(len(b) * max(lengths[i] for i in b) for b in batches) / sum(lengths)


def _step_sd(lengths: list[int], steps: list[list[int]]) -> float:
    """How much a step mixes lengths: the mean over steps of the sd of its rows' lengths."""
    return statistics.mean(statistics.pstdev([lengths[i] for i in s]) for s in steps)


def _windows_of_four_steps(lengths: list[int], micro: int, batch: int) -> list[list[int]]:
    """The rule of 2026-12-06 for every accumulation: sort within shuffled windows of 4 steps, cut, shuffle."""
    rng = random.Random(0)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    window = batch * GROUP_WINDOW_STEPS
    flat = [i for s in range(0, len(order), window) for i in sorted(order[s : s + window], key=lengths.__getitem__)]
    batches = [flat[i : i + micro] for i in range(0, len(flat), micro)]
    rng.shuffle(batches)
    return batches


@pytest.mark.parametrize("per_step,least_sd", [(2, 0.68), (4, 0.88)])
def test_a_dealt_step_spans_the_lengths_of_a_random_step_not_one_band(per_step: int, least_sd: float) -> None:
    """Each step takes one narrow micro-batch from every part of its window's length range: within a step the
    lengths vary nearly as much as in a random step (4-step windows: 0.60 and 0.81 of it), and with four
    micro-batches no step (but the epoch's last, short one) lies within a band of 6 tokens (4-step windows: 8%
    of steps do)."""
    # 4001 rows: the epoch ends in a window short of whole steps, whose spare micro-batch must not shift the rest.
    lengths, micro = _lengths(4001), 32 // per_step
    random_steps = _steps(
        micro_batches(lengths, micro, seed=0, epoch=0, group_by_length=False, batch_size=32), per_step
    )
    dealt = _steps(micro_batches(lengths, micro, seed=0, epoch=0, group_by_length=True, batch_size=32), per_step)
    assert _step_sd(lengths, dealt) >= least_sd * _step_sd(lengths, random_steps)
    if per_step == 4:
        assert all(max(lengths[i] for i in s) - min(lengths[i] for i in s) > 6 for s in dealt[:-1])


@pytest.mark.parametrize("per_step", [2, 4])
def test_dealt_micro_batches_pad_as_little_as_wide_windows(per_step: int) -> None:
    """At most 1.1 padded tokens per real token (transformers' 50-batch windows: 1.04 on SST-2), where 4-step
    windows pad 1.32 (2 a step) and 1.14 (4 a step) and random batches 2.9 and 2.4."""
    lengths, micro = _lengths(), 32 // per_step
    dealt = micro_batches(lengths, micro, seed=0, epoch=0, group_by_length=True, batch_size=32)
    assert _padding(lengths, dealt) < 1.1
    assert _padding(lengths, _windows_of_four_steps(lengths, micro, 32)) > 1.12


@pytest.mark.parametrize("n", [4096, 1000, 37, 3])
def test_dealt_steps_hold_every_example_once_and_only_the_last_step_is_short(n: int) -> None:
    """As many micro-batches and steps as an ungrouped epoch (the loop's steps per epoch assume it), each row once;
    what is short of a whole step at the epoch's end makes one short step, the last."""
    lengths = _lengths(n)
    dealt = micro_batches(lengths, 8, seed=1, epoch=0, group_by_length=True, batch_size=32)
    plain = micro_batches(lengths, 8, seed=1, epoch=0, group_by_length=False, batch_size=32)
    assert sorted(i for b in dealt for i in b) == list(range(n))
    assert len(dealt) == len(plain) == -(-n // 8)
    steps = _steps(dealt, 4)
    assert len(steps) == -(-n // 32)
    # Every step but the last holds 32 rows: the epoch's partial micro-batch (rows short of 8) is in its last step,
    # where a halving after running out of memory, which may cut it into fewer pieces, shifts no later step.
    assert all(len(s) == 32 for s in steps[:-1])
    assert all(len(b) == 8 for b in dealt[: 4 * (len(steps) - 1)])


def test_dealt_steps_are_deterministic_in_seed_and_epoch_and_differ_between_them() -> None:
    lengths = _lengths()

    def draw(seed: int, epoch: int) -> list[list[int]]:
        return micro_batches(lengths, 8, seed=seed, epoch=epoch, group_by_length=True, batch_size=32)

    assert draw(3, 0) == draw(3, 0)
    assert draw(3, 0) != draw(4, 0) and draw(3, 0) != draw(3, 1)
    # Steps are shuffled over the epoch: their widest micro-batches are not in length order.
    widths = [max(max(lengths[i] for i in b) for b in s) for s in zip(*[iter(draw(3, 0))] * 4, strict=False)]
    assert widths != sorted(widths) and widths != sorted(widths, reverse=True)


def test_one_micro_batch_a_step_keeps_the_four_step_windows() -> None:
    """No accumulation: dealing cannot mix lengths inside a step, so the step is a quarter of a random 4-step
    window, as measured for held-out accuracy (docs/decisions.md), not a narrow dealt band."""
    lengths = _lengths()
    one = micro_batches(lengths, 32, seed=0, epoch=0, group_by_length=True, batch_size=32)
    narrow = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) <= 1 for b in one)
    assert narrow < len(one) / 4
    assert 1.4 < _padding(lengths, one) < 2.0  # 4-step windows' padding; dealt 32s would pad ~1.05


@pytest.mark.parametrize("n", [1001, 1000])
def test_a_halving_after_running_out_of_memory_keeps_every_dealt_step(n: int) -> None:
    """Batches.halve cuts each drawn micro-batch of 8 into pieces of 4, and the epoch's partial one (1 row, or 0)
    into one piece: each step still trains on the same rows as it would have unhalved, the steps after the
    partial micro-batch included."""
    from hpsearch.trainer.batching import Batches
    from hpsearch.trainer.config import TrainConfig
    from hpsearch.trainer.distributed import World
    from hpsearch.trainer.tokenised import Encoded, Prepared

    train = Encoded([[1] * length for length in _lengths(n)], [0] * n)
    data = Prepared(train, train, None, 0)
    cfg = TrainConfig(batch_size=32, micro_batch_size=8, seed=2)
    steps = -(-n // 32)

    def rows(batches: Batches) -> list[list[int]]:
        return [sorted(i for b in batches.of_step(k) for i in b) for k in range(steps)]

    whole = Batches(data, cfg, 8, World(), steps, drawn=8)
    expected = rows(whole)
    halved = Batches(data, cfg, 8, World(), steps, drawn=8)
    halved.of_step(0)  # the epoch drawn at 8, as a run that ran out of memory in its first step had it
    halved.halve()
    assert halved.micro == 4 and rows(halved) == expected
