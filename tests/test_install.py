"""Installing without node: a copy of what a clone holds builds an sdist and a wheel with no
node or npm on PATH (the prebuilt lab panel is committed), and the wheel installed into a
fresh virtual environment brings the panel, the server extension's config and the
``torch-workbench`` distribution that imports as ``workbench``."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

pytestmark = pytest.mark.fleet  # engines, kernels or installs: the slow tier

REPO = pathlib.Path(__file__).parent.parent


def _clone_files(dest: pathlib.Path) -> None:
    """The files a clone of this working tree has (tracked, or new and not ignored)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


@pytest.mark.timeout(900)
def test_sdist_and_wheel_build_and_install_without_node(tmp_path):
    src, venv = tmp_path / "src", tmp_path / "venv"
    _clone_files(src)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    bin_dir = venv / "bin"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update(PATH=str(bin_dir), PIP_DISABLE_PIP_VERSION_CHECK="1")  # no node, no npm
    assert shutil.which("npm", path=env["PATH"]) is None and shutil.which("node", path=env["PATH"]) is None

    pip = [str(bin_dir / "python"), "-m", "pip", "install", "-q"]
    assert subprocess.run([*pip, "build"], env=env, capture_output=True, text=True).returncode == 0
    built = subprocess.run([str(bin_dir / "python"), "-m", "build", "--outdir", str(tmp_path / "dist"), str(src)],
                           env=env, capture_output=True, text=True)
    assert built.returncode == 0, (built.stdout + built.stderr)[-3000:]
    wheels = list((tmp_path / "dist").glob("torch_workbench-*.whl"))
    sdists = list((tmp_path / "dist").glob("torch_workbench-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, list((tmp_path / "dist").iterdir())

    # the wheel alone (its dependencies come from this environment, through a .pth file)
    installed = subprocess.run([*pip, "--no-deps", str(wheels[0])], env=env, capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr[-3000:]
    site = next(venv.glob("lib/python*/site-packages"))
    (site / "deps-from-test-env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    panel = venv / "share/jupyter/labextensions/workbench-panel"
    assert (panel / "static/style.js").is_file() and (panel / "package.json").is_file()
    assert (panel / "install.json").read_text().count('"torch-workbench"') == 1
    assert (venv / "etc/jupyter/jupyter_server_config.d/workbench.json").is_file()
    probe = subprocess.run(
        [str(bin_dir / "python"), "-c",
         "import importlib.metadata as m, workbench; print(workbench.__file__); print(m.version('torch-workbench'))"],
        cwd=tmp_path, env=env, capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr[-3000:]
    where, version = probe.stdout.split()
    assert where.startswith(str(venv)) and version == "0.1.0", probe.stdout  # the wheel, not this checkout
    package = pathlib.Path(where).parent
    assert (package / "py.typed").is_file() and not (package / "testing.py").exists(), "typed; no fault injection"
    with zipfile.ZipFile(wheels[0]) as wheel:
        meta = wheel.read(next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        assert any(".dist-info/" in n and n.endswith("LICENSE") for n in wheel.namelist()), wheel.namelist()
    assert "Classifier: License :: OSI Approved :: BSD License" in meta and "Provides-Extra: wandb" in meta
    assert not any(line.startswith("Requires-Dist: wandb") and "extra" not in line for line in meta.splitlines())
    listing = subprocess.run([str(bin_dir / "python"), "-c", "import sys; from jupyterlab.labextensions import main; "
                              "sys.argv = ['jupyter-labextension', 'list']; main()"], cwd=tmp_path,
                             env=env, capture_output=True, text=True)
    line = next((t for t in (listing.stdout + listing.stderr).splitlines() if "workbench-panel" in t), "")
    assert "enabled" in line and "OK" in line, listing.stdout + listing.stderr
