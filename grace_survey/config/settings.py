"""Survey grid configuration: TOML files (stdlib ``tomllib``) and the built-in presets.

A config names one workload and a list of methods; the grid is every
(method × workers × seed × network) cell. See ``benchmarks/configs/example.toml`` for a
commented example of every key. Loading validates everything up front — unknown keys,
wrong types, bad values and method names or parameters that ``grace_dgc.build`` would
reject — so a typo fails in a second, not after an hour of training.
"""

import copy
import hashlib
import json
import math
import os
import tomllib
from collections.abc import Mapping
from typing import Any, Self

from grace_dgc.engines.local import PlanEngine
from grace_dgc.errors import GraceConfigError
from grace_dgc.registry import Registry
from grace_survey.config.cell import Cell, cell_hash, run_id, tuning_key  # noqa: F401  (cell_hash, run_id, tuning_key: API)
from grace_survey.config.presets import KPERCENTS, PRESET_ALIASES, PRESETS, preset_dict, preset_name  # noqa: F401
from grace_survey.config.schema import (
    DEFAULTS,
    FAULT_KEYS,
    MAX_WORKERS,
    METHOD_KEYS,
    NETWORK_KEYS,
    TOP_LEVEL,
    WORKLOAD_HYPER,
    _check_keys,
    _positive_int,
)
from grace_survey.units import format_rate, parse_latency, parse_rate


class Network:
    """A network condition: unshaped (``Network()``) or a shaped loopback."""

    def __init__(self, bandwidth: str | float | None = None, latency: str | float | None = None) -> None:
        self.bandwidth_bps: float | None = None if bandwidth in (None, "", 0) else parse_rate(bandwidth)
        self.latency_ms: float = 0.0 if latency in (None, "") else parse_latency(latency)

    @property
    def shaped(self) -> bool:
        return self.bandwidth_bps is not None or self.latency_ms > 0

    @property
    def tag(self) -> str:
        if not self.shaped:
            return "local"
        parts = [format_rate(self.bandwidth_bps)] if self.bandwidth_bps else []
        if self.latency_ms:
            parts.append(f"{self.latency_ms:g}ms")
        return "-".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"bandwidth_bps": self.bandwidth_bps, "latency_ms": self.latency_ms, "tag": self.tag}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Self:
        net = cls()
        net.bandwidth_bps, net.latency_ms = d.get("bandwidth_bps"), float(d.get("latency_ms") or 0.0)
        return net


