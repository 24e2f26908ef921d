"""The projection's model of the parts: its byte counts equal what the engine sent, and a
plugin communicator's declared cost is what it projects with (or a refusal by name)."""

import pytest
from ranks import run_ranks
from test_aggregation import CASES, bytes_job
from test_declared_cost import plugin  # noqa: F401  (the fixture: a plugin communicator with a declared cost)

from grace_dgc import costmodel
from grace_dgc.communicators.auto import candidates
from grace_dgc.errors import GraceConfigError
from grace_survey.projection import project
from grace_survey.projection.project import counted_bytes

# -- the byte counts (from test_aggregation.py) --


@pytest.mark.parametrize("world", [2, 3, 4])
def test_projection_byte_counts_match_the_engine(world):
    outs = run_ranks(bytes_job, world, args=(CASES,))
    for comp, _, _, comm in CASES:
        for rank in range(world):
            payload, sent, received = outs[rank][(comp, comm)]
            model_sent, model_received = counted_bytes(comm, world, payload, 4_000_000)
            # size headers and uneven regions aside, the model is the engine's count
            assert sent == pytest.approx(model_sent, rel=0.05, abs=256), (comp, comm, rank)
            assert received == pytest.approx(model_received, rel=0.05, abs=256 * world), (comp, comm, rank)


# -- a declared cost (from test_declared_cost.py) --


def test_a_plugin_with_a_declared_cost_is_modelled_and_projected(plugin):  # noqa: F811 (the fixture)
    assert plugin in costmodel.modelled() and plugin in candidates()
    assert costmodel.cost(plugin, 16, 1e6, 4e6)[:2] == (1, 0.0)
    # grace-dgc project: its time is its own declaration, 3 exchanges × 1 step × α
    assert project.communication_time(plugin, 16, 1e6, 3, alpha=1e-3, beta=1e-9) == pytest.approx(3e-3)
    measured = {"label": "fp16", "compressor": "fp16", "communicator": "allreduce", "params": {}}
    rows = project.with_communicators([measured], [plugin])
    assert [r["communicator"] for r in rows] == ["allreduce", plugin]


def test_a_communicator_without_a_cost_is_refused_by_name():
    measured = {"label": "fp16", "compressor": "fp16", "communicator": "allreduce", "params": {}}
    with pytest.raises(GraceConfigError, match="no cost model for communicator 'hierarchical'"):
        project.with_communicators([measured], ["hierarchical"])
