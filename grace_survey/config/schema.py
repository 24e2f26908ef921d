"""The survey config's schema: every key a config may hold, its types and meaning (the error
for an unknown key lists them), and the small checks shared by the loader."""

from collections.abc import Mapping
from typing import Any

from grace_dgc.errors import GraceConfigError, closest

# key -> (accepted types, description); None means "optional, no default here"
Schema = dict[str, tuple[tuple[type, ...], str]]
TOP_LEVEL: Schema = {
    "name": ((str,), "a name for the survey, shown in the report"),
    "description": ((str,), "free text, shown in the report"),
    "workload": (
        (str,),
        "workload name (grace-dgc list workloads), or your own as 'package.module:factory' / 'file.py:factory'",
    ),
    "script": (
        (str,),
        "script mode: your training script (path relative to this file), run once per cell instead of a workload",
    ),
    "script_args": ((list,), "script mode: command-line arguments for the script (strings)"),
    "launcher": (
        (str,),
        "script mode: 'local' (default: the survey starts the ranks) or a command prefix that starts every rank of "
        "a cell, e.g. 'horovodrun -np {workers} -H a:2,b:2' or 'torchrun --nproc-per-node {workers}'",
    ),
    "workload_options": ((dict,), "extra get_workload options, e.g. {num_samples = 2000}"),
    "data_dir": ((str,), "directory with dataset files (never downloaded)"),
    "data_seed": ((int,), "seed of the generated dataset instance (same for every cell)"),
    "workers": ((int, list), "ranks per run: an int or a list (a grid dimension)"),
    "seeds": ((list,), "run seeds (model init + data order), e.g. [0, 1, 2]"),
    "repeats": ((int,), "shorthand for seeds = [0 .. repeats-1]"),
    "epochs": ((int,), "epochs per run (default: the workload's)"),
    "batch_size": ((int,), "batch size per worker (default: the workload's)"),
    "lr": ((int, float), "learning rate (default: the workload's)"),
    "optimizer": ((str,), "'sgd' or 'adamw' (default: the workload's)"),
    "momentum": ((int, float), "SGD momentum (default: the workload's)"),
    "betas": ((list,), "AdamW's betas, e.g. [0.9, 0.99] (default: the workload's)"),
    "weight_decay": ((int, float), "SGD weight decay, or AdamW's decoupled one (default: the workload's)"),
    "lr_schedule": ((str,), "'step' (lr_milestones) or 'cosine' (to lr/10 over the run) (default: the workload's)"),
    "warmup_steps": ((int,), "linear lr warm-up over the first steps (default: the workload's)"),
    "target_accuracy": ((int, float), "accuracy for time/epochs-to-target (default: the workload's)"),
    "lr_milestones": ((list,), "epochs after which lr *= lr_gamma (default: the workload's)"),
    "lr_gamma": ((int, float), "lr decay factor at milestones"),
    "grad_clip": ((int, float), "clip the averaged gradient's global norm to this"),
    "max_steps": ((int,), "at most this many optimizer steps per epoch (0 = the whole epoch)"),
    "tune_epochs": ((int,), "epochs of each lr-tuning run (default max(1, epochs // 4))"),
    "tune_holdout": ((int, float), "fraction of train held out to score lr candidates (default 0.1)"),
    "eval_batch_size": ((int,), "batch size for evaluation (default 1000)"),
    "device": ((str,), "auto, cpu or cuda"),
    "backend": ((str,), "auto, gloo or nccl"),
    "tensorboard": (
        (bool,),
        "log per-step and per-epoch scalars to DIR/tensorboard/<run> (needs the tensorboard extra)",
    ),
    "timing_skip_steps": ((int,), "first steps of a run left out of the timing means (default 1)"),
    "timeout": ((int, float), "seconds one run may take before it is killed (default 86400)"),
    "networks": ((list,), 'network conditions, e.g. [{}, {bandwidth = "1gbit", latency = 0.1}]'),
    "faults": (
        (list,),
        "replica groups lost and taken back under torchft, for every method: "
        "[{group = 1, at_step = 20, back_after_steps = 10}] (each method also runs under torchft without a fault)",
    ),
    "methods": ((list,), "the methods: [[methods]] tables"),
}
METHOD_KEYS: Schema = {
    "label": ((str,), "the method's name in tables and plots (unique)"),
    "compressor": (
        (str,),
        "registered compressor (grace_dgc.list_compressors()), or your own class as 'package.module:Class' or "
        "'path/to/file.py:Class' (relative to the config's folder)",
    ),
    "memory": ((str,), "registered memory (default none), or your own class as a compressor's"),
    "communicator": (
        (str,),
        "registered communicator (default: allreduce if the compressor's payloads are summable, else allgather), "
        "or your own class as a compressor's",
    ),
    "params": ((dict,), "parameters for grace_dgc.build, e.g. {compress_ratio = 0.01}"),
    "fusion_bytes": (
        (int,),
        "DistributedOptimizer's fusion bucket size in bytes of gradient (default 4 MiB; 0: one bucket per parameter)",
    ),
    "lr": ((int, float), "this method's learning rate (overrides the survey's)"),
    "momentum": ((int, float), "this method's SGD momentum"),
    "weight_decay": ((int, float), "this method's SGD weight decay"),
    "tune_lr": ((list,), "lr candidates: the best on a held-out split is used (and reported)"),
    "tags": ((dict,), "free-form values carried into the results (e.g. kpercent = 1 for the seed000 table)"),
    "schedule": (
        (dict,),
        "a synchronization schedule instead of a step-by-step exchange (grace_dgc.schedules), e.g. "
        '{name = "diloco", inner_steps = 10}: the method\'s Grace then carries the outer gradient',
    ),
    "faults": ((list,), "this method's faults, instead of the survey's (see faults above; [] for none)"),
}
FAULT_KEYS: Schema = {
    "group": ((int,), "the replica group that dies (1 .. workers - 1: group 0 records the run)"),
    "at_step": ((int,), "the job's step at which it dies"),
    "back_after_steps": ((int,), "steps the others take without it before it is started again"),
    "inside_exchange": ((bool,), "die inside its next exchange instead of between steps (default false)"),
}
NETWORK_KEYS: Schema = {
    "bandwidth": ((str, int, float), 'rate of the shaped loopback, e.g. "1gbit"'),
    "latency": ((str, int, float), "one-way delay in milliseconds added to every packet"),
}
# forwarded to get_workload as hyper-parameter overrides
WORKLOAD_HYPER = (
    "epochs",
    "batch_size",
    "lr",
    "optimizer",
    "momentum",
    "betas",
    "weight_decay",
    "lr_schedule",
    "warmup_steps",
    "target_accuracy",
    "lr_milestones",
    "lr_gamma",
    "grad_clip",
)
DEFAULTS: dict[str, Any] = {
    "data_seed": 0,
    "workers": 2,
    "max_steps": 0,
    "tune_epochs": 0,
    "tune_holdout": 0.1,
    "eval_batch_size": 1000,
    "device": "auto",
    "backend": "auto",
    "timing_skip_steps": 1,
    "tensorboard": False,
    "timeout": 86400,
}


def _check_keys(table: Mapping[str, Any], accepted: Schema, where: str) -> None:
    unknown = sorted(set(table) - set(accepted))
    if unknown:
        hints = []
        for key in unknown:
            close = closest(key, accepted)
            if close:
                hints.append(f"did you mean {close!r} for {key!r}?")
        hint = f" ({' '.join(hints)})" if hints else ""
        raise GraceConfigError(
            f"unknown key(s) {', '.join(map(repr, unknown))} in {where}{hint}; "
            f"accepted: {', '.join(accepted)} (each is described in docs/survey.md)"
        )
    for key, value in table.items():
        types = accepted[key][0]
        if isinstance(value, bool) != (bool in types) or not isinstance(value, types):
            names = " or ".join("table" if t is dict else "list" if t is list else t.__name__ for t in types)
            article = "an" if names[0] in "aeiou" else "a"
            raise GraceConfigError(f"{where}: {key} = {value!r} must be {article} {names}")


MAX_WORKERS = 1 << 16  # ranks in one survey cell: far beyond any cluster it would launch


def _positive_int(value: Any, key: str, low: int = 1, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        most = "" if high is None else f" and <= {high}"
        raise GraceConfigError(f"{key} = {value!r} must be an int >= {low}{most}")
    return value
