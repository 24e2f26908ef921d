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

from ..errors import GraceConfigError
from .units import format_rate, parse_latency, parse_rate

# key -> (accepted types, description); None means "optional, no default here"
TOP_LEVEL = {
    "name": ((str,), "a name for the survey, shown in the report"),
    "description": ((str,), "free text, shown in the report"),
    "workload": ((str,), "workload name (grace_dgc.survey.workloads.list_workloads())"),
    "workload_options": ((dict,), "extra get_workload options, e.g. {num_samples = 2000}"),
    "data_dir": ((str,), "directory with dataset files (never downloaded)"),
    "data_seed": ((int,), "seed of the generated dataset instance (same for every cell)"),
    "workers": ((int, list), "ranks per run: an int or a list (a grid dimension)"),
    "seeds": ((list,), "run seeds (model init + data order), e.g. [0, 1, 2]"),
    "repeats": ((int,), "shorthand for seeds = [0 .. repeats-1]"),
    "epochs": ((int,), "epochs per run (default: the workload's)"),
    "batch_size": ((int,), "batch size per worker (default: the workload's)"),
    "lr": ((int, float), "learning rate (default: the workload's)"),
    "momentum": ((int, float), "SGD momentum (default: the workload's)"),
    "weight_decay": ((int, float), "SGD weight decay (default: the workload's)"),
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
    "timing_skip_steps": ((int,), "first steps of a run left out of the timing means (default 1)"),
    "timeout": ((int, float), "seconds one run may take before it is killed (default 86400)"),
    "networks": ((list,), "network conditions, e.g. [{}, {bandwidth = \"1gbit\", latency = 0.1}]"),
    "methods": ((list,), "the methods: [[methods]] tables"),
}
METHOD_KEYS = {
    "label": ((str,), "the method's name in tables and plots (unique)"),
    "compressor": ((str,), "registered compressor (grace_dgc.list_compressors())"),
    "memory": ((str,), "registered memory (default none)"),
    "communicator": ((str,), "registered communicator (default: allreduce if the compressor's "
                             "payloads are summable, else allgather)"),
    "params": ((dict,), "parameters for grace_dgc.build, e.g. {compress_ratio = 0.01}"),
    "lr": ((int, float), "this method's learning rate (overrides the survey's)"),
    "momentum": ((int, float), "this method's SGD momentum"),
    "weight_decay": ((int, float), "this method's SGD weight decay"),
    "tune_lr": ((list,), "lr candidates: the best on a held-out split is used (and reported)"),
    "tags": ((dict,), "free-form values carried into the results (e.g. kpercent = 1 for the "
                      "seed000 table)"),
}
NETWORK_KEYS = {
    "bandwidth": ((str, int, float), "rate of the shaped loopback, e.g. \"1gbit\""),
    "latency": ((str, int, float), "one-way delay in milliseconds added to every packet"),
}
# forwarded to get_workload as hyper-parameter overrides
WORKLOAD_HYPER = ("epochs", "batch_size", "lr", "momentum", "weight_decay", "target_accuracy",
                  "lr_milestones", "lr_gamma", "grad_clip")
DEFAULTS = {"data_seed": 0, "workers": 2, "max_steps": 0, "tune_epochs": 0, "tune_holdout": 0.1,
            "eval_batch_size": 1000, "device": "auto", "backend": "auto", "timing_skip_steps": 1,
            "timeout": 86400}


def _check_keys(table, accepted, where):
    unknown = sorted(set(table) - set(accepted))
    if unknown:
        lines = "\n".join(f"  {k}: {desc}" for k, (_, desc) in accepted.items())
        raise GraceConfigError(f"unknown key(s) {', '.join(map(repr, unknown))} in {where}; accepted:\n{lines}")
    for key, value in table.items():
        types = accepted[key][0]
        if isinstance(value, bool) or not isinstance(value, types):
            names = " or ".join("table" if t is dict else "list" if t is list else t.__name__ for t in types)
            raise GraceConfigError(f"{where}: {key} = {value!r} must be a {names}")


def _positive_int(value, key, low=1):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise GraceConfigError(f"{key} = {value!r} must be an int >= {low}")
    return value


