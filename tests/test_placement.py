import re

import pytest

from raytrain.contracts.jobdir import NODE_ID_LABEL
from raytrain.errors import UserError
from raytrain.service.cluster import NodeInfo
from raytrain.service.config import ScaleConfig
from raytrain.service.placement import make_plan
from tests.conftest import golden


def node(i: int, *, cpus: float = 16, gpus: int = 0, driver: bool = False) -> NodeInfo:
    return NodeInfo(node_id=f"id{i}", hostname=f"node{i}", ip=f"10.0.0.{i}", cpus=cpus, gpus=gpus, is_driver=driver)


def test_gpu_plan_is_pinned_by_golden_file() -> None:
    # node10 sorts after node2 and the driver's node comes first, whatever order Ray lists them in.
    nodes = [node(10, gpus=4), node(2, gpus=4), node(1, gpus=4, driver=True)]
    plan = make_plan(nodes, ScaleConfig(workers=10, device="auto"))
    golden("plan_3nodes_12gpus_10workers.txt", plan.render() + "\n")


def test_gpu_default_uses_every_gpu_one_worker_each() -> None:
    plan = make_plan([node(1, gpus=2, driver=True), node(2, gpus=2)], ScaleConfig())
    assert plan.use_gpu and plan.backend == "nccl" and plan.workers == 4
    assert [(s.node.hostname, s.device) for s in plan.slots] == [
        ("node1", "cuda:0"),
        ("node1", "cuda:1"),
        ("node2", "cuda:0"),
        ("node2", "cuda:1"),
    ]
    assert plan.resources_per_worker() == {"CPU": 1.0, "GPU": 1.0}
    assert plan.label_selectors() == [{NODE_ID_LABEL: n} for n in ("id1", "id1", "id2", "id2")]


def test_more_gpu_workers_than_gpus_says_how_many_fit() -> None:
    with pytest.raises(UserError, match=r"--workers 5 needs 5 GPUs but the cluster has 4 .*use --workers 4 or fewer"):
        make_plan([node(1, gpus=2), node(2, gpus=2)], ScaleConfig(workers=5))


def test_gpu_forced_without_gpus() -> None:
    with pytest.raises(UserError, match="--device gpu but none of the 1 node"):
        make_plan([node(1)], ScaleConfig(device="gpu"))


def test_cpu_plan_spreads_over_nodes_and_leaves_a_cpu_for_data() -> None:
    plan = make_plan([node(1, cpus=4, driver=True), node(2, cpus=4), node(3, cpus=4)], ScaleConfig())
    assert not plan.use_gpu and plan.backend == "gloo"
    assert [s.node.hostname for s in plan.slots] == ["node1", "node2", "node3"]
    assert plan.cpus_per_worker == 3


def test_cpu_plan_on_two_cores_shares_them() -> None:
    plan = make_plan([node(1, cpus=2, driver=True)], ScaleConfig(workers=2))
    assert plan.cpus_per_worker == 0.5 and plan.workers == 2
    assert plan.label_selectors() is None


def test_more_cpu_workers_than_cpus() -> None:
    with pytest.raises(UserError, match="--workers 64 asks for 64 CPU workers but the cluster has 2 CPUs"):
        make_plan([node(1, cpus=2)], ScaleConfig(workers=64, device="cpu"))


def test_cpu_workers_asked_to_take_part_of_a_cpu_may_outnumber_the_cpus() -> None:
    plan = make_plan([node(1, cpus=2)], ScaleConfig(workers=3, device="cpu", cpus_per_worker=0.5))
    assert plan.workers == 3 and plan.cpus_per_worker == 0.5
    wanted = "--workers 5 asks for 5 CPU workers of 0.5 CPUs each but the cluster has 2 CPUs: use --workers 4"
    with pytest.raises(UserError, match=re.escape(wanted)):
        make_plan([node(1, cpus=2)], ScaleConfig(workers=5, device="cpu", cpus_per_worker=0.5))


def test_workers_that_leave_no_cpu_for_data() -> None:
    with pytest.raises(UserError, match="leave none for data loading"):
        make_plan([node(1, cpus=2, gpus=2)], ScaleConfig(cpus_per_worker=1))


def test_a_plan_that_leaves_no_node_a_whole_cpu_is_refused_for_streamed_data() -> None:
    # Ray Data's tasks take a whole CPU each: 2 workers x 0.75 of a 2-CPU node leave half of one.
    tight = make_plan([node(1, cpus=2)], ScaleConfig(workers=2, device="cpu", cpus_per_worker=0.75))
    assert tight.spare_cpus() == 0.5
    with pytest.raises(
        UserError, match=r"^the data streams through Ray Data, .* leave at most 0\.5 CPUs free on a node"
    ):
        tight.check_data_cpus("the data streams")
    roomy = make_plan([node(1, cpus=2), node(2, cpus=3)], ScaleConfig(workers=2, device="cpu", cpus_per_worker=2))
    assert roomy.spare_cpus() == 1.0  # one node full, the other with a whole CPU: Ray Data's tasks run there
    roomy.check_data_cpus("the data streams")
    assert roomy.data_cpus() == 1  # what sizes the streamed tasks' draws (pipeline.draw_size)
    one = make_plan([node(1, cpus=4), node(2, cpus=4)], ScaleConfig(workers=1, device="cpu", cpus_per_worker=4))
    assert one.spare_cpus() == 4.0  # the node without a worker is Ray Data's to use
    one.check_data_cpus("the data streams")
    assert one.data_cpus() == 4
    elastic = make_plan(  # it moves onto the idle node when it loses one: that node is not the reads' to count on
        [node(1, cpus=4), node(2, cpus=4)], ScaleConfig(workers=1, min_workers=1, device="cpu", cpus_per_worker=4)
    )
    with pytest.raises(UserError, match=r"leave at most 0 CPUs free"):
        elastic.check_data_cpus("the data streams")
    gpu = make_plan([node(1, cpus=1.5, gpus=1)], ScaleConfig(device="gpu", cpus_per_worker=1))
    with pytest.raises(UserError, match=r"leave at most 0\.5 CPUs free"):  # GPU plans too: the same wait
        gpu.check_data_cpus("the data streams")
    packed = make_plan([node(1, cpus=1.5, gpus=1), node(2, cpus=8)], ScaleConfig(device="gpu", cpus_per_worker=1))
    assert packed.idle_cpus == 8.0  # node2 has no GPU, so no worker: its CPUs read the data
    packed.check_data_cpus("the data streams")
    assert packed.data_cpus() == 8  # node1's half a CPU is not a whole one
