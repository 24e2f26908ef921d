"""random-k's draw-ahead: on a GPU the next step's indices are drawn on a background thread
(grace_dgc.compressors.randomk._DrawAhead). Here it runs on CPU tensors (the module's test
switch) and must give exactly the indices and payloads of the synchronous draw, whatever
rewinds the step counter; the CUDA case skips without a GPU."""

import copy
import pickle
import threading
import warnings

import pytest
import torch

import grace_dgc
from grace_dgc.compressors import randomk

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: run `make gpu-check` on a machine with one")

NAMES = {"w": 1000, "b": 37, "c": 4096, "one": 1}


@pytest.fixture
def ahead(monkeypatch):
    """Draw ahead on CPU tensors; yields the list of threads that called ``draw_indices``."""
    monkeypatch.setattr(randomk, "_DRAW_AHEAD_ON_CPU", True)
    callers = []
    draw = randomk.draw_indices

    def spy(*args):
        callers.append(threading.current_thread())
        return draw(*args)

    monkeypatch.setattr(randomk, "draw_indices", spy)
    return callers


def make(**params):
    return grace_dgc.build(
        "randomk", "none", "allreduce", engine="local", compress_ratio=0.1, seed=7, **params
    ).compressor


def data(name, numel, step, device="cpu"):
    seed = sum(map(ord, name)) * 1000 + step
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(device)


def same(a, b):
    """Two compress results, bit for bit."""
    (pa, (ia, sa)), (pb, (ib, sb)) = a, b
    assert sa == sb and torch.equal(ia, ib) and ia.dtype == ib.dtype == torch.int64
    assert len(pa) == len(pb) == 1 and torch.equal(pa[0], pb[0])


def drawn_in_the_step(comp, tensor, name):
    """``comp.compress`` with the draw-ahead off (the path a CPU tensor takes)."""
    saved, randomk._DRAW_AHEAD_ON_CPU = randomk._DRAW_AHEAD_ON_CPU, False
    try:
        return comp.compress(tensor, name)
    finally:
        randomk._DRAW_AHEAD_ON_CPU = saved


def synchronous(name, numel, step, device="cpu"):
    """What the draw-ahead-off path gives: a fresh compressor at that step."""
    comp = make()
    comp.steps[name] = step
    got = drawn_in_the_step(comp, data(name, numel, step, device), name)
    assert comp._draw_ahead is None
    return got


def test_the_cpu_path_draws_in_the_step_without_a_thread():
    comp = make()
    before = {t for t in threading.enumerate() if t.name == "randomk-draw-ahead"}
    comp.compress(torch.randn(100), "w")
    assert comp._draw_ahead is None
    assert {t for t in threading.enumerate() if t.name == "randomk-draw-ahead"} == before


def test_drawn_ahead_equals_drawn_in_the_step_over_names_and_steps(ahead):
    on, off = make(), make()
    for step in range(5):
        for name, numel in NAMES.items():
            x = data(name, numel, step)
            same(on.compress(x, name), drawn_in_the_step(off, x, name))
    assert on.steps == off.steps and off._draw_ahead is None
    main = [t for t in ahead if t is threading.main_thread()]
    # `off` draws all of its own in the step, `on` only each name's first step
    assert len(main) == len(NAMES) * 5 + len(NAMES)


def test_a_load_state_dict_that_rewinds_the_steps_gets_the_right_indices(ahead):
    comp = make()
    for step in range(2):
        for name, numel in NAMES.items():
            comp.compress(data(name, numel, step), name)
    saved = comp.state_dict()  # every name at step 2
    for step in range(2, 5):
        for name, numel in NAMES.items():
            comp.compress(data(name, numel, step), name)
    comp.load_state_dict(saved)  # back to step 2: the prefetched step 5 must not be used
    for step in range(2, 4):
        for name, numel in NAMES.items():
            same(comp.compress(data(name, numel, step), name), synchronous(name, numel, step))