class Network:
    """A network condition: unshaped (``Network()``) or a shaped loopback."""

    def __init__(self, bandwidth=None, latency=None):
        self.bandwidth_bps = None if bandwidth in (None, "", 0) else parse_rate(bandwidth)
        self.latency_ms = 0.0 if latency in (None, "") else parse_latency(latency)

    @property
    def shaped(self):
        return self.bandwidth_bps is not None or self.latency_ms > 0

    @property
    def tag(self):
        if not self.shaped:
            return "local"
        parts = [format_rate(self.bandwidth_bps)] if self.bandwidth_bps else []
        if self.latency_ms:
            parts.append(f"{self.latency_ms:g}ms")
        return "-".join(parts)

    def to_dict(self):
        return {"bandwidth_bps": self.bandwidth_bps, "latency_ms": self.latency_ms, "tag": self.tag}

    @classmethod
    def from_dict(cls, d):
        net = cls()
        net.bandwidth_bps, net.latency_ms = d.get("bandwidth_bps"), float(d.get("latency_ms") or 0.0)
        return net


class SurveyConfig:
    """A validated survey grid. ``raw`` is the config as given (a dict, as from TOML)."""

    def __init__(self, raw, source="<config>"):
        if not isinstance(raw, dict):
            raise GraceConfigError(f"{source}: a config is a table of keys, got {type(raw).__name__}")
        raw = copy.deepcopy(raw)
        _check_keys(raw, TOP_LEVEL, source)
        self.source = source
        self.raw = raw
        if "workload" not in raw:
            raise GraceConfigError(f"{source}: 'workload' is required (one of {', '.join(_workload_names())})")
        if raw["workload"].lower() not in _workload_names():
            from .workloads import get_workload
            get_workload(raw["workload"])      # raises the registry's error with a suggestion
        self.workload = raw["workload"].lower()
        self.name = raw.get("name", os.path.splitext(os.path.basename(source))[0] or "survey")
        self.description = raw.get("description", "")
        self.workload_options = dict(raw.get("workload_options", {}))
        self.hyper = {k: raw[k] for k in WORKLOAD_HYPER if k in raw}
        self.data_dir = raw.get("data_dir") or None
        settings = dict(DEFAULTS, **{k: raw[k] for k in DEFAULTS if k in raw})
        self.data_seed = _positive_int(settings["data_seed"], "data_seed", 0)
        workers = settings["workers"]
        self.workers = [_positive_int(w, "workers") for w in (workers if isinstance(workers, list) else [workers])]
        if not self.workers:
            raise GraceConfigError("workers = [] is empty; give at least one worker count")
        if "seeds" in raw and "repeats" in raw and len(raw["seeds"]) != raw["repeats"]:
            raise GraceConfigError(f"seeds has {len(raw['seeds'])} entries but repeats = {raw['repeats']}; give one")
        seeds = raw.get("seeds", list(range(_positive_int(raw.get("repeats", 1), "repeats"))))
        self.seeds = [_positive_int(s, "seeds[]", 0) for s in seeds]
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise GraceConfigError(f"seeds = {seeds!r} must be a non-empty list of distinct ints >= 0")
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
        self.device = settings["device"]
        if self.device not in ("auto", "cpu", "cuda"):
            raise GraceConfigError(f"device = {self.device!r}; accepted: auto, cpu, cuda")
        self.backend = settings["backend"]
        if self.backend not in ("auto", "gloo", "nccl"):
            raise GraceConfigError(f"backend = {self.backend!r}; accepted: auto, gloo, nccl")
        self._check_hyper()
        self.networks = self._networks(raw.get("networks", [{}]))
        self.methods = self._methods(raw.get("methods"))

    # -- validation ------------------------------------------------------------------
    def _check_hyper(self):
        from .workloads import _checked
        _checked({k: v for k, v in self.hyper.items()})      # raises naming the key and range

    def _networks(self, networks):
        out = []
        for i, net in enumerate(networks):
            if not isinstance(net, dict):
                raise GraceConfigError(f"networks[{i}] = {net!r} must be a table, e.g. {{bandwidth = \"1gbit\"}}")
            _check_keys(net, NETWORK_KEYS, f"networks[{i}]")
            out.append(Network(net.get("bandwidth"), net.get("latency")))
        tags = [n.tag for n in out]
        if not out or len(set(tags)) != len(tags):
            raise GraceConfigError(f"networks must be a non-empty list of distinct conditions, got {tags}")
        return out

    def _methods(self, methods):
        import grace_dgc
        from ..registry import COMPRESSORS
        if not methods:
            raise GraceConfigError(f"{self.source}: no methods; add [[methods]] tables "
                                   f"(compressor = one of {', '.join(grace_dgc.list_compressors())})")
        out, labels = [], set()
        for i, method in enumerate(methods):
            where = f"methods[{i}]"
            if not isinstance(method, dict):
                raise GraceConfigError(f"{where} must be a table with at least 'compressor'")
            _check_keys(method, METHOD_KEYS, where)
            if "compressor" not in method:
                raise GraceConfigError(f"{where}: 'compressor' is required "
                                       f"(one of {', '.join(grace_dgc.list_compressors())})")
            compressor = COMPRESSORS.canonical(method["compressor"])
            summable = COMPRESSORS.get(compressor).summable
            spec = {
                "label": method.get("label", compressor),
                "compressor": compressor,
                "memory": method.get("memory", "none"),
                "communicator": method.get("communicator", "allreduce" if summable else "allgather"),
                "params": dict(method.get("params", {})),
                "tags": dict(method.get("tags", {})),
            }
            try:        # every name and parameter checked by the real builder, on no network
                grace_dgc.build(spec["compressor"], spec["memory"], spec["communicator"], engine="local",
                                **spec["params"])
            except GraceConfigError as err:
                raise GraceConfigError(f"{where} ({spec['label']!r}): {err}") from None
            if spec["label"] in labels:
                raise GraceConfigError(f"{where}: label {spec['label']!r} is used twice; labels must be unique")
            labels.add(spec["label"])
            for key in ("lr", "momentum", "weight_decay"):
                if key in method:
                    low_ok = method[key] > 0 if key == "lr" else method[key] >= 0
                    if not (low_ok and math.isfinite(method[key])):
                        raise GraceConfigError(f"{where}: {key} = {method[key]!r} must be "
                                               f"{'> 0' if key == 'lr' else '>= 0'}")
                    spec[key] = float(method[key])
            if "tune_lr" in method:
                cands = method["tune_lr"]
                if not cands or not all(isinstance(c, (int, float)) and not isinstance(c, bool) and c > 0
                                        for c in cands):
                    raise GraceConfigError(f"{where}: tune_lr = {cands!r} must be a non-empty list of "
                                           f"learning rates > 0")
                if "lr" in method:
                    raise GraceConfigError(f"{where}: give lr or tune_lr, not both")
                spec["tune_lr"] = [float(c) for c in cands]
            out.append(spec)
        return out

    # -- the grid --------------------------------------------------------------------
    def cells(self, cache_dir=None):
        """Every (method × workers × seed × network) run, as plain dicts for the runner.

        Order: network, workers, method, seed — so lr tuning (once per method and worker
        count) happens in the first seed's run and later seeds reuse it.
        """
        cells = []
        for net in self.networks:
            for workers in self.workers:
                for method in self.methods:
                    for seed in self.seeds:
                        cells.append(self._cell(method, workers, seed, net, cache_dir))
        return cells

    def _cell(self, method, workers, seed, net, cache_dir):
        hyper = dict(self.hyper)
        hyper.update({k: method[k] for k in ("lr", "momentum", "weight_decay") if k in method})
        cell = {
            "survey": self.name,
            "label": method["label"],
            "method": {k: method[k] for k in ("compressor", "memory", "communicator", "params", "tags")},
            "tune_lr": method.get("tune_lr"),
            "workers": workers, "seed": seed, "network": net.to_dict(),
            "workload": self.workload, "workload_options": self.workload_options,
            "hyper": hyper, "data_dir": self.data_dir, "data_seed": self.data_seed,
            "max_steps": self.max_steps, "tune_epochs": self.tune_epochs, "tune_holdout": self.tune_holdout,
            "eval_batch_size": self.eval_batch_size, "timing_skip_steps": self.timing_skip_steps,
            "device": self.device, "backend": self.backend,
        }
        cell["run_id"] = run_id(method["label"], workers, seed, net.tag)
        cell["cell_hash"] = cell_hash(cell)
        cell["tuning_key"] = tuning_key(cell)
        cell["cache_dir"] = cache_dir       # not hashed: where a run keeps generated data
        return cell

    def to_dict(self):
        return copy.deepcopy(self.raw)


