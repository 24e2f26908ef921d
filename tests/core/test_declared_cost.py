"""Each communicator declares its own α-β cost (Communicator.cost), read by grace_dgc.costmodel,
the auto communicator and grace-dgc project alike; a plugin communicator that declares one takes
part in both, tested here with one (registered for the test only)."""

import math

import pytest
import torch
from ranks import run_ranks

import grace_dgc
from grace_dgc import costmodel
from grace_dgc.communicators.allreduce import Allreduce
from grace_dgc.errors import GraceConfigError
from grace_dgc.interfaces import Cost
from grace_dgc.registry import COMMUNICATORS

PLUGIN = "test_cheap_allreduce"


class CheapAllreduce(Allreduce):
    """An allreduce that claims one latency step and nothing on the wire: the cheapest of all."""

    @classmethod
    def cost(cls, nodes, nbytes, dense_bytes, **settings):
        return Cost(1, 0.0)


def register_plugin():
    COMMUNICATORS.register(PLUGIN)(CheapAllreduce)
    CheapAllreduce.__module__ = "a_plugin"  # defined outside grace_dgc, as a plugin's would be


@pytest.fixture
def plugin():
    register_plugin()
    yield PLUGIN
    del COMMUNICATORS._classes[PLUGIN]
    del COMMUNICATORS._aliases[PLUGIN]


@pytest.mark.parametrize("nodes", [2, 3, 8])
def test_the_built_ins_declare_the_documented_formulas(nodes):
    n, dense = 1000.0, 4000.0
    share = (nodes - 1) / nodes
    expected = {
        "allreduce": (2 * (nodes - 1), 2 * share * n),
        "allgather": (2 * (nodes - 1), (nodes - 1) * n),
        "broadcast": ((nodes - 1) + nodes * math.ceil(math.log2(nodes)), nodes * n),
        "sparse_allreduce": (4 * (nodes - 1), share * (n + min(nodes * n, dense))),
        "sparse_allreduce+global_topk": (4 * (nodes - 1) + 4 * 2 * (nodes - 1), 2 * share * n),
        "reduce_scatter": (4 * (nodes - 1), 2 * share * n),
    }
    assert set(costmodel.modelled()) == set(expected)  # hierarchical and auto declare none
    for name, (steps, wire) in expected.items():
        assert tuple(costmodel.cost(name, nodes, n, dense)[:2]) == pytest.approx((steps, wire)), name
    assert costmodel.cost("allgather", 1, n, dense)[:2] == (0, 0.0)
    with pytest.raises(GraceConfigError, match="no cost model for communicator 'hierarchical'.*modelled: "):
        costmodel.cost("hierarchical", 4, n, dense)


def auto_job(rank, world):
    register_plugin()  # this rank's registry, as a plugin's entry point would fill it
    grace = grace_dgc.build("fp16", "none", "auto", interval=2, bandwidth=1e3, latency=1e-4)
    outs = [grace.step(torch.full((1000,), float(rank + step)), "g").clone() for step in range(6)]
    return outs, grace.stats()["auto"]["g"]


def test_auto_tries_a_plugin_with_a_declared_cost_and_picks_it_when_cheapest():
    results = run_ranks(auto_job, 2)
    for outs, chosen in results:
        # at 1 kB/s the wire decides: the plugin's declared nothing-on-the-wire wins
        assert PLUGIN in chosen["predicted_seconds"] and chosen["choice"] == PLUGIN
        for step, out in enumerate(outs):  # and it averages as an allreduce does
            assert torch.equal(out, torch.full((1000,), step + 0.5, dtype=torch.float32))


def mismatch_job(rank, world):
    if rank == 1:
        register_plugin()  # only this rank loaded the plugin
    try:
        grace_dgc.build("fp16", "none", "auto", interval=2, bandwidth=1e3, latency=1e-4)
    except GraceConfigError as error:
        return str(error)
    return "built"


def test_ranks_with_other_plugins_are_refused_by_name():
    """auto's candidates are the code of its broadcast plans: the ranks compare them first."""
    for message in run_ranks(mismatch_job, 2, timeout=120):
        assert "candidates" in message and PLUGIN in message, message