def test_reset_snapshot_and_restore_get_the_right_indices(ahead):
    comp = make()
    for step in range(3):
        comp.compress(data("w", 1000, step), "w")
        comp.compress(data("b", 37, step), "b")
    comp.reset("w")  # w back to step 0, b goes on at 3
    same(comp.compress(data("w", 1000, 0), "w"), synchronous("w", 1000, 0))
    same(comp.compress(data("b", 37, 3), "b"), synchronous("b", 37, 3))
    snapshot = comp.snapshot(["w", "b"])  # w at 1, b at 4
    comp.compress(data("w", 1000, 1), "w")
    comp.restore(snapshot, ["w", "b"])
    same(comp.compress(data("w", 1000, 1), "w"), synchronous("w", 1000, 1))
    same(comp.compress(data("b", 37, 4), "b"), synchronous("b", 37, 4))
    comp.reset()
    same(comp.compress(data("b", 37, 0), "b"), synchronous("b", 37, 0))


def test_a_name_whose_size_or_ratio_changes_gets_the_right_indices(ahead):
    comp = make()
    comp.compress(data("w", 1000, 0), "w")  # draws w's step 1 for 1000 elements ahead
    same(comp.compress(data("w", 500, 1), "w"), synchronous("w", 500, 1))
    same(comp.compress(data("w", 500, 2), "w"), synchronous("w", 500, 2))
    comp.compress_ratio = 0.3
    got = comp.compress(data("w", 500, 3), "w")
    assert len(got[1][0]) == 150
    reference = make()
    reference.compress_ratio, reference.steps["w"] = 0.3, 3
    same(got, drawn_in_the_step(reference, data("w", 500, 3), "w"))


def test_a_failure_in_the_thread_falls_back_to_the_draw_in_the_step(ahead, monkeypatch):
    spy = randomk.draw_indices

    def broken(*args):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("no pinned memory")
        return spy(*args)

    monkeypatch.setattr(randomk, "draw_indices", broken)
    comp = make()
    comp.compress(data("w", 1000, 0), "w")
    with pytest.warns(RuntimeWarning, match="drawing the indices ahead failed.*RuntimeError: no pinned memory"):
        same(comp.compress(data("w", 1000, 1), "w"), synchronous("w", 1000, 1))
    with warnings.catch_warnings():  # reported once, then the thread is tried again silently
        warnings.simplefilter("error")
        same(comp.compress(data("w", 1000, 2), "w"), synchronous("w", 1000, 2))
    monkeypatch.setattr(randomk, "draw_indices", spy)  # the thread recovers
    comp.compress(data("w", 1000, 3), "w")
    before = len([t for t in ahead if t is threading.main_thread()])
    same(comp.compress(data("w", 1000, 4), "w"), synchronous("w", 1000, 4))
    assert len([t for t in ahead if t is threading.main_thread()]) == before + 1  # only `synchronous`'s


def test_copies_and_pickles_leave_the_thread_behind_and_draw_the_same(ahead):
    comp = make()
    comp.compress(data("w", 1000, 0), "w")
    assert comp._draw_ahead is not None
    for twin in (copy.deepcopy(comp), pickle.loads(pickle.dumps(comp))):
        assert twin._draw_ahead is None and twin.steps == {"w": 1}
        same(twin.compress(data("w", 1000, 1), "w"), synchronous("w", 1000, 1))
    assert not comp.undeclared_state()


def test_the_thread_ends_with_its_compressor(ahead):
    comp = make()
    before = set(threading.enumerate())
    comp.compress(data("w", 1000, 0), "w")
    (thread,) = [t for t in set(threading.enumerate()) - before if t.name == "randomk-draw-ahead"]
    assert thread.daemon
    del comp
    thread.join(timeout=30)
    assert not thread.is_alive()


@needs_cuda
def test_drawn_ahead_on_a_gpu_equals_the_cpu_draw_on_a_side_stream():
    """On CUDA the draw-ahead is on by itself: indices equal the CPU's, and a consumer on a
    stream of its own waits for the copy."""
    comp = make()
    device = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        for step in range(4):
            for name, numel in NAMES.items():
                got = comp.compress(data(name, numel, step, device), name)
                assert got[1][0].device == device
                expected = synchronous(name, numel, step)
                assert torch.equal(got[1][0].cpu(), expected[1][0])
                assert torch.equal(got[0][0].cpu(), expected[0][0])
    assert comp._draw_ahead is not None and set(comp._draw_ahead._pending) == set(NAMES)