def run_id(label, workers, seed, network_tag="local"):
    rid = f"{label} w{workers} s{seed}"
    return rid if network_tag == "local" else f"{rid} @{network_tag}"


def cell_hash(cell):
    """Fingerprint of everything that changes a run's result (resume skips only a finished
    run whose fingerprint matches)."""
    keep = {k: v for k, v in cell.items() if k not in ("run_id", "cell_hash", "tuning_key", "cache_dir", "survey")}
    return hashlib.sha1(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:12]


def tuning_key(cell):
    """lr tuning is shared by the seeds of a (method, workers, network) group."""
    keep = {k: v for k, v in cell.items()
            if k not in ("run_id", "cell_hash", "tuning_key", "cache_dir", "survey", "seed")}
    return hashlib.sha1(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:12]


def _workload_names():
    from .workloads import list_workloads
    return list_workloads()


# -- loading ---------------------------------------------------------------------------
def load_config(path):
    """A :class:`SurveyConfig` from a ``.toml`` file (or the ``.json`` a survey saves)."""
    if not os.path.isfile(path):
        raise GraceConfigError(f"config file {path!r} does not exist")
    if path.endswith(".json"):
        with open(path) as f:
            raw = json.load(f)
    else:
        with open(path, "rb") as f:
            try:
                raw = tomllib.load(f)
            except tomllib.TOMLDecodeError as err:
                raise GraceConfigError(f"{path}: not valid TOML: {err}") from None
    return SurveyConfig(raw, source=path)