class SurveyConfig:
    """A validated survey grid. ``raw`` is the config as given (a dict, as from TOML)."""

    def __init__(self, raw: Any, source: str = "<config>") -> None:
        if not isinstance(raw, dict):
            raise GraceConfigError(f"{source}: a config is a table of keys, got {type(raw).__name__}")
        raw = copy.deepcopy(raw)
        _check_keys(raw, TOP_LEVEL, source)
        self.source = source
        self.raw = raw
        self.base_dir = os.path.dirname(os.path.abspath(source)) if os.path.isfile(source) else os.getcwd()
        self._what_runs(raw)
        self.name: str = raw.get("name", os.path.splitext(os.path.basename(source))[0] or "survey")
        self.description: str = raw.get("description", "")
        self.workload_options: dict[str, Any] = dict(raw.get("workload_options", {}))
        self.hyper: dict[str, Any] = {k: raw[k] for k in WORKLOAD_HYPER if k in raw}
        self.data_dir: str | None = raw.get("data_dir") or None
        settings = dict(DEFAULTS, **{k: raw[k] for k in DEFAULTS if k in raw})
        self.data_seed = _positive_int(settings["data_seed"], "data_seed", 0)
        self._workers_and_seeds(raw, settings)
        self._run_settings(settings)
        self._check_hyper()
        self.networks = self._networks(raw.get("networks", [{}]))
        self.faults = self._faults(raw.get("faults", []), "faults")
        self.methods = self._methods(raw.get("methods"))

    def _what_runs(self, raw: dict[str, Any]) -> None:
        """The script (script mode) and its launcher, or the workload: ``self.script``,
        ``script_args``, ``script_sha``, ``launcher`` and ``workload``."""
        self.script, self.script_args, self.script_sha = self._script(raw)
        self.launcher: str = raw.get("launcher", "local")
        if self.script is not None:
            from grace_survey.script.supervisor import check_launcher

            check_launcher(self.launcher)
            _check_script_mode(raw, self.source)
            self.workload = f"script:{os.path.basename(self.script)}"
        elif "launcher" in raw or "script_args" in raw:
            raise GraceConfigError(
                f"{self.source}: launcher and script_args belong to script mode; give script = 'train.py' "
                "(or --script) or remove them"
            )
        else:
            self.workload = self._workload(raw)

    def _workers_and_seeds(self, raw: dict[str, Any], settings: dict[str, Any]) -> None:
        """The grid's world sizes and seeds: ``self.workers`` and ``self.seeds``."""
        workers = settings["workers"]
        counts = workers if isinstance(workers, list) else [workers]
        self.workers = [_positive_int(w, "workers", high=MAX_WORKERS) for w in counts]
        if not self.workers:
            raise GraceConfigError("workers = [] is empty; give at least one worker count")
        if "seeds" in raw and "repeats" in raw and len(raw["seeds"]) != raw["repeats"]:
            raise GraceConfigError(f"seeds has {len(raw['seeds'])} entries but repeats = {raw['repeats']}; give one")
        seeds = raw.get("seeds", list(range(_positive_int(raw.get("repeats", 1), "repeats"))))
        self.seeds = [_positive_int(s, "seeds[]", 0) for s in seeds]
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise GraceConfigError(f"seeds = {seeds!r} must be a non-empty list of distinct ints >= 0")

    def _run_settings(self, settings: dict[str, Any]) -> None:
        """How every cell runs: steps, tuning, evaluation, timing, timeout, logging, device, backend."""
        self.max_steps = _positive_int(settings["max_steps"], "max_steps", 0)
        self.tune_epochs = _positive_int(settings["tune_epochs"], "tune_epochs", 0)
        self.tune_holdout = float(settings["tune_holdout"])
        if not 0 < self.tune_holdout < 1:
            raise GraceConfigError(f"tune_holdout = {self.tune_holdout!r} must be in (0, 1)")
        self.eval_batch_size = _positive_int(settings["eval_batch_size"], "eval_batch_size")
        self.timing_skip_steps = _positive_int(settings["timing_skip_steps"], "timing_skip_steps", 0)
        self.timeout = float(settings["timeout"])
        if not self.timeout > 0:
            raise GraceConfigError(f"timeout = {self.timeout!r} must be > 0 seconds")
        self.tensorboard: bool = settings["tensorboard"]
        if self.tensorboard:
            try:
                import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it)
            except ImportError:
                raise GraceConfigError(
                    "tensorboard = true needs the tensorboard package: pip install 'grace_dgc[tensorboard]'"
                ) from None
        self.device: str = settings["device"]
        if self.device not in ("auto", "cpu", "cuda"):
            raise GraceConfigError(f"device = {self.device!r}; accepted: auto, cpu, cuda")
        self.backend: str = settings["backend"]
        if self.backend not in ("auto", "gloo", "nccl"):
            raise GraceConfigError(f"backend = {self.backend!r}; accepted: auto, gloo, nccl")

    # -- validation ------------------------------------------------------------------
    def _workload(self, raw: dict[str, Any]) -> str:
        """The workload's canonical name, or its ``module:factory`` spec with a file path made
        absolute (written back into ``raw``: the saved config and the ranks import the same)."""
        from grace_survey.workloads.registry import is_spec, list_workloads, resolve_spec, workload_factory

        if "workload" not in raw:
            raise GraceConfigError(
                f"{self.source}: 'workload' is required: one of {', '.join(list_workloads())}, your own as "
                "'package.module:factory' or 'file.py:factory', or script mode (script = 'train.py' / --script)"
            )
        name = resolve_spec(raw["workload"], self.base_dir)
        name, _ = workload_factory(name)  # an unknown name or a spec that does not import fails here
        raw["workload"] = name
        return name if is_spec(name) else name.lower()

    def _script(self, raw: dict[str, Any]) -> tuple[str | None, list[str], str]:
        """(absolute script path, its arguments, its content hash) in script mode, else (None, [], "")."""
        if "script" not in raw:
            return None, [], ""
        path = os.path.abspath(os.path.join(self.base_dir, raw["script"]))
        if not os.path.isfile(path):
            raise GraceConfigError(f"{self.source}: script {raw['script']!r} is not a file ({path})")
        args = raw.get("script_args", [])
        if not all(isinstance(a, str) for a in args):
            raise GraceConfigError(f"{self.source}: script_args = {args!r} must be a list of strings")
        if "workload" in raw:
            raise GraceConfigError(
                f"{self.source}: give workload or script, not both (in script mode the script is the workload)"
            )
        with open(path, "rb") as f:
            sha = hashlib.sha256(f.read()).hexdigest()[:16]
        raw["script"] = path
        return path, list(args), sha

    def _check_hyper(self) -> None:
        from grace_survey.workloads.contract import check_hyper_parameters

        check_hyper_parameters({k: v for k, v in self.hyper.items()})  # raises naming the key and range

    def _networks(self, networks: list[Any]) -> list[Network]:
        out = []
        for i, net in enumerate(networks):
            if not isinstance(net, dict):
                raise GraceConfigError(f'networks[{i}] = {net!r} must be a table, e.g. {{bandwidth = "1gbit"}}')
            _check_keys(net, NETWORK_KEYS, f"networks[{i}]")
            out.append(Network(net.get("bandwidth"), net.get("latency")))
        tags = [n.tag for n in out]
        if not out or len(set(tags)) != len(tags):
            raise GraceConfigError(f"networks must be a non-empty list of distinct conditions, got {tags}")
        return out

    def _methods(self, methods: list[Any] | None) -> list[dict[str, Any]]:
        import grace_dgc

        if not methods:
            raise GraceConfigError(
                f"{self.source}: no methods; add [[methods]] tables "
                f"(compressor = one of {', '.join(grace_dgc.list_compressors())})"
            )
        out: list[dict[str, Any]] = []
        labels: set[str] = set()
        for i, method in enumerate(methods):
            where = f"methods[{i}]"
            spec = self._method(method, where)
            if spec["label"] in labels:
                raise GraceConfigError(f"{where}: label {spec['label']!r} is used twice; labels must be unique")
            labels.add(spec["label"])
            _method_settings(method, spec, where)
            spec["faults"] = self._faults(method["faults"], f"{where}.faults") if "faults" in method else self.faults
            if spec["faults"]:
                _check_faults_fit(spec, where)
            out.append(spec)
        return out

    def _faults(self, faults: list[Any], where: str) -> list[dict[str, Any]]:
        """Each fault checked, with its tag (a run id's suffix): the group, the step it dies at
        and the step it is started again at."""
        out = []
        for i, fault in enumerate(faults):
            at = f"{where}[{i}]"
            if not isinstance(fault, dict):
                raise GraceConfigError(
                    f"{at} = {fault!r} must be a table, e.g. {{group = 1, at_step = 20, back_after_steps = 10}}"
                )
            _check_keys(fault, FAULT_KEYS, at)
            missing = [k for k in ("group", "at_step", "back_after_steps") if k not in fault]
            if missing:
                raise GraceConfigError(
                    f"{at}: {', '.join(missing)} missing; a fault gives group, at_step and back_after_steps"
                )
            group = _positive_int(fault["group"], f"{at}: group")
            if not any(group < w for w in self.workers):
                raise GraceConfigError(
                    f"{at}: group = {group}, but the grid's workers are {self.workers}: a fault needs a group "
                    "1 .. workers - 1 (group 0 records the run)"
                )
            step, back = (
                _positive_int(fault["at_step"], f"{at}: at_step"),
                _positive_int(fault["back_after_steps"], f"{at}: back_after_steps"),
            )
            inside = bool(fault.get("inside_exchange", False))
            tag = f"g{group} lost {step}-{step + back}{' in exchange' if inside else ''}"
            out.append(dict(group=group, at_step=step, back_after_steps=back, inside_exchange=inside, tag=tag))
        if self.script is not None and out:
            raise GraceConfigError(f"{where}: faults run built-in and plugin workloads, not script mode")
        tags = [f["tag"] for f in out]
        if len(set(tags)) != len(tags):
            raise GraceConfigError(f"{where}: the same fault is given twice: {tags}")
        return out

    def _method(self, method: object, where: str) -> dict[str, Any]:
        """One ``[[methods]]`` table's parts and parameters, checked by the real builder on every
        world size of the grid, on paper (no process, no network)."""
        import grace_dgc
        from grace_dgc.registry import COMMUNICATORS, COMPRESSORS, MEMORIES

        if not isinstance(method, dict):
            raise GraceConfigError(f"{where} must be a table with at least 'compressor'")
        _check_keys(method, METHOD_KEYS, where)
        if "compressor" not in method:
            raise GraceConfigError(
                f"{where}: 'compressor' is required (one of {', '.join(grace_dgc.list_compressors())}, or your own "
                "class as 'package.module:Class' or 'path/to/file.py:Class')"
            )
        compressor = self._part(method, "compressor", COMPRESSORS, where)
        memory = self._part(method, "memory", MEMORIES, where, "none")
        fallback = "allreduce" if COMPRESSORS.get(compressor).summable else "allgather"
        communicator = self._part(method, "communicator", COMMUNICATORS, where, fallback)
        spec: dict[str, Any] = {
            "label": method.get("label", _default_label(compressor)),
            "compressor": compressor,
            "memory": memory,
            "communicator": communicator,
            "params": dict(method.get("params", {})),
            "tags": dict(method.get("tags", {})),
        }
        for size in self.workers:
            on = f" on {size} workers" if size > 1 else ""
            try:
                grace_dgc.build(compressor, memory, communicator, engine=PlanEngine(size), **spec["params"])
            except GraceConfigError as err:
                raise GraceConfigError(f"{where} ({spec['label']!r}){on}: {err}") from None
            except (ValueError, TypeError) as err:  # a plugin's own check of its parameters
                refused = _refused_by(err, spec)
                raise GraceConfigError(
                    f"{where} ({spec['label']!r}){on}: {refused}: {type(err).__name__}: {err}"
                ) from err
        return spec

    def _part(
        self, method: dict[str, Any], kind: str, registry: Registry[Any], where: str, default: str | None = None
    ) -> str:
        """``method[kind]`` checked (an unknown name is an error naming the method, as any other
        of its errors): a registered name as given (the runs' fingerprints hold it so), a compressor
        chain's stages canonical, and a spec with its file made absolute, from the config's folder
        (written back into ``method``: the saved config and the ranks import the same file)."""
        from grace_dgc.registry import is_spec, resolve_spec

        if kind not in method:
            assert default is not None
            return default
        given: str = method[kind]
        if is_spec(given):
            given = ">".join(resolve_spec(stage.strip(), self.base_dir) for stage in given.split(">"))
            method[kind] = given
        labelled = f" ({method['label']!r})" if "label" in method else ""
        try:
            canonical = registry.canonical(given)
        except GraceConfigError as err:
            raise GraceConfigError(f"{where}{labelled}: {err}") from None
        return canonical if kind == "compressor" or is_spec(given) else given

    # -- the grid --------------------------------------------------------------------
    def cells(self, cache_dir: str | None = None, tensorboard_dir: str | None = None) -> list[Cell]:
        """Every (method × workers × seed × network) run, as :class:`~grace_survey.config.cell.Cell`.

        Order: network, workers, method, seed — so lr tuning (once per method and worker
        count) happens in the first seed's run and later seeds reuse it.
        """
        cells = []
        for net in self.networks:
            for workers in self.workers:
                for method in self.methods:
                    for seed in self.seeds:
                        cells.append(self._cell(method, workers, seed, net, cache_dir, tensorboard_dir))
        # under torchft (unshaped): each method with faults, once without one and once per fault
        for workers in self.workers:
            for method in self.methods:
                faults = [f for f in method["faults"] if f["group"] < workers]
                for fault in [{"tag": "torchft"}, *faults] if faults else []:
                    for seed in self.seeds:
                        cells.append(self._cell(method, workers, seed, Network(), cache_dir, tensorboard_dir, fault))
        return cells

    def _cell(
        self,
        method: Mapping[str, Any],
        workers: int,
        seed: int,
        net: Network,
        cache_dir: str | None,
        tensorboard_dir: str | None,
        fault: dict[str, Any] | None = None,
    ) -> Cell:
        hyper = dict(self.hyper)
        hyper.update({k: method[k] for k in ("lr", "momentum", "weight_decay") if k in method})
        return Cell(
            survey=self.name,
            label=method["label"],
            method={
                k: method[k]
                for k in ("compressor", "memory", "communicator", "params", "tags", "fusion_bytes", "schedule")
                if k in method
            },
            tune_lr=method.get("tune_lr"),
            workers=workers,
            seed=seed,
            network=net.to_dict(),
            workload=self.workload,
            workload_options=self.workload_options,
            hyper=hyper,
            data_dir=self.data_dir,
            data_seed=self.data_seed,
            max_steps=self.max_steps,
            tune_epochs=self.tune_epochs,
            tune_holdout=self.tune_holdout,
            eval_batch_size=self.eval_batch_size,
            timing_skip_steps=self.timing_skip_steps,
            device=self.device,
            backend=self.backend,
            cache_dir=cache_dir,
            tensorboard_dir=tensorboard_dir if self.tensorboard else None,
            script=self.script,
            script_args=list(self.script_args),
            script_sha=self.script_sha,
            launcher=self.launcher,
            fault=fault,
        )

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.raw)


