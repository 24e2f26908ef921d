"""The survey's worker entry point and its grid driver.

One *cell* (method × workers × seed × network) is trained by :func:`run_cell`, called
once per rank. The same code runs under

* :func:`grace_dgc.launch.run_local` (what ``grace-dgc survey`` does: one gloo/NCCL
  process group on localhost per cell),
* ``torchrun --nproc-per-node N -m grace_dgc.survey.runner --config C --out D``, and
* ``horovodrun -np N python -m grace_dgc.survey.runner --config C --out D``
  (detected from Horovod's environment; ``--launcher horovod`` forces it),

where :func:`main` initialises the runtime from the environment and trains every cell
of the grid whose worker count equals the world size.

Fairness: ``torch.manual_seed(seed)`` right before ``make_model()`` (the same initial
weights for every method), a ``torch.Generator`` seeded from (seed, epoch) draws the
epoch's permutation (the same data order for every method); global batch = per-worker
batch × workers, rank r takes rows [r·b, (r+1)·b) of each global batch.

Measurements (all per optimizer step unless stated; every figure is measured):
  compute_s      forward + backward wall time on the training thread (CUDA-synchronised);
                 gradient exchanges start during backward on grace's communication
                 thread, so on CPU they compete with it for cores
  compress_s, communicate_s, decompress_s
                 grace.stats() timers on the communication thread (may overlap compute)
  wait_s         optimizer.step() wall time: waiting for the exchanges still in flight
                 after backward, plus the parameter update
  step_s         compute_s + wait_s (forward start → update done; no data loading)
  bytes_per_step bytes this worker handed to collectives (grace.stats(), padding and
                 size headers included), mean over workers
  compression_ratio  Σ bytes_sent / Σ dense fp32 bytes of the same gradients
  samples_per_s  global samples per second of training wall time (data loading included,
                 evaluation excluded)
The first ``timing_skip_steps`` steps of a run (thread start-up, allocator warm-up) are
left out of the per-step time means, not out of bytes or samples/s.
"""
import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import resource
import socket
import sys
import time
import uuid

import torch
import torch.nn.functional as F

import grace_dgc

from ..errors import GraceConfigError

RESULTS = "results.jsonl"
SUMMARY_CSV = "summary.csv"
CONFIG_JSON = "survey_config.json"


# ----------------------------------------------------------------------------- context
class Context:
    """Where this rank runs: its runtime's engine (for the runner's own collectives:
    metrics, agreement), rank, size and device."""

    def __init__(self, engine_kind, device):
        self.engine_kind = engine_kind      # what grace.build gets: "torch", "horovod", "local"
        self.engine = grace_dgc.create_engine(engine_kind)
        self.rank, self.size = self.engine.rank, self.engine.size
        self.device = device

    @classmethod
    def detect(cls, device="auto"):
        """Horovod once ``hvd.init()`` was called, else an initialised torch.distributed
        group, else a single local process."""
        import torch.distributed as dist
        hvd = sys.modules.get("horovod.torch")
        if hvd is not None and hvd.is_initialized():
            kind, local_rank = "horovod", hvd.local_rank()
        elif dist.is_available() and dist.is_initialized():
            kind, local_rank = "torch", int(os.environ.get("LOCAL_RANK", dist.get_rank()))
            if dist.get_backend() == "nccl":
                device = "cuda"
        else:
            kind, local_rank = "local", 0
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda":
            index = local_rank % torch.cuda.device_count()
            torch.cuda.set_device(index)
            device = f"cuda:{index}"
        return cls(kind, torch.device(device))

    def gather(self, values):
        """Every rank's list of floats (float64; on the device for NCCL)."""
        vec = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        if self.size == 1:
            return [vec.cpu().tolist()]
        return [v.cpu().tolist() for v in self.engine.allgather(vec)]

    def sum(self, values):
        vec = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        return (self.engine.allreduce(vec) if self.size > 1 else vec).cpu().tolist()

    def broadcast_object(self, obj):
        return obj if self.size == 1 else self.engine.broadcast_object(obj, 0)

    def _comm_device(self):
        """NCCL moves CUDA tensors only; gloo and Horovod take these small CPU vectors."""
        if self.engine_kind == "torch" and self.device.type == "cuda":
            import torch.distributed as dist
            if dist.get_backend() == "nccl":
                return self.device
        return "cpu"

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