def _method(label, compressor, memory="none", communicator=None, **extra):
    method = {"label": label, "compressor": compressor, "memory": memory}
    if communicator:
        method["communicator"] = communicator
    method.update(extra)
    return method


KPERCENTS = (100, 10, 5, 3, 2, 1, 0.9, 0.5, 0.3, 0.2, 0.1, 0)


def _kpercent_method(k):
    """The seed000 sweep: "send k% of the gradient" by magnitude, the rest dropped (its
    masking experiment: no error feedback). 100% is the dense baseline; 0% sends nothing
    (threshold = ∞), so the model stays at its initialisation."""
    if k == 100:
        return _method("100 (send all)", "none", tags={"kpercent": 100})
    if k == 0:
        return _method("0 (send none)", "threshold", "none", "allgather",
                       params={"threshold": math.inf}, tags={"kpercent": 0})
    return _method(f"{k:g}", "topk", "none", "allgather", params={"compress_ratio": k / 100},
                   tags={"kpercent": k})


def _preset_quick(data_dir):
    return {
        "name": "quick",
        "description": "none, top-k 1%, DGC 0.1%, QSGD and 2-bit on MNIST-1D with 2 ranks",
        "workload": "mnist1d-mlp", "workers": 2, "seeds": [0], "epochs": 10,
        "methods": [
            _method("dense", "none"),
            _method("topk 1%", "topk", "residual", "allgather", params={"compress_ratio": 0.01}),
            _method("dgc 0.1%", "dgc", "momentum", "allgather",
                    params={"compress_ratio": 0.001, "warmup_epochs": 2}),
            _method("qsgd 64", "qsgd", "none", "allgather", params={"quantum_num": 64}),
            _method("twobit 0.005", "twobit", "residual", "allgather", params={"threshold": 0.005}),
        ],
    }


