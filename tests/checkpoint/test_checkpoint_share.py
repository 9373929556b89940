"""How ranks split the files to verify when they checksum a checkpoint together
(``share`` in modelparallel/checkpoint/safety/checksums.py).

A failure means one rank reads (and fsyncs) far more than its part of the checkpoint while the
others wait at the collective after it, or a file is verified twice or not at all. The bounds are
derived from the file sizes given: the split is greedy (largest first to the least-loaded rank),
so when a rank received its last, smallest, balanced file its load was the least of all, and
each rank's final load less that file is at most every other rank's final load.
"""

import random

from modelparallel.checkpoint.safety.checksums import _DCP_DATA, share


def _split(sizes, world):
    shares = [share(sizes, r, world) for r in range(world)]
    owner = {f: r for r, files in enumerate(shares) for f in files}
    assert sum(map(len, shares)) == len(sizes) and set(owner) == set(sizes), "each file on exactly one rank"
    loads = [sum(sizes[f] for f in files) for files in shares]
    return shares, owner, loads


def _assert_fair(sizes, world):
    """Every rank that took a balanced file (not a DCP data file of a rank in this job) was the
    least loaded when it took its smallest one: its load less that file is at most each rank's."""
    shares, owner, loads = _split(sizes, world)
    pinned = {f for f in sizes if (m := _DCP_DATA.search(f)) and int(m.group(1)) < world}
    for f in pinned:
        assert owner[f] == int(_DCP_DATA.search(f).group(1)), f"{f} verified by the rank that wrote it"
    for r, files in enumerate(shares):
        balanced = [sizes[f] for f in files if f not in pinned]
        if balanced:
            assert loads[r] - min(balanced) <= min(loads), (r, loads, balanced)
    return shares, loads


def test_files_without_a_writer_are_spread_so_loads_differ_by_at_most_the_largest_file():
    rng = random.Random(7)
    for world in (2, 3, 4, 8):
        sizes = {f"user/file{i}.pt": rng.randrange(1, 10_000) for i in range(5 * world)}
        shares, loads = _assert_fair(sizes, world)
        # with nothing pinned the greedy split starts even: loads differ by at most one file
        assert max(loads) - min(loads) <= max(sizes.values()), (world, loads)
        assert all(shares), f"world {world}: a rank with no file while there are {len(sizes)}"


def test_equal_files_are_dealt_out_evenly():
    for world in (2, 3, 5):
        sizes = {f"shard{i}.bin": 4096 for i in range(2 * world + 1)}
        counts = sorted(len(f) for f in _split(sizes, world)[0])
        assert counts[-1] - counts[0] <= 1, (world, counts)


def test_balanced_files_fill_the_ranks_whose_own_dcp_files_are_smaller():
    """Rank 0 already holds the largest DCP file: the metadata and user content go elsewhere
    first, and every balanced file is placed on the then least-loaded rank."""
    sizes = {"model/__0_0.distcp": 9_000, "model/__1_0.distcp": 1_000, "model/__2_0.distcp": 2_000,
             "model/.metadata": 300, "optimizer/.metadata": 500, "user_content.pt": 2_500,
             "extra_state.pt": 700, "model/__7_0.distcp": 400}  # written by a rank this job lacks
    shares, loads = _assert_fair(sizes, 3)
    assert not set(shares[0]) - {"model/__0_0.distcp"}, "rank 0 is the most loaded by its own file alone"
    assert max(loads) == sizes["model/__0_0.distcp"]
