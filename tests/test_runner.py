"""ModelRunner's layer groups: how a forward splits while loads are landing."""

from __future__ import annotations

import pytest

from jhicache.runner import layer_groups


@pytest.mark.parametrize("num_layers,sizes", [
    (1, [1]), (2, [1, 1]), (3, [1, 2]), (7, [1, 2, 4]), (24, [1, 2, 4, 4, 4, 4, 4, 1]),
    (28, [1, 2, 4, 4, 4, 4, 4, 4, 1]), (80, [1, 2] + [4] * 19 + [1]),
])
def test_layer_groups_cover_each_layer_once_in_growing_groups(num_layers: int,
                                                              sizes: list[int]) -> None:
    groups = layer_groups(num_layers)
    assert [i for g in groups for i in g] == list(range(num_layers))
    assert [len(g) for g in groups] == sizes


def test_layer_groups_largest() -> None:
    assert [len(g) for g in layer_groups(10, largest=2)] == [1, 2, 2, 2, 2, 1]