# -- loading ---------------------------------------------------------------------------
# what a script owns in script mode: the survey cannot hand these to its training loop
SCRIPT_OWNS = tuple(k for k in WORKLOAD_HYPER if k != "target_accuracy") + ("max_steps", "tune_epochs", "tune_holdout")
SCRIPT_OWNS_PER_METHOD = ("schedule", "fusion_bytes", "tune_lr", "lr", "momentum", "weight_decay")


def script_mode(raw: dict[str, Any], script: str | None) -> dict[str, Any]:
    """``raw`` in script mode when ``script`` is given (``--script``, relative to the working
    directory): the script replaces the config's workload, if it names one, and that
    workload's training settings (epochs, lr, batch size ...: the script owns its own)."""
    if script is not None:
        dropped = ("workload", "workload_options", "data_dir", *SCRIPT_OWNS)
        raw = {k: v for k, v in raw.items() if k not in dropped}
        raw["script"] = os.path.abspath(script)
    return raw


def _check_script_mode(raw: Mapping[str, Any], source: str) -> None:
    """Settings the survey cannot apply to a script are errors, not silently other runs."""
    given = [k for k in SCRIPT_OWNS if k in raw]
    if given:
        raise GraceConfigError(
            f"{source}: {', '.join(given)} belong to the training loop, and in script mode the loop is your "
            "script's: pass them with --script-args (the script may also read grace_survey.config.cell())"
        )
    for i, method in enumerate(raw.get("methods") or []):
        owned = [k for k in SCRIPT_OWNS_PER_METHOD if isinstance(method, dict) and k in method]
        if owned:
            raise GraceConfigError(
                f"{source}: methods[{i}] sets {', '.join(owned)}, which script mode cannot apply (the script builds "
                "its own optimizer and DistributedOptimizer from cell_grace()); remove them or use a workload"
            )


