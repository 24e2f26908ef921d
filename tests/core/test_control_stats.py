"""The ranks' agreements around the payloads (handshakes, non-finite flags) are counted in
``grace.stats()`` as control_* (issue 41: they ran outside every counted phase), apart from the
payloads' bytes_sent, which stays what the wire format says."""

import torch
from ranks import run_ranks

import grace_dgc


def job(rank, world):
    grace = grace_dgc.build("topk", "residual", "allgather", compress_ratio=0.1)
    seen = []
    for step in range(3):
        grace.step(torch.randn(100, generator=torch.Generator().manual_seed(step + 10 * rank)), "w")
        stats = grace.stats()
        seen.append({k: stats[k] for k in ("bytes_sent", "control_bytes_sent", "control_bytes_received")})
    return seen, grace.stats()["control_seconds"]


def test_handshakes_and_flags_are_counted_apart_from_the_payloads():
    for seen, seconds in run_ranks(job, 2):
        first, second, third = seen
        # the payload: per step an int64 size header per payload tensor (values, indices) and
        # k = 10 fp32 values + 10 int32 indices
        assert second["bytes_sent"] - first["bytes_sent"] == 2 * 8 + 10 * (4 + 4)
        # the first step carried the handshakes as well as its flag; each later one a flag
        # alone (one fp32 per rank, gathered): 4 bytes out, 4 from the other rank
        flag = second["control_bytes_sent"] - first["control_bytes_sent"]
        assert flag == third["control_bytes_sent"] - second["control_bytes_sent"] == 4
        assert third["control_bytes_received"] - second["control_bytes_received"] == 4
        assert first["control_bytes_sent"] > flag and seconds > 0
