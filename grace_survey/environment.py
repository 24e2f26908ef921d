"""The environment variables the survey reads beside the library's own
(:data:`grace_dgc.environment.VARIABLES`): what each means."""

from __future__ import annotations

VARIABLES = {
    "RANK": "torchrun's rank: the survey runner's launcher detection, and a script's rank",
    "HOROVOD_RANK": "horovodrun's rank: the survey runner's launcher detection, and a script's rank",
    "HOROVOD_HOSTNAME": "set by horovodrun: the survey runner's launcher detection",
    "GRACE_DGC_NETEM": "the link shaping a survey worker runs under (JSON, set by the survey itself)",
}
