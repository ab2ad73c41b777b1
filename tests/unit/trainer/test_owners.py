"""Which rank writes which whole tensor of a full policy version."""

from __future__ import annotations

from engine.trainer.owners import assign_owners


def test_every_tensor_has_one_owner_and_the_ranks_share_the_bytes() -> None:
    sizes = {f"layer{i}": size for i, size in enumerate([900, 500, 400, 300, 300, 100, 100])}
    owners = assign_owners(sizes, 3)
    assert set(owners) == set(sizes) and set(owners.values()) == {0, 1, 2}
    load = [sum(sizes[n] for n, r in owners.items() if r == rank) for rank in range(3)]
    assert max(load) - min(load) <= max(sizes.values()) - min(sizes.values())
    assert load == [900, 900, 800]
    assert assign_owners(dict(reversed(sizes.items())), 3) == owners  # order-independent


def test_one_rank_owns_everything() -> None:
    assert set(assign_owners({"a": 1, "b": 2}, 1).values()) == {0}
