"""One run of a survey grid (a *cell*: method × workers × seed × network, or × fault under torchft) and its
fingerprints."""

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

# not part of what makes a run's result: left out of the fingerprints
_UNHASHED = ("run_id", "cell_hash", "tuning_key", "cache_dir", "tensorboard_dir", "survey", "launcher")


@dataclasses.dataclass
class Cell:
    """Everything a rank needs to train one run, picklable for the spawned ranks.

    ``cell_hash`` fingerprints what changes the result (resume skips a finished run only if
    it matches); ``tuning_key`` is the same without the seed (lr tuning is shared by the
    seeds of a method). Also readable as a mapping (``cell["workers"]``), as results code
    and earlier scripts read it.
    """

    survey: str
    label: str
    method: dict[str, Any]  # compressor, memory, communicator, params, tags
    tune_lr: list[float] | None
    workers: int
    seed: int
    network: dict[str, Any]  # Network.to_dict(): bandwidth_bps, latency_ms, tag
    workload: str
    workload_options: dict[str, Any]
    hyper: dict[str, Any]
    data_dir: str | None
    data_seed: int
    max_steps: int
    tune_epochs: int
    tune_holdout: float
    eval_batch_size: int
    timing_skip_steps: int
    device: str
    backend: str
    cache_dir: str | None = None  # where a run keeps generated data (not hashed)
    tensorboard_dir: str | None = None  # where rank 0 logs scalars, if asked (not hashed)
    script: str | None = None  # script mode: the user's training script (absolute path) instead of a workload
    script_args: list[str] = dataclasses.field(default_factory=list)
    script_sha: str = ""  # the script's content: an edited script is a different run
    launcher: str = "local"  # script mode: how its ranks start (not hashed)
    # under torchft (grace_survey.running.faults): {"tag": "torchft"} without a fault, else the fault's
    # group, at_step, back_after_steps, inside_exchange and tag; None for every other run (then not hashed)
    fault: dict[str, Any] | None = None
    run_id: str = ""
    cell_hash: str = ""
    tuning_key: str = ""

    def __post_init__(self) -> None:
        self.run_id = run_id(self.label, self.workers, self.seed, self.network["tag"])
        if self.fault is not None:
            self.run_id += f" [{self.fault['tag']}]"
        self.cell_hash = fingerprint(self.as_dict())
        self.tuning_key = fingerprint(self.as_dict(), "seed")

    def record_head(self, attempt: str) -> dict[str, Any]:
        """The fields every results.jsonl line of one attempt at this run starts with."""
        return {
            "run_id": self.run_id,
            "attempt": attempt,
            "label": self.label,
            "workers": self.workers,
            "seed": self.seed,
            # a run under torchft is its own group in the report, beside the same network's others
            "network": self.network["tag"] + ("" if self.fault is None else f" [{self.fault['tag']}]"),
        }

    def summary_fields(self) -> dict[str, Any]:
        """What a summary line says of the cell itself: its method, network and fingerprint."""
        return {
            "cell_hash": self.cell_hash,
            "survey": self.survey,
            **{key: self.method[key] for key in ("compressor", "memory", "communicator", "params", "tags")},
            "schedule": self.method.get("schedule"),  # what `grace-dgc project` models the overlap of
            "bandwidth_bps": self.network["bandwidth_bps"],
            "latency_ms": self.network["latency_ms"],
            **({} if self.fault is None else {"fault": self.fault["tag"]}),
        }

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


def run_id(label: str, workers: int, seed: int, network_tag: str = "local") -> str:
    rid = f"{label} w{workers} s{seed}"
    return rid if network_tag == "local" else f"{rid} @{network_tag}"


def fingerprint(cell: Mapping[str, Any], *also_without: str) -> str:
    """12 hex digits of SHA-1 over the cell's result-changing fields (minus ``also_without``).
    The target accuracy is not one: training never reads it, and the report measures the
    time to any target from the epoch records (``grace-dgc report --target``)."""
    keep = {k: v for k, v in dict(cell).items() if k not in _UNHASHED + also_without}
    if keep.get("fault", ...) is None:  # not a run under torchft: its fingerprint as before faults existed
        del keep["fault"]
    if isinstance(keep.get("hyper"), Mapping):
        keep["hyper"] = {k: v for k, v in keep["hyper"].items() if k != "target_accuracy"}
    return hashlib.sha1(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:12]


def cell_hash(cell: Mapping[str, Any]) -> str:
    return fingerprint(cell)


def tuning_key(cell: Mapping[str, Any]) -> str:
    return fingerprint(cell, "seed")
