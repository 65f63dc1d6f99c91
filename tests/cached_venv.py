"""A virtualenv created once (file-locked against parallel runs) and cached: the oracle's and Triton's."""

from __future__ import annotations

import fcntl
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path


def cached_venv(venv: Path, label: str, install: Callable[[list[str]], None], system_site_packages: bool = False
                ) -> Path:
    """Path to `venv`'s python; on first use the venv is created and `install(pip)` fills it (`pip` is the venv's
    pip command as a list, installing without bytecode: the venv writes it as it imports), then it is marked
    complete."""
    python = venv / "bin" / "python"
    done = venv / ".complete"
    if done.exists():
        return python
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return python
        print(f"[{label}] creating {venv} (one time)", file=sys.stderr, flush=True)
        site = ["--system-site-packages"] if system_site_packages else []
        subprocess.run([sys.executable, "-m", "venv", *site, str(venv)], check=True)
        # no bytecode compiled at install (pip compiles every file of torch & co one after the other: ~30 s of a
        # ~50-s oracle venv); the venv writes its own at first import instead, whatever PYTHONDONTWRITEBYTECODE
        # says (the .pth line runs at interpreter start): only what is imported, once
        install([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile"])
        site_packages = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                       check=True, capture_output=True, text=True).stdout.strip()
        (Path(site_packages) / "zz_write_bytecode.pth").write_text("import sys; sys.dont_write_bytecode = False\n")
        done.write_text("ok\n")
    return python