def load_config(path: str, script: str | None = None) -> SurveyConfig:
    """A :class:`SurveyConfig` from a ``.toml`` file (or the ``.json`` a survey saves), in
    script mode if ``script`` is given."""
    if not os.path.isfile(path):
        raise GraceConfigError(f"config file {path!r} does not exist")
    kind = "JSON" if path.endswith(".json") else "TOML"
    try:
        with open(path, "rb") as f:
            raw = json.loads(f.read().decode("utf-8")) if kind == "JSON" else tomllib.load(f)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
        raise GraceConfigError(f"{path}: not valid {kind}: {err}") from None
    except UnicodeDecodeError as err:
        raise GraceConfigError(f"{path}: not valid {kind}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except RecursionError:
        raise GraceConfigError(f"{path}: not valid {kind}: nested too deeply for a survey config") from None
    return SurveyConfig(script_mode(raw, script), source=path)


def with_overrides(
    config: SurveyConfig,
    workers: int | list[int] | None = None,
    epochs: int | None = None,
    data_dir: str | None = None,
    network: Mapping[str, Any] | None = None,
    max_steps: int | None = None,
    tensorboard: bool | None = None,
    script: str | None = None,
    script_args: list[str] | None = None,
    launcher: str | None = None,
) -> SurveyConfig:
    """A copy of ``config`` with the CLI's overrides applied (validated again). ``script``
    (relative to the working directory) puts the config in script mode: its workload, if it
    has one, is replaced by the script."""
    raw = script_mode(config.to_dict(), script)
    if script_args is not None:
        raw["script_args"] = list(script_args)
    if launcher is not None:
        raw["launcher"] = launcher
    if workers is not None:
        raw["workers"] = workers
    if epochs is not None:
        raw["epochs"] = epochs
    if data_dir is not None:
        raw["data_dir"] = data_dir
    if max_steps is not None:
        raw["max_steps"] = max_steps
    if tensorboard:
        raw["tensorboard"] = True
    if network is not None:
        raw["networks"] = [network]
    raw.setdefault("name", config.name)
    return SurveyConfig(raw, source=config.source)


def _method_settings(method: Mapping[str, Any], spec: dict[str, Any], where: str) -> None:
    """A method's own training settings, checked into ``spec``: lr, momentum, weight_decay,
    fusion_bytes, its schedule and its lr candidates (tune_lr)."""
    for key in ("lr", "momentum", "weight_decay"):
        if key in method:
            low_ok = method[key] > 0 if key == "lr" else method[key] >= 0
            if not (low_ok and math.isfinite(method[key])):
                raise GraceConfigError(f"{where}: {key} = {method[key]!r} must be {'> 0' if key == 'lr' else '>= 0'}")
            spec[key] = float(method[key])
    if "fusion_bytes" in method:
        spec["fusion_bytes"] = _positive_int(method["fusion_bytes"], f"{where}: fusion_bytes", low=0)
    if "schedule" in method:
        spec["schedule"] = _schedule(method["schedule"], spec, f"{where} ({spec['label']!r})")
    if "tune_lr" in method:
        cands = method["tune_lr"]
        if not cands or not all(
            isinstance(c, (int, float)) and not isinstance(c, bool) and 0 < c < math.inf for c in cands
        ):
            raise GraceConfigError(
                f"{where}: tune_lr = {cands!r} must be a non-empty list of finite learning rates > 0"
            )
        if "lr" in method:
            raise GraceConfigError(f"{where}: give lr or tune_lr, not both")
        spec["tune_lr"] = [float(c) for c in cands]


UNDER_A_QUORUM = ("diloco", "local_sgd", "sparseloco", "streaming_diloco", "onebit_adam", "zero_one_adam")


def _check_faults_fit(spec: Mapping[str, Any], where: str) -> None:
    """A method with faults: one torchft runs (grace_dgc.training.torchft.fault_tolerant), with its own lr."""
    from grace_dgc.training.schedules import SCHEDULES

    schedule = spec.get("schedule")
    if schedule is not None and SCHEDULES.canonical(schedule["name"]) not in UNDER_A_QUORUM:
        raise GraceConfigError(
            f"{where} ({spec['label']!r}): faults run under torchft, which takes the step-by-step exchange and the "
            f"schedules {', '.join(UNDER_A_QUORUM)}; not {schedule['name']!r} (give this method faults = [])"
        )
    if "tune_lr" in spec:
        raise GraceConfigError(
            f"{where} ({spec['label']!r}): faults and tune_lr together: the runs under torchft take the method's lr; "
            "give lr, or faults = [] for this method"
        )


def _default_label(compressor: str) -> str:
    """A method's label when it gives none: its compressor's name; a spec's class by the name
    its decorator registered, else by its own name (a label names no file)."""
    from grace_dgc.registry import COMPRESSORS, is_spec

    def short(stage: str) -> str:
        if not is_spec(stage):
            return stage
        name: str = getattr(COMPRESSORS.get(stage), "registered_name", stage)
        return name if name != stage else stage.rpartition(":")[2]

    return ">".join(short(stage) for stage in compressor.split(">"))


def _refused_by(error: BaseException, spec: Mapping[str, Any]) -> str:
    """Which part of ``spec``'s method raised ``error`` while it was built, with the method's
    parameters: the part whose constructor is the outermost frame of the traceback that runs
    on one of the three parts (else the method's three names)."""
    from grace_dgc.registry import COMMUNICATORS, COMPRESSORS, MEMORIES

    kinds = {"compressor": COMPRESSORS, "memory": MEMORIES, "communicator": COMMUNICATORS}
    classes = {}
    for kind, registry in kinds.items():
        try:
            classes[kind] = registry.get(spec[kind])
        except GraceConfigError:  # a chain's stand-in: named as a whole below
            pass
    params = ", ".join(f"{key}={value!r}" for key, value in spec["params"].items()) or "no parameters"
    trace = error.__traceback__
    while trace is not None:
        self_ = trace.tb_frame.f_locals.get("self")
        for kind, cls in classes.items():
            if isinstance(cls, type) and type(self_) is cls:
                return f"{kind} {spec[kind]!r} refused its parameters ({params})"
        trace = trace.tb_next
    parts = ", ".join(f"{kind} {spec[kind]!r}" for kind in kinds)
    return f"the method ({parts}) refused its parameters ({params})"


def _schedule(raw: object, spec: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``{name = "diloco", inner_steps = 10, ...}`` checked by building the schedule on paper
    (a model of one-element parameters, the method's Grace on one planned rank): every name and value
    is refused here, before any rank starts."""
    import torch

    import grace_dgc
    from grace_dgc import schedules

    if not isinstance(raw, dict) or "name" not in raw:
        raise GraceConfigError(
            f'{where}: schedule must be a table with a name, e.g. {{name = "diloco", inner_steps = 10}}; '
            f"schedules: {', '.join(schedules.list_schedules())}"
        )
    params = {k: v for k, v in raw.items() if k != "name"}
    if "fusion_bytes" in params:
        raise GraceConfigError(f"{where}: schedule: give fusion_bytes on the method, not in its schedule")
    try:
        name = schedules.SCHEDULES.canonical(raw["name"])
        grace = grace_dgc.build(
            spec["compressor"], spec["memory"], spec["communicator"], engine=PlanEngine(1), **spec["params"]
        )
        # as many one-element parameters as a fragmenting schedule splits (the model's own count
        # is checked when the cell builds it)
        fragments = params.get("fragments")
        count = fragments if isinstance(fragments, int) and 1 <= fragments <= 10_000 else 1
        weights = [(f"w{i}", torch.nn.Parameter(torch.zeros(1))) for i in range(count)]
        optimizer_class = (
            torch.optim.AdamW if getattr(schedules.SCHEDULES.get(name), "needs_adam", False) else torch.optim.SGD
        )
        schedules.create(name, optimizer_class([w for _, w in weights], lr=0.1), grace, weights, **params)
    except GraceConfigError as err:
        raise GraceConfigError(f"{where}: schedule: {err}") from None
    return {"name": name, "params": params}


def load_preset(name: str, data_dir: str | None = None) -> SurveyConfig:
    """The :class:`SurveyConfig` of preset ``name`` (:mod:`grace_survey.config.presets`)."""
    return SurveyConfig(preset_dict(name, data_dir), source=f"preset {preset_name(name)}")
