"""Which layers form which pipeline stage, and which rank runs which stage (pure functions of sizes)."""

from __future__ import annotations

from collections.abc import Sequence


def partition_layers(sizes: Sequence[int], num_stages: int, split_points: Sequence[int] | None = None) -> list[range]:
    """Contiguous layer ranges, one per stage.

    ``split_points``: indices of the layers that start stages 1..num_stages-1 (explicit split). Otherwise the
    stages are balanced by ``sizes`` (e.g. parameter counts): the split minimising the largest stage.
    """
    n = len(sizes)
    if num_stages > n:
        raise ValueError(f"{num_stages} pipeline stages need at least {num_stages} layers; the model has {n}.")
    if split_points is not None:
        points = list(split_points)
        if len(points) != num_stages - 1 or points != sorted(set(points)) or not all(0 < p < n for p in points):
            raise ValueError(
                f"split_points={points} is invalid: give {num_stages - 1} increasing layer indices in 1..{n - 1}."
            )
        bounds = [0, *points, n]
        return [range(bounds[i], bounds[i + 1]) for i in range(num_stages)]
    # Minimise the largest stage (dynamic programming over prefix sums). For each stage count and end the last
    # stage's start is the smallest one of least cost; scanning the starts from the right, the last stage only
    # grows, so once it alone exceeds the best cost no start further left can do better (the same split as
    # trying every start, in about n^2 steps instead of n^2 x stages).
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        before, row, cuts = best[s - 1], best[s], cut[s]
        for end in range(s, n + 1):
            least, where = inf, 0
            for start in range(end - 1, s - 2, -1):
                last = prefix[end] - prefix[start]
                if last > least:
                    break
                cost = before[start] if before[start] > last else last
                if cost <= least:
                    least, where = cost, start
            row[end], cuts[end] = least, where
    ranges, end = [], n
    for s in range(num_stages, 0, -1):
        start = cut[s][end]
        ranges.append(range(start, end))
        end = start
    return ranges[::-1]


def stage_ranks(num_stages: int, pp: int, style: str) -> list[int]:
    """The pipeline rank of each stage: ``"loop"`` (stage s on rank s % pp) or ``"v"`` (zero-bubble V shape:
    rank r holds stages r and 2*pp-1-r)."""
    if style == "v":
        return [s if s < pp else 2 * pp - 1 - s for s in range(num_stages)]
    return [s % pp for s in range(num_stages)]
