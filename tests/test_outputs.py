"""The torch-free readers the demo's gate rests on: .latent files, MP4 tracks, the comparison, and JSON."""

from __future__ import annotations

import array
import json
import math
import struct

import pytest

from h3kit import outputs
from h3kit.cliutil import emit_json


def write_latent(path, values, shape, dtype="F32", key="latent_tensor"):
    code = {"F32": "f", "F64": "d"}[dtype]
    blob = array.array(code, values).tobytes()
    header = json.dumps({"__metadata__": {"prompt": "{}"}, key: {"dtype": dtype, "shape": shape,
                                                                "data_offsets": [0, len(blob)]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + blob)


def test_read_latent_round_trip(tmp_path):
    p = tmp_path / "x.latent"
    write_latent(p, [1.5, -2.0, 3.25, 0.0, 7.0, -1.0], [1, 2, 3])
    shape, values = outputs.read_latent(p)
    assert shape == [1, 2, 3] and list(values) == [1.5, -2.0, 3.25, 0.0, 7.0, -1.0]


@pytest.mark.parametrize("blob, fragment", [(b"abc", "too short"), (struct.pack("<Q", 2) + b"{}", "no 'latent_tensor'")])
def test_read_latent_refuses_what_it_cannot_read(tmp_path, blob, fragment):
    p = tmp_path / "bad.latent"
    p.write_bytes(blob)
    with pytest.raises(outputs.OutputFormatError) as e:
        outputs.read_latent(p)
    assert fragment in e.value.message


def test_read_latent_refuses_bf16(tmp_path):
    p = tmp_path / "b.latent"
    write_latent(p, [1.0, 2.0], [2])
    raw = p.read_bytes().replace(b'"F32"', b'"BF16"')
    p.write_bytes(raw)
    with pytest.raises(outputs.OutputFormatError):
        outputs.read_latent(p)


def test_compare_figures():
    r = outputs.compare(array.array("f", [1.0, -4.0, 2.0]), array.array("f", [1.0, -4.5, 2.0]))
    assert r["max_abs"] == pytest.approx(0.5) and r["max_rel"] == pytest.approx(0.5 / 4.0) and r["non_finite"] == 0


@pytest.mark.parametrize("other", [[1.0, math.nan, 3.0], [math.nan, 2.0, 3.0], [1.0, 2.0, math.inf]])
def test_a_nan_or_inf_anywhere_fails_the_comparison(other):
    r = outputs.compare(array.array("f", [1.0, 2.0, 3.0]), array.array("f", other))
    assert r["max_rel"] == math.inf and r["non_finite"] == 1
    assert not (r["max_rel"] <= 1e-5)


def test_compare_refuses_unequal_lengths():
    with pytest.raises(outputs.OutputFormatError):
        outputs.compare(array.array("f", [1.0]), array.array("f", [1.0, 2.0]))


def box(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I4s", 8 + len(payload), kind) + payload


def hdlr(handler: bytes) -> bytes:
    return box(b"hdlr", b"\x00" * 8 + handler + b"\x00" * 12)


def test_mp4_tracks(tmp_path):
    moov = box(b"moov", box(b"mvhd", b"\x00" * 100)
               + box(b"trak", box(b"mdia", hdlr(b"vide")))
               + box(b"trak", box(b"mdia", hdlr(b"soun"))))
    p = tmp_path / "v.mp4"
    p.write_bytes(box(b"ftyp", b"isom\x00\x00\x02\x00") + box(b"mdat", b"\x00" * 64) + moov)
    assert outputs.mp4_tracks(p) == ["vide", "soun"]
    p.write_bytes(b"\x00\x00\x00\x08ftyp" + b"\xff" * 16)  # truncated garbage: no track, no crash
    assert outputs.mp4_tracks(p) == []


def test_json_output_has_no_nan_or_infinity(capsys):
    emit_json({"max_rel": math.inf, "rows": [{"x": math.nan}, {"x": -math.inf}], "ok": False})
    text = capsys.readouterr().out
    assert json.loads(text)["data"] == {"max_rel": "inf", "rows": [{"x": "nan"}, {"x": "-inf"}]}


@pytest.mark.parametrize("ref, other, shapes, fragment", [
    ([], [], (None, None), "nothing to compare"),
    ([0.0, 0.0], [0.0, 0.0], (None, None), "all zeros"),
    ([0.0, 0.0], [1.0, 0.0], (None, None), "all zeros"),
    ([1.0, 2.0], [1.0], (None, None), "2 values with 1"),
    ([1.0, 2.0], [1.0, 2.0], ([2, 1], [1, 2]), "shape [1, 2] with [2, 1]"),
])
def test_compare_refuses_what_a_gate_would_pass_on_nothing(ref, other, shapes, fragment):
    with pytest.raises(outputs.OutputFormatError) as e:
        outputs.compare(array.array("f", ref), array.array("f", other), *shapes)
    assert fragment in e.value.message
