"""Debian packages and shared-library closure for the bundle's Mooncake part (used by build_bundle.py).

* reads .deb files without dpkg (an `ar` archive: control.tar.* and data.tar.*);
* downloads the pinned packages with `apt-get download NAME=VERSION` (Debian 12 build machine);
* reads DT_NEEDED of ELF files (64-bit little-endian: x86_64) without binutils;
* checks that every library the kept ELF files of a wheel need is in the wheel, in the packages, or
  on the GPU machine (GPU_MACHINE_SONAMES), so that a trimmed file or a missing package fails the
  build instead of the GPU run.
"""

from __future__ import annotations

import io
import re
import struct
import subprocess
import tarfile
import zipfile
from pathlib import Path

# What the GPU machine has without the bundle: glibc, the C++ runtime every Python/torch process
# loads, the NVIDIA driver (libcuda) and torch's CUDA runtime (pip nvidia-cuda-runtime for cu13; the
# harness puts <site-packages>/nvidia/cu13/lib on the PD servers' LD_LIBRARY_PATH).
GPU_MACHINE_SONAMES = frozenset({
    "libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1", "libresolv.so.2",
    "ld-linux-x86-64.so.2", "libstdc++.so.6", "libgcc_s.so.1", "libcuda.so.1", "libcudart.so.13",
})
LIB_DIR_RE = re.compile(r"^(?:\./)?(?:usr/)?lib/x86_64-linux-gnu/[^/]+$")


def read_pin_lines(path: Path, pattern: str, what: str) -> list[tuple[str, str]]:
    """(name, version) of every line of a pin file (`#` starts a comment); `pattern` has both as groups."""
    pins = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(pattern, line)
        if not m:
            raise SystemExit(f"{path}: not {what}: {raw!r}")
        pins.append((m.group(1), m.group(2)))
    return pins


def read_deb_pins(path: Path) -> list[tuple[str, str]]:
    return read_pin_lines(path, r"([a-z0-9][a-z0-9+.-]*)=([A-Za-z0-9.+~:-]+)", "NAME=VERSION")


def ar_members(data: bytes) -> dict[str, bytes]:
    """Members of an `ar` archive (a .deb) by name."""
    if not data.startswith(b"!<arch>\n"):
        raise ValueError("not an ar archive")
    out, pos = {}, 8
    while pos + 60 <= len(data):
        head = data[pos:pos + 60]
        name = head[:16].decode().strip().rstrip("/")
        size = int(head[48:58].decode().strip())
        out[name] = data[pos + 60:pos + 60 + size]
        pos += 60 + size + (size & 1)
    return out


def _tar_of(members: dict[str, bytes], stem: str) -> tarfile.TarFile:
    name = next((n for n in members if n.startswith(stem + ".tar")), None)
    if name is None:
        raise ValueError(f"no {stem}.tar.* in the package")
    if name.endswith(".zst"):
        raise ValueError(f"{name}: zstd-compressed members are not supported (Debian 12 uses xz)")
    return tarfile.open(fileobj=io.BytesIO(members[name]), mode="r:*")


def deb_fields(path: Path) -> dict[str, str]:
    """The control fields of a .deb (Package, Version, Source, Depends, ...)."""
    with _tar_of(ar_members(path.read_bytes()), "control") as tf:
        member = next(m for m in tf.getmembers() if m.name.lstrip("./") == "control")
        text = tf.extractfile(member).read().decode()
    fields, key = {}, None
    for line in text.splitlines():
        if line[:1] in (" ", "\t") and key:
            fields[key] += "\n" + line.strip()
        elif ":" in line:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def deb_libraries(path: Path) -> dict[str, bytes | str]:
    """Files and symlinks directly in (usr/)lib/x86_64-linux-gnu of a .deb: name -> bytes, or the link
    target (str) for a symlink."""
    out = {}
    with _tar_of(ar_members(path.read_bytes()), "data") as tf:
        for m in tf.getmembers():
            if not LIB_DIR_RE.match(m.name):
                continue
            base = m.name.rsplit("/", 1)[1]
            if m.issym():
                out[base] = m.linkname
            elif m.isfile():
                out[base] = tf.extractfile(m).read()
    return out


