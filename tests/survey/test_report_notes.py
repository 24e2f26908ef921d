"""The report's note on a method that keeps a smaller share of each gradient yet sends more
bytes asks the method why (``grace_survey.report.notes.bytes_notes``: a plugin's classmethod, the
built-ins' answers in the survey, issue 55) instead of naming one: a plugin's
sentences appear in the report, DGC's text is what it was, and a method that says nothing
of its own (or is not installed where the report is written) gets the general remark."""

from test_report_headline import run_records, section, sparse, write

from grace_dgc.compressors.dgc import DGCCompressor
from grace_dgc.compressors.topk import TopKCompressor
from grace_dgc.registry import COMPRESSORS
from grace_survey.report.notes import WIRE_FORMAT_NOTE, MeasuredBytes, bytes_notes
from grace_survey.units import human_bytes

PLUGIN = "report-notes-plugin"


class ExplainsItself(TopKCompressor):
    """A plugin sparsifier with its own reason for its bytes."""

    @classmethod
    def bytes_notes(cls, params, measured, format_bytes):
        return [
            f"Its header is {params['header']} bytes per tensor.",
            f"Kept {measured.ratio:g}, sent {format_bytes(measured.per_step)}, dense {format_bytes(measured.dense)}.",
        ]


class SaysNothing(TopKCompressor):
    @classmethod
    def bytes_notes(cls, params, measured, format_bytes):
        return []


def survey(tmp_path, compressor, params=None, **extra):
    """Three seeds of a dense baseline, top-k at 1% and ``compressor`` at 0.1% sending more."""
    records = []
    for seed in range(3):
        records += run_records("dense", seed, time=10.0 + seed)
        records += sparse("topk 1%", "topk", 0.01, 1320.0, seed)
        runs = sparse("many 0.1%", compressor, 0.001, 5380.0, seed, **extra)
        runs[-1]["params"] = dict(runs[-1]["params"], **(params or {}))
        records += runs
    return section(write(tmp_path, records), "How to read this")


def bytes_note(notes):
    (line,) = [line for line in notes.splitlines() if "sends more bytes than" in line]
    return line


STATED = (
    "- **many 0.1% sends more bytes than topk 1%**, though it keeps a smaller share of each gradient (0.001 "
    f"against 0.01): measured {human_bytes(5380.0)} per step per worker (compression ratio {5380.0 / 60840.0:.4g}) "
    f"against {human_bytes(1320.0)} ({1320.0 / 60840.0:.4g})."
)


def test_a_plugin_compressors_note_appears_in_the_report(tmp_path, monkeypatch):
    monkeypatch.setitem(COMPRESSORS._classes, PLUGIN, ExplainsItself)
    monkeypatch.setitem(COMPRESSORS._aliases, PLUGIN, PLUGIN)
    note = bytes_note(survey(tmp_path, PLUGIN, {"header": 12}))
    assert note == (
        f"{STATED} Its header is 12 bytes per tensor. "
        f"Kept 0.001, sent {human_bytes(5380.0)}, dense {human_bytes(60840.0)}."
    )


def test_a_method_that_says_nothing_adds_nothing(tmp_path, monkeypatch):
    monkeypatch.setitem(COMPRESSORS._classes, PLUGIN, SaysNothing)
    monkeypatch.setitem(COMPRESSORS._aliases, PLUGIN, PLUGIN)
    assert bytes_note(survey(tmp_path, PLUGIN)) == STATED


def test_the_general_remark_by_default_and_for_a_method_not_installed(tmp_path):
    assert bytes_note(survey(tmp_path, "randomk")) == f"{STATED} {WIRE_FORMAT_NOTE}"
    (tmp_path / "elsewhere").mkdir()
    assert bytes_note(survey(tmp_path / "elsewhere", "not-installed-here")) == f"{STATED} {WIRE_FORMAT_NOTE}"


def test_dgcs_note_is_todays_text(tmp_path):
    note = bytes_note(survey(tmp_path, "dgc", {"warmup_epochs": 2}, last_epoch_bytes=4900.0))
    assert note == (
        f"{STATED} Part of it is warm-up: the run average counts 2 warm-up epochs of denser exchanges; after them, "
        f"in the last epoch, it still sent {human_bytes(4900.0)} per step. DGC sends tensors of dim ≤ 1 (biases, "
        f"norm weights) and tensors of fewer than 1024 elements whole, in fp32: 0.001 of the "
        f"{human_bytes(60840.0)} dense gradient is {human_bytes(60.84)}, so most of the {human_bytes(4900.0)} it "
        f"sends per step ({4900.0 / 60.84:.3g}×) is those whole tensors, which on a small model (15210 parameters) "
        "outweigh what the ratio saves."
    )


def test_dgcs_sentences_follow_its_settings():
    measured = MeasuredBytes(ratio=0.001, per_step=200.0, last_epoch=None, dense=60840.0, parameters=15210)
    assert bytes_notes(DGCCompressor)({"warmup_steps": 100}, measured, human_bytes) == [
        "DGC sends tensors of dim ≤ 1 (biases, norm weights) and tensors of fewer than 1024 elements whole, in fp32."
    ]
    settings = {"dense_1d": False, "min_compress_size": 10, "fp16_values": True}
    assert bytes_notes(DGCCompressor)(settings, measured, human_bytes) == [
        "DGC sends tensors of fewer than 10 elements whole, in fp16."
    ]
    assert bytes_notes(DGCCompressor)({"dense_1d": False, "min_compress_size": 0}, measured, human_bytes) == []
    warm = measured._replace(last_epoch=150.0)
    assert bytes_notes(DGCCompressor)({"warmup_steps": 100, "dense_1d": False, "min_compress_size": 0}, warm, str) == [
        "Part of it is warm-up: the run average counts 100 warm-up steps of denser exchanges; after them, in the "
        "last epoch, it still sent 150.0 per step."
    ]
    assert bytes_notes(TopKCompressor)({}, measured, human_bytes) == [WIRE_FORMAT_NOTE]
    assert bytes_notes(None)({}, measured, human_bytes) == [WIRE_FORMAT_NOTE]
