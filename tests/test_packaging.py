"""The wheel ships the tuned configs: built from a copy of the package, the JSON is inside it, and a foscar
installed from it (``pip install --target``) or imported from the wheel itself (a zip) finds the file
through importlib.resources and looks up the H200 entries. CPU only; pip and setuptools, no network."""
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "foscar" / "tuning" / "NVIDIA_H200.json"

# Run in a fresh interpreter: every entry of the shipped file, looked up as a decode of its shape would, with
# the installed versions stood in by the ones the file records (so the entries of both backends apply).
LOOKUP_ALL = r"""
import json, sys
import importlib.resources as resources
import foscar
from foscar import autotune as at
res = resources.files("foscar.tuning").joinpath("NVIDIA_H200.json")
doc = json.loads(res.read_text(encoding="utf-8"))
versions = {"triton": doc["meta"]["triton"], "nvidia-cutlass-dsl": doc["meta"]["cutlass_dsl"]}
at._dist_version = versions.get
found = []
for e in doc["entries"]:
    k = e["key"]
    fmt = foscar.KVFormat(bits=k["bits"], head_dim=k["head_dim"], group_size=k["group"], k_axis=k["k_axis"],
                          v_axis=k["v_axis"])
    key = at.make_key(k["backend"], "NVIDIA H200", fmt, k["gqa"], k["page"], k["batch_bucket"], k["ctx_bucket"],
                      k.get("q_len", 1))
    found.append(at.lookup(key))
print(json.dumps({"foscar": foscar.__file__, "resource": str(res), "found": found,
                  "report": at.tuning_report("NVIDIA H200").lines()}))
"""


def _pip(*args: str, cwd: Path) -> None:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    proc = subprocess.run([sys.executable, "-m", "pip", *args, "--no-index", "--no-deps", "-q"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"pip {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built (setuptools, no build isolation) from a copy of the package, so that the build
    leaves nothing in the working tree."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "foscar", src / "foscar", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("dist")
    _pip("wheel", str(src), "--no-build-isolation", "-w", str(out), cwd=src)
    (whl,) = out.glob("foscar-*.whl")
    return whl


def _lookup_all(python_path: Path, tmp_path: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(python_path), "FOSCAR_TUNING_DIR": str(tmp_path / "env"),
           "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    proc = subprocess.run([sys.executable, "-c", LOOKUP_ALL], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)  # cwd: not the repository, whose foscar/ would be imported instead
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check_lookups(got: dict, root: Path) -> None:
    doc = json.loads(SHIPPED.read_text())
    assert got["foscar"].startswith(str(root)), f"foscar imported from {got['foscar']}, not from {root}"
    assert got["resource"].startswith(str(root))
    assert len(got["found"]) == len(doc["entries"]) > 0  # every shipped entry found, each its own config
    for entry, (config, source) in zip(doc["entries"], got["found"]):
        assert config == entry["config"], entry["key"]
        assert source.startswith(got["resource"]), source
    report = "\n".join(got["report"])
    assert "package data: " + got["resource"] in report
    for backend in ("triton", "cute"):  # every entry of the file applies here
        n = sum(e["key"]["backend"] == backend for e in doc["entries"])
        assert f"{backend}: {n} entries, {n} apply here" in report


def test_the_wheel_ships_the_tuned_configs(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert {"foscar/tuning/__init__.py", "foscar/tuning/NVIDIA_H200.json"} <= names
        assert z.read("foscar/tuning/NVIDIA_H200.json") == SHIPPED.read_bytes()
    assert not any(n.startswith(("tuning/", "share/")) or ".data/data/" in n for n in names)


def test_an_installed_wheel_reads_its_package_data(wheel, tmp_path):
    target = tmp_path / "site"
    _pip("install", "--target", str(target), str(wheel), cwd=tmp_path)
    assert (target / "foscar" / "tuning" / "NVIDIA_H200.json").is_file()
    _check_lookups(_lookup_all(target, tmp_path), target)


def test_the_wheel_as_a_zip_reads_its_package_data(wheel, tmp_path):
    _check_lookups(_lookup_all(wheel, tmp_path), wheel)
