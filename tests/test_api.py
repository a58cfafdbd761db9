"""The Python API and the CLI take spec paths and shipped names, in the checkout and from a wheel."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import kimi_adapter_core
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import KadaptError

REPO = Path(__file__).resolve().parents[1]


def test_public_names_are_listed_and_typed() -> None:
    assert {"load_spec", "applied", "load_model", "load_config", "derive_structure"} <= set(
        dir(kimi_adapter_core)
    )
    assert (Path(kimi_adapter_core.__file__).parent / "py.typed").is_file()


def test_api_takes_paths_and_names(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)  # names must not depend on the working directory
    assert kimi_adapter_core.load_spec("kimi_k25").path == REPO / "specs" / "kimi_k25.yaml"
    assert kimi_adapter_core.load_spec("specs/llama.yaml").name == "llama"  # the README's spelling
    config = kimi_adapter_core.load_config(str(REPO / "specs" / "llama.yaml"))
    assert config.num_key_value_heads == 8
    with kimi_adapter_core.applied("llama"):
        model = kimi_adapter_core.load_model("llama")
    assert type(model).__name__ == "LlamaForCausalLM"
    with pytest.raises(
        KadaptError,
        match="no shipped spec of that name; shipped: "
        + ", ".join(sorted(p.stem for p in (REPO / "specs").glob("*.yaml"))),
    ):
        kimi_adapter_core.load_spec("kimi_k2.5")


def test_cli_spec_argument_lists_the_shipped_names() -> None:
    result = CliRunner().invoke(cli, ["apply", "nope", "--backend", "none"])
    assert result.exit_code == 2
    assert "no shipped spec of that name" in result.output and "qwen3_moe" in result.output


def test_a_directory_named_like_a_spec_does_not_hide_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``kadapt apply llama --output-dir llama`` then ``kadapt plan llama``: the name still means the spec."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama").mkdir()
    assert kimi_adapter_core.load_spec("llama").path == REPO / "specs" / "llama.yaml"
    result = CliRunner().invoke(cli, ["plan", "llama", "--format", "json"])
    assert result.exit_code == 0, result.output
    (tmp_path / "other").mkdir()  # a directory that is no spec name is still refused
    refused = CliRunner().invoke(cli, ["plan", "other"])
    assert refused.exit_code == 2 and "is not a spec file" in refused.output


def outer_pip_installs_elsewhere() -> bool:
    """pip 22.3 added ``--python``: this interpreter's pip installs into another environment, running
    itself with that environment's interpreter (so the scripts it writes name that interpreter)."""
    from importlib.metadata import version

    return tuple(int(part) for part in version("pip").split(".")[:2]) >= (22, 3)


def see_these_packages(python: Path) -> None:
    """Let the venv of ``python`` import this interpreter's packages (torch, transformers): a ``.pth``
    file in its site-packages lists this interpreter's. Not ``--system-site-packages``: made from
    inside a venv (the README's install in one), that shows the base interpreter's packages, not this
    venv's. The listed folders' own ``.pth`` files are not read, so an editable install of the checkout
    stays out of sight."""
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    ours = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    Path(purelib, "outer-site-packages.pth").write_text("".join(f"{folder}\n" for folder in ours))


@pytest.mark.slow
def test_installed_wheel_outside_the_checkout(tmp_path: Path) -> None:
    """A wheel in a fresh venv (reusing this interpreter's torch/transformers, whether this interpreter
    is a system one or a venv's) finds its shipped specs."""
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(REPO)],
        check=True,
        capture_output=True,
    )
    venv = tmp_path / "venv"
    python = venv / "bin" / "python"
    wheel = next(wheels.glob("kadapt-*.whl"))
    if outer_pip_installs_elsewhere():  # the venv needs no pip of its own (ensurepip: ~2.5 CPU-s)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        pip = [sys.executable, "-m", "pip", "--python", str(python)]
    else:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(python), "-m", "pip"]
    see_these_packages(python)
    subprocess.run([*pip, "install", "-q", "--no-deps", str(wheel)], check=True)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": ""}
    kadapt = venv / "bin" / "kadapt"
    # the command runs the venv's interpreter ("#!PYTHON", or "#!/bin/sh" then "'''exec' PYTHON" if long)
    head = kadapt.read_text().splitlines()[:2]
    assert str(python) in "\n".join(head), head
    located = subprocess.run(
        [python, "-c", "import kimi_adapter_core as k; print(k.__file__)"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert str(venv) in located.stdout  # the installed copy, not the checkout
    for ref in ("kimi_k25", "specs/llama.yaml"):
        done = subprocess.run(
            [kadapt, "apply", ref, "--output-dir", str(work / "out" / Path(ref).stem), "--format", "json"],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stdout)["extraction"]["graphs"]["decode"]["nodes"] > 1000
    generated = subprocess.run(
        [kadapt, "generate", "llama", "--out", str(work / "gen")],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    assert generated.returncode == 0, generated.stderr
    assert (work / "gen" / "adapters" / "llama" / "extraction.py").read_text() == (
        REPO / "adapters" / "llama" / "extraction.py"
    ).read_text()  # the wheel's templates and specs render what the checkout committed
    validated = subprocess.run(
        [kadapt, "validate", "--resolve", "llama"], cwd=work, env=env, capture_output=True
    )
    assert validated.returncode == 0, validated.stdout


def test_without_the_model_extra_validate_works_and_apply_says_what_to_install(tmp_path: Path) -> None:
    """`pip install kadapt` (what the pre-commit hook installs) has neither torch nor transformers."""
    import tomllib

    core = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in core if d.split(">")[0].split("<")[0].strip() in ("torch", "transformers")]
    blocked = "import sys; sys.modules['torch'] = sys.modules['transformers'] = None; "
    run_cli = "from kimi_adapter_core.cli import main; sys.argv = ['kadapt', *sys.argv[1:]]; main()"
    for args, code, expected in [
        (["validate", str(REPO / "specs")], 0, "0 invalid"),
        (["apply", "llama", "--output-dir", str(tmp_path)], 1, "install the model extra"),
    ]:
        done = subprocess.run(
            [sys.executable, "-c", blocked + run_cli, *args], capture_output=True, text=True, cwd=tmp_path
        )
        assert done.returncode == code, done.stderr
        assert expected in done.stdout + done.stderr and "Traceback" not in done.stderr