def find_debs(deb_dir: Path, pins: list[tuple[str, str]]) -> tuple[dict[str, Path], list[str]]:
    have = {}
    for p in sorted(deb_dir.glob("*.deb")):
        f = deb_fields(p)
        have[(f["Package"], f["Version"])] = p
    found, missing = {}, []
    for name, version in pins:
        if (name, version) in have:
            found[name] = have[(name, version)]
        else:
            missing.append(f"{name}={version}")
    return found, missing


def download_debs(pins: list[tuple[str, str]], deb_dir: Path, log) -> None:
    deb_dir.mkdir(parents=True, exist_ok=True)
    _, missing = find_debs(deb_dir, pins)
    if not missing:
        log(f"[debs] all {len(pins)} packages already in {deb_dir}")
        return
    log(f"[debs] apt-get download {' '.join(missing)}")
    try:
        subprocess.run(["apt-get", "download", *missing], cwd=deb_dir, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"[debs] apt-get download failed ({e}); build on Debian 12 (bookworm) amd64 with its "
                         f"package lists (apt-get update), or update {len(missing)} pin(s) to `apt-cache policy` "
                         "versions") from e
    _, missing = find_debs(deb_dir, pins)
    if missing:
        raise SystemExit(f"[debs] still missing after apt-get download: {missing}")


def elf_needed(data: bytes) -> list[str] | None:
    """DT_NEEDED of a 64-bit little-endian ELF file; None if `data` is not one."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    loads, dynamic = [], None
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz, _, _ = struct.unpack_from("<IIQQQQQQ", data, phoff + i * phentsize)
        if p_type == 1:  # PT_LOAD
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == 2:  # PT_DYNAMIC
            dynamic = (p_offset, p_filesz)
    if dynamic is None:
        return []
    needed, strtab = [], None
    for i in range(dynamic[1] // 16):
        tag, val = struct.unpack_from("<qQ", data, dynamic[0] + 16 * i)
        if tag == 0:  # DT_NULL
            break
        if tag == 1:  # DT_NEEDED
            needed.append(val)
        elif tag == 5:  # DT_STRTAB (a virtual address)
            strtab = val
    base = next(o + strtab - v for v, o, size in loads if v <= strtab < v + size)
    return [data[base + n:data.index(b"\0", base + n)].decode() for n in needed]


def check_closure(wheel_bytes: bytes, wheel_name: str, debs: list[Path]) -> dict:
    """Every DT_NEEDED of every ELF file in the (trimmed) wheel and of every library of the packages is
    provided by the wheel, the packages or GPU_MACHINE_SONAMES; raises SystemExit naming what is not.
    Returns {soname: provider} of what the wheel needs from outside itself."""
    elves, in_wheel = {}, set()
    with zipfile.ZipFile(io.BytesIO(wheel_bytes)) as z:
        for info in z.infolist():
            base = info.filename.rsplit("/", 1)[-1]
            in_wheel.add(base)
            needed = elf_needed(z.read(info.filename))
            if needed is not None:
                elves[f"{wheel_name}:{info.filename}"] = needed
    provided_by_debs = {}
    for deb in debs:
        for base, content in deb_libraries(deb).items():
            provided_by_debs[base] = deb.name
            if isinstance(content, bytes):
                needed = elf_needed(content)
                if needed is not None:
                    elves[f"{deb.name}:{base}"] = needed
    missing, external = [], {}
    for owner, needed in sorted(elves.items()):
        for soname in needed:
            if soname in in_wheel and owner.startswith(wheel_name):
                continue
            provider = provided_by_debs.get(soname) or ("GPU machine" if soname in GPU_MACHINE_SONAMES else None)
            if provider is None:
                missing.append(f"{owner} needs {soname}")
            elif owner.startswith(wheel_name):
                external[soname] = provider
    if missing:
        raise SystemExit("the Mooncake part would not load on the GPU machine:\n  " + "\n  ".join(missing)
                         + "\nadd the Debian package that has it to bundle_mooncake_debs.txt, keep the file in the "
                           "wheel (STRIP_RULES) or, if every GPU image has it, add it to GPU_MACHINE_SONAMES")
    return external
