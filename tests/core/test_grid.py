import pytest

from proxies.core.grid import ProcessGrid


def test_megatron_order_matches_docstring_example():
    g = ProcessGrid.create("tp-dp-pp", pp=2, dp=2, tp=2)
    assert [g.coords(r)["tp"] for r in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert [g.coords(r)["dp"] for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [g.coords(r)["pp"] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert sorted(g.groups("dp")) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert g.group("pp", 5) == (1, 5)


def test_cpp_order_puts_consecutive_ranks_on_consecutive_stages():
    g = ProcessGrid.create("cpp", pp=8, dp=4)
    assert g.order == "pp-dp"
    assert all(g.coords(r)["pp"] == r % 8 for r in range(32))
    assert g.group("pp", 9) == tuple(range(8, 16))
    assert g.group("dp", 9) == (1, 9, 17, 25)


@pytest.mark.parametrize("order", ["pp-dp", "dp-pp", "megatron", "cpp"])
def test_groups_partition_the_world(order):
    g = ProcessGrid.create(order, pp=3, dp=4)
    for dim in ("pp", "dp"):
        members = sorted(r for grp in g.groups(dim) for r in grp)
        assert members == list(range(12))
        for grp in g.groups(dim):
            assert [g.coords(r)[dim] for r in grp] == list(range(g.degree(dim)))
            assert all(g.group(dim, r) == grp for r in grp)
    for r in range(12):
        assert g.rank_of(**g.coords(r)) == r


def test_bad_orders_and_degrees_are_rejected():
    with pytest.raises(ValueError, match="rank order"):
        ProcessGrid.create("pp-xx", pp=2, dp=2)
    with pytest.raises(ValueError, match="rank order"):
        ProcessGrid.create("pp-pp", pp=2, dp=2)
    with pytest.raises(ValueError, match="positive"):
        ProcessGrid.create(pp=0, dp=2)
