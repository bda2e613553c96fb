"""The distribution claims one import name, `jhicache`; a user's own `models` package still
works."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# A user's project with its own `models` package, the name jhicache's folder has in the repo.
USER_CHECK = """
import models
import jhicache
from jhicache.models import Qwen2Config
from jhicache.pallas_kernels import write_kv
assert models.MINE == "user", models.__file__
assert {where!r} in jhicache.models.__file__, jhicache.models.__file__
print("ok")
"""


def _user_project(tmp_path: Path) -> Path:
    project = tmp_path / "user_project"
    (project / "models").mkdir(parents=True)
    (project / "models" / "__init__.py").write_text('MINE = "user"\n')
    return project


def _run(code: str, cwd: Path, pythonpath: list[Path]) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, pythonpath)),
           "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out),
                    str(ROOT)], check=True, capture_output=True, timeout=600)
    return next(out.glob("jhicache-*.whl"))


def test_wheel_installs_only_the_jhicache_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"jhicache",
                                                wheel.name.split("-py")[0] + ".dist-info"}
    assert "jhicache/models/decoder.py" in names and "jhicache/pallas_kernels/kv_write.py" in names
    assert "jhicache/bench/__main__.py" in names  # the client bench; benchmarks/ stays out


def test_installed_wheel_beside_a_user_models_package(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(target), str(wheel)], check=True, capture_output=True, timeout=600)
    project = _user_project(tmp_path)
    where = str(target / "jhicache" / "models")
    assert _run(USER_CHECK.format(where=where), project, [project, target]).strip() == "ok"


def test_bare_checkout_on_pythonpath_beside_a_user_models_package(tmp_path: Path) -> None:
    """The GPU machine runs the repo with PYTHONPATH=. and no install: drop any installed
    jhicache finder so that only the checkout can provide the package."""
    project = _user_project(tmp_path)
    only_checkout = ("import sys\nsys.meta_path = [f for f in sys.meta_path "
                     "if 'editable' not in type(f).__module__]\n")
    where = str(ROOT / "models")
    out = _run(only_checkout + USER_CHECK.format(where=where), project, [project, ROOT])
    assert out.strip() == "ok"
