"""Selftest of the bundle's Mooncake part (called by selftest.py with its `check`).

bundle_checks: the ELF and .deb readers and the closure check on a package built here with dpkg-deb.
part2_checks (opt-in, --part2 and --py312): install_part.sh installs a built part 2 into temp dirs, once
linking only what this machine lacks and once as if it had none of the libraries, and mooncake_check.py
imports the CUDA 13 engine (a stub libcuda.so.1 stands in for the driver), initialises two engines over
TCP and writes between them.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# tools/gpu-bundle/bundle_debs.py, on sys.path by selftest.py
from bundle_debs import check_closure, deb_fields, deb_libraries, elf_needed, find_debs, read_deb_pins

REPO = Path(__file__).resolve().parents[2]
BUNDLE = REPO / "tools" / "gpu-bundle"  # the builder, its pins and install_part.sh
E2E = REPO / "benchmarks" / "e2e"  # the harness, whose mooncake_check.py runs on the GPU machine
SYSTEM_LIB = Path("/usr/lib/x86_64-linux-gnu")


def build_deb(root: Path, package: str, source: str, files: dict[str, bytes], links: dict[str, str]) -> Path:
    tree = root / package
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "DEBIAN" / "control").write_text(
        f"Package: {package}\nSource: {source}\nVersion: 1.0-1\nArchitecture: amd64\nMaintainer: selftest <x@y>\n"
        "Description: selftest package\n")
    libdir = tree / "usr/lib/x86_64-linux-gnu"
    libdir.mkdir(parents=True)
    for name, data in files.items():
        (libdir / name).write_bytes(data)
    for name, target in links.items():
        os.symlink(target, libdir / name)
    out = root / f"{package}_1.0-1_amd64.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zxz", "--build", str(tree), str(out)], check=True,
                   capture_output=True)
    return out


def bundle_checks(check) -> None:
    ls_needed = elf_needed(Path("/bin/ls").read_bytes())
    check(ls_needed is not None and "libc.so.6" in ls_needed, f"DT_NEEDED of /bin/ls: {ls_needed}")
    check(elf_needed(b"#!/bin/sh\n") is None, "not an ELF file")
    p11 = SYSTEM_LIB / "libp11-kit.so.0"
    if not shutil.which("dpkg-deb") or not p11.exists():
        print("bundle checks of .deb files skipped: no dpkg-deb or no libp11-kit.so.0 here")
        return
    p11_needed = elf_needed(p11.read_bytes())
    check("libffi.so.8" in p11_needed, f"libp11-kit needs libffi: {p11_needed}")
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        ffi = (SYSTEM_LIB / "libffi.so.8").resolve().read_bytes()
        deb = build_deb(td, "libfake-ffi8", "fakeffi", {"libffi.so.8.1.2": ffi}, {"libffi.so.8": "libffi.so.8.1.2"})
        fields = deb_fields(deb)
        libs = deb_libraries(deb)
        check(fields["Package"] == "libfake-ffi8" and fields["Source"] == "fakeffi" and fields["Version"] == "1.0-1",
              f"control fields of a .deb: {fields}")
        check(libs.get("libffi.so.8") == "libffi.so.8.1.2" and libs.get("libffi.so.8.1.2") == ffi,
              f"libraries of a .deb: {sorted(libs)}")
        found, missing = find_debs(td, [("libfake-ffi8", "1.0-1"), ("libfake-ffi8", "2.0-1")])
        check(found == {"libfake-ffi8": deb} and missing == ["libfake-ffi8=2.0-1"], f"find_debs {found} {missing}")
        wheel = io.BytesIO()
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr("pkg/engine.so", p11.resolve().read_bytes())  # needs libffi.so.8 and glibc
            z.writestr("pkg/__init__.py", "")
        external = check_closure(wheel.getvalue(), "fake.whl", [deb])
        check(external.get("libffi.so.8") == deb.name and external.get("libc.so.6") == "GPU machine",
              f"closure: libffi from the package, libc from the GPU machine: {external}")
        try:
            check_closure(wheel.getvalue(), "fake.whl", [])
            check(False, "closure without the package must fail")
        except SystemExit as e:
            check("fake.whl:pkg/engine.so needs libffi.so.8" in str(e), f"closure failure names the library: {e}")
    pins = read_deb_pins(BUNDLE / "bundle_mooncake_debs.txt")
    names = {name for name, _ in pins}
    check({"libibverbs1", "ibverbs-providers", "libnuma1", "libcurl4"} <= names and len(names) == len(pins),
          f"Mooncake packages pinned once each: {sorted(names)}")


def stub_libcuda(engine_so: Path, out_dir: Path) -> bool:
    """A libcuda.so.1 defining every cu* symbol engine.so imports, each returning 100 (no device)."""
    nm = subprocess.run(["nm", "-D", "--undefined-only", str(engine_so)], capture_output=True, text=True).stdout
    symbols = sorted({w.split("@")[0] for w in nm.split() if w.startswith("cu") and w[2:3].isupper()})
    (out_dir / "stub.c").write_text("".join(f"int {s}(void){{return 100;}}\n" for s in symbols))
    return subprocess.run(["cc", "-shared", "-fPIC", "-o", str(out_dir / "libcuda.so.1"), str(out_dir / "stub.c"),
                           "-Wl,-soname,libcuda.so.1"]).returncode == 0


def part2_checks(check, part: Path, py312: str, cudart_dir: str | None) -> None:
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        site = td / "site"
        (site / "sglang").mkdir(parents=True)  # part 2 REQUIRES part 1's sglang
        env = dict(os.environ, SITE=str(site), PY=py312, COMPILE="0")
        p = subprocess.run(["bash", str(BUNDLE / "install_part.sh"), str(part)], env=dict(env, SITE=str(td / "empty")),
                           capture_output=True, text=True)
        check(p.returncode != 0 and "needs 'sglang'" in p.stderr, f"part 2 refused without part 1: {p.stderr[-300:]}")
        stub = td / "stub"
        stub.mkdir()
        for mode, extra in (("lacking", {}), ("none", {"SYSLIB_DIRS": str(td / "nothing"), "LDCONFIG": "0", "FORCE": "1"})):
            syslibs = td / f"sys-{mode}"
            p = subprocess.run(["bash", str(BUNDLE / "install_part.sh"), str(part)],
                               env=dict(env, SYSLIBS=str(syslibs), **extra), capture_output=True, text=True)
            print(p.stdout[-1500:], p.stderr[-1500:], sep="\n")
            check(p.returncode == 0 and (site / "mooncake" / "engine.so").exists(), f"part 2 installs ({mode}): {p.stderr[-500:]}")
            if mode == "lacking" and not stub_libcuda(site / "mooncake" / "engine.so", stub):
                print("part 2 checks: no C compiler for the stub libcuda")
                return
            ld = [str(syslibs / "lib"), str(stub)] + ([cudart_dir] if cudart_dir else [])
            p = subprocess.run([py312, str(E2E / "mooncake_check.py")], capture_output=True, text=True, timeout=120,
                               env=dict(os.environ, PYTHONPATH=str(site), LD_LIBRARY_PATH=os.pathsep.join(ld),
                                        MC_FORCE_TCP="1", MC_LOG_LEVEL="ERROR"))
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("MOONCAKE_JSON=")), "MOONCAKE_JSON={}")
            res = json.loads(line.split("=", 1)[1])
            print(f"mooncake_check ({mode}):", {k: res.get(k) for k in ("ok", "version", "initialize_rc", "host_to_host", "loaded")})
            loaded = res.get("loaded") or {}
            check(p.returncode == 0 and res.get("ok") and res.get("version") == "0.3.14"
                  and str(syslibs) in loaded.get("libmlx5.so", "") and str(syslibs) in loaded.get("libibverbs.so", ""),
                  f"the CUDA 13 engine imports and writes over TCP ({mode}): {res} {p.stderr[-800:]}")
            if mode == "none":
                check(str(syslibs) in loaded.get("libcurl.so", ""), f"with no system copies, libcurl is the bundle's: {loaded}")


def default_cudart_dir(python: str) -> str | None:
    """<site-packages>/nvidia/cu13/lib of `python` if it holds libcudart.so.13."""
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True).stdout.strip()
    d = Path(purelib) / "nvidia" / "cu13" / "lib"
    return str(d) if (d / "libcudart.so.13").exists() else None


if __name__ == "__main__":
    sys.exit("run tools/e2e-selftest/selftest.py (it calls these checks)")
