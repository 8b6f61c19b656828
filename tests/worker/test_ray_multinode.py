"""The Ray driver's rank numbering on a real multi-node Ray cluster (ray.cluster_utils: three
raylets on this host), which is what keeps a tensor-parallel group on one node."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, remove_placement_group

from rljob.api import RLJobSpec
from rljob_worker.driver.ray_driver import _bundles, _start_actors
from rljob_worker.engines.tensor_parallel import tensor_parallel_layout

pytestmark = pytest.mark.worker

NODES = 2
RANKS_PER_NODE = 2


@pytest.fixture(scope="module")
def two_node_cluster() -> Iterator[Cluster]:
    """A head without CPUs and two nodes of two CPUs: rank bundles can only land on the nodes."""
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False},
    )
    try:
        for _ in range(NODES):
            cluster.add_node(num_cpus=RANKS_PER_NODE, object_store_memory=80 * 2**20)
        cluster.wait_for_nodes()
        ray.init(
            address=cluster.address,
            namespace=f"rljob-test-{uuid.uuid4().hex[:8]}",
            log_to_driver=False,
        )
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _node_of(actor: Any) -> str:
    return str(
        ray.get(actor.__ray_call__.remote(lambda _self: ray.get_runtime_context().get_node_id()))
    )


def test_a_nodes_ranks_are_consecutive_so_each_tp_group_is_on_one_node(
    two_node_cluster: Cluster,
) -> None:
    spec = RLJobSpec.model_validate(
        {
            "rollout": {"engine": "torch"},
            "resources": {
                "workers": NODES,
                "gpusPerWorker": 0,
                "cpuRanksPerWorker": RANKS_PER_NODE,
            },
        }
    )
    group = placement_group(_bundles(spec), strategy="PACK", name="multinode-ranks")
    actors: list[Any] = []
    try:
        _located, init_method = _start_actors(spec, "multinode", group, actors, 120)
        nodes = [_node_of(actor) for actor in actors]
        assert len(nodes) == NODES * RANKS_PER_NODE
        assert len(set(nodes)) == NODES, f"ranks all on {set(nodes)}: the bundles did not spread"
        # Ranks 0,1 on one node, 2,3 on the other: node by node.
        assert nodes[0] == nodes[1] != nodes[2] == nodes[3]
        # So groups of two fit, and a group of four (two nodes) is refused.
        assert tensor_parallel_layout(2, nodes, 2).group == (2, 3)
        with pytest.raises(ValueError, match="spans nodes"):
            tensor_parallel_layout(0, nodes, 4)
        # The rendezvous is rank 0's node.
        assert init_method.startswith("tcp://")
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        remove_placement_group(group)
