"""Pure neighbour functions of linkwise.plan, for every size from 1 to 64."""
import pytest

from linkwise.plan import chain_parent_children, default_schedule, ring_peers, tree_parent_children


@pytest.mark.parametrize("n", range(1, 65))
def test_ring_peers(n):
    orders = [list(range(n)), list(range(n))[::-1], [(i * 7) % n for i in range(n)] if n % 7 else list(range(n))]
    for order in orders:
        rights = {}
        for r in range(n):
            left, right = ring_peers(order, r)
            assert ring_peers(order, right)[0] == r and ring_peers(order, left)[1] == r
            rights[r] = right
        # following `right` from 0 visits every rank exactly once before coming back
        seen, r = [], order[0]
        for _ in range(n):
            seen.append(r)
            r = rights[r]
        assert r == order[0] and sorted(seen) == list(range(n)) and seen == list(order)


@pytest.mark.parametrize("n", range(1, 65))
def test_binomial_tree(n):
    for root in sorted({0, n - 1, n // 3}):
        parents = {}
        kids = {}
        for r in range(n):
            p, ch = tree_parent_children(n, r, root)
            parents[r], kids[r] = p, ch
            assert len(set(ch)) == len(ch) and r not in ch
        assert parents[root] == -1
        assert sum(p == -1 for p in parents.values()) == 1
        for r in range(n):  # parent and children agree
            for c in kids[r]:
                assert parents[c] == r
            if parents[r] != -1:
                assert r in kids[parents[r]]
        depth = {}
        for r in range(n):  # every rank reaches the root; depth <= ceil(log2 n)
            d, x = 0, r
            while parents[x] != -1:
                x, d = parents[x], d + 1
                assert d <= n
            assert x == root
            depth[r] = d
        assert max(depth.values()) <= max(0, (n - 1).bit_length())


@pytest.mark.parametrize("n", range(1, 65))
def test_chain(n):
    order = [(i + n // 2) % n for i in range(n)]
    for i, r in enumerate(order):
        p, ch = chain_parent_children(order, r)
        assert p == (order[i - 1] if i else -1)
        assert ch == ([order[i + 1]] if i + 1 < n else [])
    # broadcast/reduce schedules with algorithm chain start at the root
    for r in range(n):
        s = default_schedule("broadcast", n, r, root=n - 1, nbytes=1 << 20, algo="chain")
        assert s.chain_order[0] == n - 1 and sorted(s.chain_order) == list(range(n))


def test_default_choices():
    assert default_schedule("all_reduce", 2, 0, 0, 8).algorithm == "direct"
    assert default_schedule("all_reduce", 8, 0, 0, 64 << 10).algorithm == "tree"
    assert default_schedule("all_reduce", 8, 0, 0, 1 << 20).algorithm == "ring"
    assert default_schedule("all_reduce", 8, 0, 0, 8, algo="ring").algorithm == "ring"
    assert default_schedule("broadcast", 8, 0, 0, 8).algorithm == "tree"
    assert default_schedule("broadcast", 8, 0, 0, 1 << 20).algorithm == "chain"
    s = default_schedule("broadcast", 4, 2, 2, 8, algo="direct")
    assert s.parent == -1 and s.children == (0, 1, 3)