def _preset_kpercent(data_dir):
    return {
        "name": "seed000-kpercent",
        "description": "Send k% of the gradient (top-k by magnitude, the rest dropped) with 1 and 2 "
                       "workers; the seed's 'Send k% grads | Accuracy | Loss' table",
        "workload": "mnist-mlp" if data_dir else "mnist1d-mlp", "data_dir": data_dir,
        "workers": [1, 2], "seeds": [0],
        "methods": [_kpercent_method(k) for k in KPERCENTS],
    }


def _preset_dgc_resnet20(data_dir):
    return {
        "name": "seed001-dgc-resnet20",
        "description": "ResNet-20 on CIFAR-10, dense vs DGC (ratio 0.001, 5 warm-up epochs, fp16 "
                       "values, int32 indices, momentum correction); the seed's time-to-85% table",
        "workload": "cifar10-resnet20", "data_dir": data_dir, "workers": 1, "seeds": [0],
        "target_accuracy": 0.85,
        "methods": [
            _method("dense", "none"),
            _method("dgc 0.1%", "dgc", "momentum", "allgather",
                    params={"compress_ratio": 0.001, "warmup_epochs": 5, "fp16_values": True}),
        ],
    }


def _preset_topk_dgc_qsgd(data_dir):
    lrs = [0.01, 0.025, 0.05, 0.1]
    return {
        "name": "seed003-topk-dgc-qsgd",
        "description": "baseline vs Top-k vs DGC vs QSGD at 2 and 4 ranks, each with its own learning "
                       "rate tuned on a held-out split (the seed thesis' fairness point)",
        "workload": "mnist-lenet5" if data_dir else "mnist1d-cnn", "data_dir": data_dir,
        "workers": [2, 4], "seeds": [0, 1, 2],
        "methods": [
            _method("baseline", "none", tune_lr=lrs),
            _method("topk 1%", "topk", "residual", "allgather", params={"compress_ratio": 0.01}, tune_lr=lrs),
            _method("dgc 0.1%", "dgc", "momentum", "allgather",
                    params={"compress_ratio": 0.001, "warmup_epochs": 2}, tune_lr=lrs),
            _method("qsgd 64", "qsgd", "none", "allgather", params={"quantum_num": 64}, tune_lr=lrs),
        ],
    }


def _preset_twobit(data_dir):
    return {
        "name": "seed004-twobit",
        "description": "MXNet's 2-bit quantisation (error feedback) at several thresholds vs dense on the "
                       "fully-connected-heavy network, unshaped and on a 1 Gbit/s shaped loopback",
        "workload": "fc-heavy", "workers": 2, "seeds": [0], "epochs": 2, "max_steps": 30,
        "networks": [{}, {"bandwidth": "1gbit"}],
        "methods": [_method("dense", "none")] + [
            _method(f"twobit {t:g}", "twobit", "residual", "allgather", params={"threshold": t})
            for t in (0.5, 0.05, 0.005)],
    }


PRESETS = {
    "quick": _preset_quick,
    "seed000-kpercent": _preset_kpercent,
    "seed001-dgc-resnet20": _preset_dgc_resnet20,
    "seed003-topk-dgc-qsgd": _preset_topk_dgc_qsgd,
    "seed004-twobit": _preset_twobit,
}


def preset_dict(name, data_dir=None):
    """The raw config dict of preset ``name`` (``data_dir`` switches to file datasets where
    the preset has one)."""
    if name not in PRESETS:
        raise GraceConfigError(f"unknown preset {name!r}; accepted: {', '.join(PRESETS)}")
    raw = PRESETS[name](data_dir)
    return {k: v for k, v in raw.items() if v is not None}


def load_preset(name, data_dir=None):
    return SurveyConfig(preset_dict(name, data_dir), source=f"preset {name}")


def with_overrides(config, workers=None, epochs=None, data_dir=None, network=None, max_steps=None):
    """A copy of ``config`` with the CLI's overrides applied (validated again)."""
    raw = config.to_dict()
    if workers is not None:
        raw["workers"] = workers
    if epochs is not None:
        raw["epochs"] = epochs
    if data_dir is not None:
        raw["data_dir"] = data_dir
    if max_steps is not None:
        raw["max_steps"] = max_steps
    if network is not None:
        raw["networks"] = [network]
    raw.setdefault("name", config.name)
    return SurveyConfig(raw, source=config.source)
