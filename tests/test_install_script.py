"""scripts/install.sh and the README's one-line install: as root without sudo (a fresh Debian), as a user with
sudo, and as a user without it. Run by /bin/sh with a PATH of stand-ins that record what they are asked
(apt-get, sudo, id, python3 and the venv's pip and hisparse-demo), so nothing is installed."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHELL = shutil.which("dash") or "/bin/sh"


def readme_install_command() -> str:
    """The README's install command: the first line of its first ```bash block under "Quick start"."""
    text = (REPO / "README.md").read_text()
    quick_start = text[text.index("## Quick start"):]
    block = quick_start[quick_start.index("```bash\n") + len("```bash\n"):]
    return block[: block.index("\n")]


# The README's install command: root runs apt-get itself, any other user through sudo.
ONE_LINER = readme_install_command()
APT = "apt-get install -y --no-install-recommends libibverbs1 libnuma1 libcurl4 python3-venv"


def stand_in(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def machine(tmp_path):
    """A checkout copy (the script cds to it) and a bin directory of stand-ins; ``run`` executes there."""
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    shutil.copy2(REPO / "scripts" / "install.sh", checkout / "scripts" / "install.sh")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "log"
    for tool in ("env", "dirname", "mkdir", "chmod"):  # real tools the script and the stand-ins use
        os.symlink(shutil.which(tool), bin_dir / tool)
    stand_in(bin_dir / "id", 'echo "$FAKE_UID"\n')
    stand_in(bin_dir / "apt-get", f'echo "apt-get $* (uid $FAKE_UID)" >> {log}\n')
    stand_in(bin_dir / "python3", f"""echo "python3 $*" >> {log}
if [ "$1 $2" = "-m venv" ]; then
  mkdir -p "$3/bin"
  printf '#!/bin/sh\\necho "pip $*" >> {log}\\n' > "$3/bin/pip"
  printf '#!/bin/sh\\necho "hisparse-demo" >> {log}\\n' > "$3/bin/hisparse-demo"
  chmod +x "$3/bin/pip" "$3/bin/hisparse-demo"
fi
""")

    def run(uid: int, sudo: bool, args=(), command=None, env=None):
        if sudo:
            stand_in(bin_dir / "sudo", f'echo "sudo: $1" >> {log}\nFAKE_UID=0 exec "$@"\n')
        elif (bin_dir / "sudo").exists():
            (bin_dir / "sudo").unlink()
        log.write_text("")
        argv = [SHELL, "-c", command] if command else [SHELL, str(checkout / "scripts" / "install.sh"), *args]
        completed = subprocess.run(
            argv, cwd=checkout, capture_output=True, text=True,
            env={"PATH": str(bin_dir), "FAKE_UID": str(uid), **(env or {})},
        )
        return completed, log.read_text().splitlines()

    return run


def test_root_without_sudo_runs_apt_get_itself(machine):
    completed, calls = machine(uid=0, sudo=False)
    assert completed.returncode == 0, completed.stderr
    assert calls == ["apt-get update (uid 0)", f"{APT} (uid 0)", "python3 -m venv .venv",
                     "pip install .[test,mooncake]", "hisparse-demo"]


def test_a_user_with_sudo_gets_root_for_apt_get_only(machine):
    completed, calls = machine(uid=1000, sudo=True, env={"SGLANG": "0.5.17"})
    assert completed.returncode == 0, completed.stderr
    assert calls == ["sudo: apt-get", "apt-get update (uid 0)", "sudo: env", f"{APT} (uid 0)", "python3 -m venv .venv",
                     "pip install .[test,mooncake] sglang==0.5.17", "hisparse-demo"]


def test_a_user_without_sudo_is_told_what_to_do(machine):
    completed, calls = machine(uid=1000, sudo=False)
    assert completed.returncode == 1 and calls == []
    assert "run this script as root, or install sudo" in completed.stderr


def test_system_only_and_bad_arguments(machine):
    completed, calls = machine(uid=0, sudo=False, args=["--system-only"])
    assert completed.returncode == 0 and calls == ["apt-get update (uid 0)", f"{APT} (uid 0)"]
    completed, calls = machine(uid=0, sudo=False, args=["--everything"])
    assert completed.returncode == 2 and calls == [] and "usage" in completed.stderr


@pytest.mark.parametrize("uid, sudo", [(0, False), (0, True), (1000, True)])
def test_readme_one_liner(machine, uid, sudo):
    completed, calls = machine(uid=uid, sudo=sudo, command=ONE_LINER)
    assert completed.returncode == 0, completed.stderr
    apt = [call for call in calls if "apt-get" in call and not call.startswith("sudo")]
    assert apt == ["apt-get update (uid 0)", f"{APT} (uid 0)"]
    assert any(call.startswith("sudo") for call in calls) == (uid != 0)
    assert calls[-3:] == ["python3 -m venv .venv", "pip install .[test,mooncake]", "hisparse-demo"]


def test_readme_one_liner_without_root_or_sudo_stops_before_installing(machine):
    completed, calls = machine(uid=1000, sudo=False, command=ONE_LINER)
    assert completed.returncode != 0 and calls == []
    assert "sudo" in completed.stderr  # the shell's "sudo: not found"