# ----------------------------------------------------------------------------- results files
def append_record(out_dir, record):
    """Append one JSON line to results.jsonl (rank 0 only; flushed at once)."""
    with open(os.path.join(out_dir, RESULTS), "a") as f:
        f.write(json.dumps(_finite(record), sort_keys=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _finite(obj):
    """JSON without NaN/Infinity: non-finite floats become null (a diverged run's loss)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def read_records(out_dir):
    path = os.path.join(out_dir, RESULTS)
    if not os.path.isfile(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    pass        # a line cut by a crash: that run has no summary, so it reruns
    return records


def finished_runs(out_dir):
    """run_id → cell_hash of every run with a summary line."""
    return {r["run_id"]: r.get("cell_hash") for r in read_records(out_dir) if r.get("type") == "summary"}


def latest_summaries(records):
    """The last summary per run_id, in first-appearance order."""
    latest = {}
    for r in records:
        if r.get("type") == "summary":
            latest.pop(r["run_id"], None)
            latest[r["run_id"]] = r
    return list(latest.values())


SUMMARY_COLUMNS = [
    "run_id", "label", "compressor", "memory", "communicator", "params", "workers", "seed", "network",
    "workload", "parameters", "batch_size", "global_batch", "lr", "lr_tuned", "momentum", "epochs",
    "steps", "final_test_accuracy", "final_test_loss", "final_train_accuracy", "final_train_loss",
    "best_test_accuracy", "target_accuracy", "epochs_to_target", "time_to_target_s", "train_time_s",
    "samples_per_s", "bytes_per_step", "dense_bytes_per_step", "compression_ratio", "exchanges_per_step",
    "compute_s", "compress_s", "communicate_s", "decompress_s", "wait_s", "step_s", "peak_rss_mb",
    "peak_gpu_mb", "device", "backend", "cell_hash", "finished",
]


def write_summary_csv(out_dir):
    """summary.csv: one row per finished run (its latest summary), rewritten from results.jsonl."""
    import csv
    rows = latest_summaries(read_records(out_dir))
    path = os.path.join(out_dir, SUMMARY_CSV)
    with open(path + ".tmp", "w", newline="") as f:
        writer = csv.DictWriter(f, SUMMARY_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            flat = dict(row)
            flat["params"] = json.dumps(row.get("params", {}), sort_keys=True)
            flat["lr_tuned"] = bool(row.get("lr_tuning"))
            writer.writerow(flat)
    os.replace(path + ".tmp", path)
    return path


# ----------------------------------------------------------------------------- workload
def load_workload(cell):
    from .workloads import get_workload
    data_dir = cell["data_dir"]
    if data_dir is None and cell["workload"].startswith("mnist1d") and cell.get("cache_dir"):
        data_dir = cell["cache_dir"]        # mnist1d keeps its generated arrays there
    return get_workload(cell["workload"], data_dir=data_dir, seed=cell["data_seed"],
                        **cell["workload_options"], **cell["hyper"])


def _mix(*numbers):
    """A 63-bit seed from ints (stable across runs and platforms)."""
    digest = hashlib.blake2b(",".join(map(str, numbers)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _loss_and_hits(output, targets):
    """(mean loss, correct predictions, predictions) for both workload kinds."""
    if output.dim() == 3:      # lm: (N, bptt, vocab) against next tokens (N, bptt)
        output = output.reshape(-1, output.shape[-1])
        targets = targets.reshape(-1)
    loss = F.cross_entropy(output, targets)
    hits = (output.argmax(dim=-1) == targets).sum()
    return loss, hits, targets.numel()


# ----------------------------------------------------------------------------- training
def evaluate(ctx, model, split, batch_size):
    """(loss, accuracy) on ``split``, sharded over ranks and summed; floating buffers
    (BatchNorm statistics, which each rank updates from its own batches) are averaged
    over ranks first so every rank evaluates the same model."""
    if ctx.size > 1:
        with torch.no_grad():
            for buffer in model.buffers():
                if buffer.is_floating_point():
                    summed = ctx.engine.allreduce(buffer.detach().clone())
                    buffer.copy_(summed / ctx.size)
    inputs, targets = split
    shard = torch.arange(ctx.rank, len(inputs), ctx.size)
    loss_sum = hits = count = 0.0
    model.eval()
    with torch.no_grad():
        for start in range(0, len(shard), batch_size):
            idx = shard[start:start + batch_size]
            x, y = inputs[idx].to(ctx.device), targets[idx].to(ctx.device)
            loss, correct, n = _loss_and_hits(model(x), y)
            loss_sum += loss.item() * n
            hits += correct.item()
            count += n
    loss_sum, hits, count = ctx.sum([loss_sum, hits, count])
    return loss_sum / max(count, 1), hits / max(count, 1)


def _peak_memory(ctx):
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024     # Linux: KiB
    gpu_mb = torch.cuda.max_memory_allocated(ctx.device) / 2 ** 20 if ctx.device.type == "cuda" else 0.0
    return rss_mb, gpu_mb


def train(ctx, cell, workload, lr, train_split, eval_split, epochs, on_epoch=None, progress=False,
          desc=None):
    """Train one model from its seeded init; returns (history, totals).

    ``on_epoch(record)`` gets each epoch's record (every rank calls it; the caller writes
    on rank 0). Evaluation time is not training time.
    """
    seed = cell["seed"]
    method = cell["method"]
    params = dict(method["params"])
    from ..registry import COMPRESSORS
    if "seed" in COMPRESSORS.accepted_params(method["compressor"]) and "seed" not in params:
        params["seed"] = seed       # a stochastic method's own randomness follows the run seed

    torch.manual_seed(seed)
    model = workload.make_model().to(ctx.device)
    grace = grace_dgc.build(method["compressor"], method["memory"], method["communicator"],
                            engine=ctx.engine_kind, **params)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=workload.momentum,
                                weight_decay=workload.weight_decay)
    dist_opt = grace_dgc.DistributedOptimizer(optimizer, grace, model.named_parameters())

    inputs, targets = train_split
    if ctx.device.type == "cuda":
        inputs, targets = inputs.to(ctx.device), targets.to(ctx.device)
    per_worker = workload.batch_size
    global_batch = per_worker * ctx.size
    steps = len(inputs) // global_batch
    if steps == 0:
        raise GraceConfigError(
            f"batch_size {per_worker} × {ctx.size} workers = {global_batch} exceeds the {len(inputs)} "
            f"training samples of {workload.name!r}; lower batch_size or workers")
    if cell["max_steps"]:
        steps = min(steps, cell["max_steps"])
    skip = cell["timing_skip_steps"]
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)

    from tqdm.auto import tqdm
    bar = tqdm(total=epochs * steps, desc=desc, position=1, leave=False, unit="step", dynamic_ncols=True,
               disable=not (progress and ctx.rank == 0))
    history, elapsed, global_step = [], 0.0, 0
    timers = ("compute", "compress", "communicate", "decompress", "wait")
    try:
        for epoch in range(epochs):
            epoch_lr = lr * workload.lr_gamma ** sum(epoch >= m for m in workload.lr_milestones)
            for group in optimizer.param_groups:
                group["lr"] = epoch_lr
            grace.set_epoch(epoch)
            order = torch.randperm(len(inputs), generator=torch.Generator().manual_seed(_mix(seed, epoch)))
            augment_rng = torch.Generator().manual_seed(_mix(seed, epoch, "augment", ctx.rank))
            if ctx.device.type == "cuda":
                order = order.to(ctx.device)
            model.train()
            acc = dict.fromkeys(("loss", "hits", "count", "bytes", "dense", "exchanges", "timed")
                                + timers, 0.0)
            method_stats = {}
            ctx.sync()
            epoch_start = time.perf_counter()
            for step in range(steps):
                start = step * global_batch + ctx.rank * per_worker
                idx = order[start:start + per_worker]
                x, y = inputs[idx], targets[idx]
                if workload.augment is not None:
                    x = workload.augment(x, augment_rng)
                x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
                ctx.sync()
                t0 = time.perf_counter()
                dist_opt.zero_grad()
                loss, hits, count = _loss_and_hits(model(x), y)
                loss.backward()
                ctx.sync()
                t1 = time.perf_counter()
                if workload.grad_clip:      # clip the averaged gradient, then update once
                    dist_opt.synchronize()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), workload.grad_clip)
                    optimizer.step()
                else:
                    dist_opt.step()
                ctx.sync()
                t2 = time.perf_counter()
                stats = grace.stats()
                grace.reset_stats()
                acc["loss"] += loss.item() * count
                acc["hits"] += hits.item()
                acc["count"] += count
                acc["bytes"] += stats["bytes_sent"]
                acc["dense"] += stats["dense_bytes"]
                acc["exchanges"] += stats["tensors"]
                if global_step >= skip:
                    acc["timed"] += 1
                    acc["compute"] += t1 - t0
                    acc["wait"] += t2 - t1
                    for key in ("compress", "communicate", "decompress"):
                        acc[key] += stats[key + "_seconds"]
                method_stats = {k: v for k, v in stats.items() if k not in _GRACE_KEYS}
                global_step += 1
                bar.update()
            ctx.sync()
            train_time = time.perf_counter() - epoch_start
            rss, gpu = _peak_memory(ctx)
            ranks = ctx.gather([acc["loss"], acc["hits"], acc["count"], acc["bytes"], acc["dense"],
                                acc["exchanges"], acc["timed"], train_time, rss, gpu]
                               + [acc[t] for t in timers])
            test_loss, test_acc = evaluate(ctx, model, eval_split, cell["eval_batch_size"])
            epoch_time = max(r[7] for r in ranks)
            elapsed += epoch_time
            timed = [max(r[6], 1) for r in ranks]
            record = {
                "epoch": epoch + 1, "lr": epoch_lr, "steps": steps,
                "train_loss": sum(r[0] for r in ranks) / sum(r[2] for r in ranks),
                "train_accuracy": sum(r[1] for r in ranks) / sum(r[2] for r in ranks),
                "test_loss": test_loss, "test_accuracy": test_acc,
                "epoch_time_s": epoch_time, "elapsed_s": elapsed,
                "samples_per_s": steps * global_batch / epoch_time,
                "bytes_per_step": sum(r[3] for r in ranks) / len(ranks) / steps,
                "dense_bytes_per_step": sum(r[4] for r in ranks) / len(ranks) / steps,
                "compression_ratio": sum(r[3] for r in ranks) / max(sum(r[4] for r in ranks), 1),
                "exchanges_per_step": ranks[0][5] / steps,
                "timed_steps": int(ranks[0][6]),
                "peak_rss_mb": max(r[8] for r in ranks), "peak_gpu_mb": max(r[9] for r in ranks),
                "method_stats": method_stats,
            }
            for i, name in enumerate(timers):     # per-step means over ranks
                record[name + "_s"] = sum(r[10 + i] / t for r, t in zip(ranks, timed)) / len(ranks)
            record["step_s"] = record["compute_s"] + record["wait_s"]
            history.append(record)
            bar.set_postfix(epoch=epoch + 1, test_acc=f"{test_acc:.3f}")
            if on_epoch is not None:
                on_epoch(record)
    finally:
        bar.close()
        dist_opt.remove_hooks()
    return history, {"global_batch": global_batch, "steps_per_epoch": steps,
                     "parameters": sum(p.numel() for p in model.parameters())}


_GRACE_KEYS = {"tensors", "bytes_sent", "dense_bytes", "compress_seconds", "communicate_seconds",
               "decompress_seconds", "steps", "compression_ratio", "bytes_per_step"}


# ----------------------------------------------------------------------------- lr tuning
def holdout_split(workload, cell):
    """(train part, held-out part): the workload's own validation split when it has one
    (PTB), else a seeded ``tune_holdout`` fraction of train (same for every method)."""
    if workload.valid is not None:
        return workload.train, workload.valid
    inputs, targets = workload.train
    order = torch.randperm(len(inputs), generator=torch.Generator().manual_seed(_mix("holdout", cell["data_seed"])))
    held = max(1, int(round(len(inputs) * cell["tune_holdout"])))
    keep, out = order[held:], order[:held]
    return (inputs[keep], targets[keep]), (inputs[out], targets[out])


def tune_lr(ctx, cell, workload, out_dir, progress=False):
    """Pick the lr among ``cell['tune_lr']`` with the best held-out accuracy after short
    runs (ties: lower held-out loss); reuse a recorded tuning of the same key."""
    key = cell["tuning_key"]
    existing = None
    if ctx.rank == 0:
        existing = next((r for r in reversed(read_records(out_dir))
                         if r.get("type") == "tuning" and r.get("tuning_key") == key), None)
    existing = ctx.broadcast_object(existing)
    if existing is not None:
        return existing["chosen_lr"], existing
    train_part, held_part = holdout_split(workload, cell)
    epochs = cell["tune_epochs"] or max(1, workload.epochs // 4)
    candidates = []
    for lr in cell["tune_lr"]:
        history, _ = train(ctx, cell, workload, lr, train_part, held_part, epochs, progress=progress,
                           desc=f"tune {cell['label']} lr={lr:g}")
        last = history[-1]
        candidates.append({"lr": lr, "heldout_accuracy": last["test_accuracy"], "heldout_loss": last["test_loss"]})

    def score(c):
        loss = c["heldout_loss"] if math.isfinite(c["heldout_loss"]) else math.inf
        return (c["heldout_accuracy"] if math.isfinite(c["heldout_accuracy"]) else -1.0, -loss)

    best = max(candidates, key=score)
    record = {"type": "tuning", "tuning_key": key, "label": cell["label"], "workers": cell["workers"],
              "network": cell["network"]["tag"], "seed": cell["seed"], "tune_epochs": epochs,
              "holdout_size": len(held_part[0]), "train_size": len(train_part[0]),
              "candidates": candidates, "chosen_lr": best["lr"]}
    if ctx.rank == 0:
        append_record(out_dir, record)
    return best["lr"], record


# ----------------------------------------------------------------------------- one cell
def execute_cell(ctx, cell, out_dir, progress=False):
    """Train one cell on this rank; rank 0 writes its epoch lines and summary line and
    returns the summary (other ranks return None)."""
    if ctx.size != cell["workers"]:
        raise GraceConfigError(f"cell {cell['run_id']!r} wants {cell['workers']} workers, "
                               f"the runtime has {ctx.size}")
    workload = load_workload(cell)
    tuning = None
    if cell.get("tune_lr"):
        lr, tuning = tune_lr(ctx, cell, workload, out_dir, progress)
    else:
        lr = workload.lr
    attempt = ctx.broadcast_object(uuid.uuid4().hex[:12])
    started = datetime.datetime.now().isoformat(timespec="seconds")
    base = {"run_id": cell["run_id"], "attempt": attempt, "label": cell["label"],
            "workers": cell["workers"], "seed": cell["seed"], "network": cell["network"]["tag"]}

    def on_epoch(record):
        if ctx.rank == 0:
            append_record(out_dir, dict(base, type="epoch", **record))

    history, facts = train(ctx, cell, workload, lr, workload.train, workload.test, workload.epochs,
                           on_epoch=on_epoch, progress=progress, desc=cell["run_id"])
    target = workload.target_accuracy
    reached = next((h for h in history if h["test_accuracy"] >= target), None)
    timed = [h for h in history if h["timed_steps"]] or history
    weights = [h["timed_steps"] or 1 for h in timed]

    def mean_step(key):     # per-step mean over the run (epochs weighted by their timed steps)
        return sum(h[key] * w for h, w in zip(timed, weights)) / sum(weights)

    last = history[-1]
    total_steps = sum(h["steps"] for h in history)
    train_time = last["elapsed_s"]
    summary = dict(
        base, type="summary", cell_hash=cell["cell_hash"], survey=cell["survey"],
        compressor=cell["method"]["compressor"], memory=cell["method"]["memory"],
        communicator=cell["method"]["communicator"], params=cell["method"]["params"],
        tags=cell["method"]["tags"], bandwidth_bps=cell["network"]["bandwidth_bps"],
        latency_ms=cell["network"]["latency_ms"], workload=workload.name,
        workload_description=workload.description, parameters=facts["parameters"],
        batch_size=workload.batch_size, global_batch=facts["global_batch"], lr=lr, lr_tuning=tuning,
        momentum=workload.momentum, weight_decay=workload.weight_decay, epochs=len(history),
        steps_per_epoch=facts["steps_per_epoch"], steps=total_steps,
        final_test_accuracy=last["test_accuracy"], final_test_loss=last["test_loss"],
        final_train_accuracy=last["train_accuracy"], final_train_loss=last["train_loss"],
        best_test_accuracy=max(h["test_accuracy"] for h in history),
        target_accuracy=target, epochs_to_target=reached["epoch"] if reached else None,
        time_to_target_s=reached["elapsed_s"] if reached else None,
        train_time_s=train_time, samples_per_s=total_steps * facts["global_batch"] / train_time,
        bytes_per_step=sum(h["bytes_per_step"] * h["steps"] for h in history) / total_steps,
        dense_bytes_per_step=sum(h["dense_bytes_per_step"] * h["steps"] for h in history) / total_steps,
        compression_ratio=(sum(h["bytes_per_step"] * h["steps"] for h in history)
                           / max(sum(h["dense_bytes_per_step"] * h["steps"] for h in history), 1)),
        exchanges_per_step=last["exchanges_per_step"],
        peak_rss_mb=max(h["peak_rss_mb"] for h in history), peak_gpu_mb=max(h["peak_gpu_mb"] for h in history),
        device=str(ctx.device), backend=_backend_name(ctx), engine=ctx.engine_kind,
        torch=torch.__version__, grace_dgc=grace_dgc.__version__, host=socket.gethostname(),
        python=platform.python_version(), started=started,
        finished=datetime.datetime.now().isoformat(timespec="seconds"),
        method_stats=last["method_stats"], shaping=netem_shaping(),
    )
    for key in ("compute_s", "compress_s", "communicate_s", "decompress_s", "wait_s", "step_s"):
        summary[key] = mean_step(key)
    if ctx.rank == 0:
        append_record(out_dir, summary)
        return summary
    return None


def netem_shaping():
    from .netem import current_shaping
    return current_shaping()


def _backend_name(ctx):
    if ctx.engine_kind == "torch":
        import torch.distributed as dist
        return dist.get_backend()
    return ctx.engine_kind


def run_cell(rank, world_size, cell, out_dir, progress=False, device="auto"):
    """:func:`grace_dgc.launch.run_local` entry point: one rank of one cell."""
    return execute_cell(Context.detect(device), cell, out_dir, progress)


# ----------------------------------------------------------------------------- the grid
def resolve_runtime(config, workers=1, network_shaped=False):
    """(backend, device) for local launches. ``auto``: NCCL + CUDA when there is a GPU per
    rank (gloo when the network is shaped: NCCL would bypass the loopback), else gloo on
    CPU; ``device = "cuda"`` with gloo puts every rank on the GPUs it finds (shared)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if config.device == "cuda" and not gpus:
        raise GraceConfigError("device = 'cuda' but torch sees no GPU; use device = 'auto' or 'cpu'")
    if config.device == "auto":
        cuda = gpus >= workers
    else:
        cuda = config.device == "cuda"
    backend = config.backend
    if backend == "auto":
        backend = "nccl" if cuda and gpus >= workers and not network_shaped else "gloo"
    if backend == "nccl" and gpus < workers:
        raise GraceConfigError(f"backend = 'nccl' needs a GPU per rank ({workers} ranks, {gpus} GPUs); "
                               f"use backend = 'gloo'")
    return backend, "cuda" if cuda else "cpu"


def prepare(config, out_dir, check_workload=True):
    """Create ``out_dir``, save the resolved config and load the workload once (checks its
    options and files before any rank starts; generated data is cached for the ranks)."""
    os.makedirs(out_dir, exist_ok=True)
    raw = config.to_dict()
    raw["name"] = config.name
    with open(os.path.join(out_dir, CONFIG_JSON), "w") as f:
        json.dump(raw, f, indent=2, default=str)
    cache_dir = os.path.join(out_dir, "data-cache")
    os.makedirs(cache_dir, exist_ok=True)
    cells = config.cells(cache_dir=cache_dir)
    if not check_workload:
        return cells, None
    workload = load_workload(cells[0])
    for workers in config.workers:
        if workload.batch_size * workers > len(workload.train[0]):
            raise GraceConfigError(
                f"batch_size {workload.batch_size} × {workers} workers exceeds the "
                f"{len(workload.train[0])} training samples of {workload.name!r}")
    return cells, workload


def run_grid(config, out_dir, progress=True, network_tag=None, log=print):
    """Run every unfinished cell of ``config`` (only those of ``network_tag`` if given),
    skipping runs whose summary is already in ``out_dir``. Cells of a shaped network are
    run in a shaped namespace (see :mod:`grace_dgc.survey.netem`) unless this process is
    already inside one with that shaping. Returns (summaries, failures)."""
    from tqdm.auto import tqdm

    from ..launch import run_local
    from . import netem
    # a shaped-network child runs a share of a grid its parent has already checked
    cells, _ = prepare(config, out_dir, check_workload=network_tag is None)
    if network_tag is not None:
        cells = [c for c in cells if c["network"]["tag"] == network_tag]
    done = finished_runs(out_dir)
    summaries, failures = [], []
    inside = netem.current_shaping()
    by_network = {}
    for cell in cells:
        by_network.setdefault(cell["network"]["tag"], []).append(cell)

    def is_shaped(net):
        return bool(net["bandwidth_bps"]) or net["latency_ms"] > 0

    for tag, group in by_network.items():     # fail fast: before any run, not after hours
        net = group[0]["network"]
        if is_shaped(net) and inside is None and any(done.get(c["run_id"]) != c["cell_hash"] for c in group):
            netem.probe(net["bandwidth_bps"], net["latency_ms"])
    bar = tqdm(total=len(cells), desc=f"survey {config.name}", position=0, unit="run", dynamic_ncols=True,
               disable=not progress)
    try:
        for tag, group in by_network.items():
            net = group[0]["network"]
            todo = [c for c in group if done.get(c["run_id"]) != c["cell_hash"]]
            bar.update(len(group) - len(todo))
            if not todo:
                continue
            shaped = is_shaped(net)
            if shaped and (inside is None or inside.get("tag") != tag):
                if inside is not None:
                    raise GraceConfigError(f"already inside a shaped network ({inside.get('tag')}); cannot "
                                           f"run cells of network {tag!r} here")
                log(f"[survey] network {tag}: running {len(todo)} run(s) in a shaped network namespace")
                bar.clear()
                code = netem.run_shaped(
                    [sys.executable, "-m", "grace_dgc.survey.cli", "survey", "--config",
                     os.path.join(out_dir, CONFIG_JSON), "--out", out_dir, "--network-tag", tag]
                    + ([] if progress else ["--no-progress"]),
                    bandwidth_bps=net["bandwidth_bps"], latency_ms=net["latency_ms"], check_first=False)
                finished = {r["run_id"]: r for r in latest_summaries(read_records(out_dir))}
                for cell in todo:
                    if finished.get(cell["run_id"], {}).get("cell_hash") == cell["cell_hash"]:
                        summaries.append(finished[cell["run_id"]])
                    else:
                        failures.append((cell["run_id"], f"shaped-network child exited with {code}"))
                bar.update(len(todo))
                continue
            for cell in todo:
                backend, device = resolve_runtime(config, cell["workers"], shaped)
                bar.set_postfix_str(cell["run_id"])
                try:
                    result = run_local(run_cell, cell["workers"], (cell, out_dir, progress, device),
                                       backend=backend, timeout=config.timeout)
                    summary = result[0]
                    summaries.append(summary)
                    bar.write(f"[survey] {cell['run_id']}: test acc {summary['final_test_accuracy']:.4f}, "
                              f"{summary['bytes_per_step']:.0f} B/step, ratio {summary['compression_ratio']:.4g}, "
                              f"{summary['train_time_s']:.1f} s")
                except Exception as err:        # one broken run does not stop the survey
                    message = str(err).strip().splitlines()[-1] if str(err).strip() else repr(err)
                    failures.append((cell["run_id"], str(err)))
                    append_record(out_dir, {"type": "error", "run_id": cell["run_id"],
                                            "cell_hash": cell["cell_hash"], "message": str(err)[-4000:]})
                    bar.write(f"[survey] {cell['run_id']} FAILED: {message}")
                bar.update(1)
    finally:
        bar.close()
        write_summary_csv(out_dir)
    return summaries, failures


# ----------------------------------------------------------------------------- torchrun / horovodrun
def _init_runtime(launcher, backend):
    """Initialise Horovod or torch.distributed from the launcher's environment."""
    if launcher == "auto":
        if "HOROVOD_RANK" in os.environ or "HOROVOD_HOSTNAME" in os.environ:
            launcher = "horovod"
        elif "WORLD_SIZE" in os.environ and "RANK" in os.environ:
            launcher = "torchrun"
        else:
            launcher = "local"
    if launcher == "horovod":
        import horovod.torch as hvd
        hvd.init()
    elif launcher == "torchrun":
        import torch.distributed as dist
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        dist.init_process_group(backend)
    return launcher


def main(argv=None):
    """``python -m grace_dgc.survey.runner`` under torchrun / horovodrun (or alone, 1 rank)."""
    from .config import load_config, load_preset
    parser = argparse.ArgumentParser(prog="python -m grace_dgc.survey.runner", description=main.__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="TOML config (or a survey_config.json)")
    source.add_argument("--preset", help="a preset name")
    parser.add_argument("--out", required=True)
    parser.add_argument("--data-dir")
    parser.add_argument("--launcher", choices=("auto", "torchrun", "horovod", "local"), default="auto")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    config = load_config(args.config) if args.config else load_preset(args.preset, args.data_dir)
    _init_runtime(args.launcher, config.backend)
    ctx = Context.detect(config.device)
    cells = prepare(config, args.out)[0] if ctx.rank == 0 else None
    cells = ctx.broadcast_object(cells)
    mine = [c for c in cells if c["workers"] == ctx.size and not (
        c["network"]["bandwidth_bps"] or c["network"]["latency_ms"])]
    if ctx.rank == 0 and len(mine) < len(cells):
        print(f"[survey] world size {ctx.size}: running {len(mine)} of {len(cells)} runs "
              f"(the others need another worker count or a shaped network)", file=sys.stderr)
    for cell in mine:
        done = finished_runs(args.out) if ctx.rank == 0 else None
        if ctx.broadcast_object(done).get(cell["run_id"]) == cell["cell_hash"]:
            continue
        execute_cell(ctx, cell, args.out, progress=not args.no_progress)
    if ctx.rank == 0:
        write_summary_csv(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
