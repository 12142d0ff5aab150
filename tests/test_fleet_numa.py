"""NUMA host tier (paged/fleet/numa.py): remote accesses counted by hand on tiny replays."""
import pytest

from paged.errors import ConfigError
from paged.fleet.numa import NumaNode, numa_study, replay

NODE = NumaNode((1, 1), block_bytes=10.0, local_bandwidth=10.0, remote_bandwidth=5.0)
REQS = [[0, 1], [0, 2]]   # request 1 shares block 0 with request 0


def test_interleave_by_hand():
    s = replay(NODE, "interleave", REQS)
    # r0 on GPU0/socket0: writes 0 -> s0 (local), 1 -> s1 (remote); r1 on GPU1/socket1: reads 0 (remote), 2 -> s0 (remote)
    assert (s.reads, s.writes, s.remote_reads, s.remote_writes) == (1, 3, 1, 2)
    assert s.transfer_s == pytest.approx(1 + 2 + 2 + 2)


def test_local_first_by_hand():
    s = replay(NODE, "local_first", REQS)
    assert (s.remote_reads, s.remote_writes) == (1, 0)
    assert s.transfer_s == pytest.approx(1 + 1 + 2 + 1) and s.remote_transfer_s == pytest.approx(2)


def test_affinity_follows_the_prefix():
    s = replay(NODE, "affinity", REQS)
    assert s.remote == 0 and s.gpu_requests == [2, 0]   # r1 goes to the socket holding block 0


def test_migration_moves_the_block_to_its_reader():
    s = replay(NODE, "migrate", REQS + [[0]])
    # r1 (GPU1) reads 0 remotely and pulls it to socket 1; r2 (GPU0) then reads it remotely again
    assert (s.remote_reads, s.migrated) == (2, 2)


def test_study_reductions_are_relative_to_interleave():
    df = numa_study(layout=(2, 2), num_requests=50, num_prefixes=4, prefix_blocks=4, own_blocks=2).set_index("policy")
    assert df.loc["interleave", "reduction_vs_interleave"] == 0.0
    assert df.loc["affinity", "remote_accesses"] == 0
    assert (df["accesses"] == df.loc["interleave", "accesses"]).all()


@pytest.mark.parametrize("kw", [dict(layout=()), dict(layout=(0, 0)), dict(layout=(2, -1)),
                                dict(remote_bandwidth=0.0)])
def test_bad_node(kw):
    with pytest.raises(ConfigError):
        NumaNode(**kw)


def test_unknown_policy_names_the_choices():
    with pytest.raises(ConfigError, match="local_first"):
        replay(NODE, "nearest", REQS)
