#!/usr/bin/env python3
"""Build the offline SGLang 0.5.17 bundle for the GPU machine (run on a machine with PyPI access).

    python3 tools/gpu-bundle/build_bundle.py          # -> .e2e/parts/part{1,2}.tar.xz (+ .sha256, SHA256SUMS)

Two groups of items, each packed into parts of its own:
  * SGLang 0.5.17 and what it needs (bundle_requirements.txt) -> part1;
  * the Mooncake part (bundle_mooncake_requirements.txt: the CUDA 13 build of the Mooncake transfer
    engine, trimmed to `mooncake.engine`; bundle_mooncake_debs.txt: the Debian 12 packages of the
    system libraries it needs) -> part2, for PD disaggregation (--no-mooncake leaves it out).  Before
    packing, bundle_debs.check_closure() checks that every library the kept ELF files need is in the
    wheel, in the packages or on the GPU machine.  part2 carries a REQUIRES file: install_part.sh
    refuses it on a machine without part 1's sglang.

What it does:
  1. `pip download`s the cp312 manylinux x86_64 wheels pinned in bundle_requirements.txt into a cache
     (default ~/.cache/hisparse-sglang-e2e/wheels; nothing is downloaded twice);
  2. transforms them (STRIP_RULES below): drops files the server path never loads from the sglang and
     xgrammar wheels (RECORD rewritten), turns sglang-kernel into a trimmed tree (sm90 common ops +
     flashmla ops, dist-info kept so `importlib.metadata.version("sglang-kernel")` still works), and
     re-zips every wheel with ZIP_STORED so that the outer xz sees the raw bytes (xz over deflate
     gains nothing; xz over stored content shrinks the bundle from ~140 MiB to ~50 MiB);
  3. compresses every item once (one xz stream per item, in parallel), packs the items into the
     fewest parts of at most --max-part-mib by first-fit decreasing on the exact stream sizes, and
     writes each part as a concatenation of xz streams whose decompressed bytes form ONE valid tar
     archive (`tar -xJf`/`xz -d` and Python's tarfile all read concatenated xz streams);
  4. writes SHA256SUMS + partN.tar.xz.sha256 and prints a size table.

Every part holds `e2e-bundle/` with `wheels/`, `trees/<tree>/<top-level entries>`, `debs/`, `PART`,
`MANIFEST.txt`, a per-file `SHA256SUMS` and, for part2, `REQUIRES`; tools/gpu-bundle/install_part.sh installs one
part into /tmp/site on the GPU machine.  The output is byte-for-byte reproducible for the same wheels and options (fixed mtimes and
owners, sorted entries, single-threaded xz).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import json
import lzma
import os
import re
import subprocess
import sys
import tarfile
import time
import zipfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from bundle_debs import check_closure, download_debs, find_debs, read_deb_pins, read_pin_lines

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DEFAULT_REQS = HERE / "bundle_requirements.txt"
MOONCAKE_REQS = HERE / "bundle_mooncake_requirements.txt"
MOONCAKE_DEBS = HERE / "bundle_mooncake_debs.txt"
MOONCAKE_REQUIRES = "sglang\n"  # top-level packages of part 1 the Mooncake part is useless without
DEFAULT_OUT = REPO / ".e2e" / "parts"
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hisparse-sglang-e2e"
# The builder each part's MANIFEST.txt names: its path before it moved to tools/gpu-bundle/ (issue #29),
# kept so that a rebuild from the same wheels stays byte-identical to the parts already built and carried.
MANIFEST_BUILDER = "benchmarks/e2e/build_bundle.py"

MIB = 1 << 20
FIXED_MTIME = 315532800  # 1980-01-01, the earliest time a zip entry can carry
ZIP_DATE = (1980, 1, 1, 0, 0, 0)
PLATFORMS = [
    "manylinux_2_34_x86_64",  # the sglang 0.5.17 cp312 wheel is tagged manylinux_2_34
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_26_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_5_x86_64",
    "manylinux1_x86_64",
]

# ----------------------------------------------------------------------------------------------
# What is removed, and why.  Patterns are regular expressions matched against the archive path.
# ----------------------------------------------------------------------------------------------
STRIP_RULES: dict[str, list[tuple[str, str]]] = {
    "sglang": [
        # Rust extensions: imported only with SGLANG_RUST_SERVER, --grpc-port or
        # SGLANG_INKLING_RS_MM_PREPROCESS (never on this path); they are also the only content
        # that needs glibc >= 2.34.
        (r"^sglang/srt/(server|grpc|multimodal)/_core\.[^/]*\.so$", "Rust extension, not imported"),
    ],
    "xgrammar": [
        (r"^xgrammar/lib/libxgrammar\.a$", "static library for C++ linking, never loaded"),
    ],
    # SGLang 0.5.17's PD connector imports only `mooncake.engine` (TransferEngine); the rest serves
    # Mooncake Store, its EP / process-group backends (elastic EP) and command-line tools.
    # bundle_debs.check_closure() proves that nothing kept needs a dropped file.
    "mooncake-transfer-engine-cuda13": [
        (r"^mooncake/(mooncake_master|mooncake_client|transfer_engine_bench)$", "Mooncake Store / benchmark executables"),
        (r"^mooncake/_store\.[^/]*\.so$", "Mooncake Store binding (mooncake.store)"),
        (r"^mooncake/(_ep\.[^/]*|libmooncake_ep_device)\.so$", "Mooncake EP (expert-parallel buffers)"),
        (r"^mooncake/libmooncake_pg(_device)?\.so$", "Mooncake process group (torch distributed backend)"),
        (r"^mooncake_transfer_engine_cuda13\.libs/lib(etcd_wrapper|crypto|zstd|xxhash|zmq|uring|unwind|sodium|pgm-5|asio)-",
         "vendored libraries of the dropped binaries only (engine.so loads mooncake/libasio.so and libetcd_wrapper.so)"),
    ],
}
# sglang-kernel becomes a tree: everything except these files.
SGL_KERNEL_DROP = [
    (r"^sgl_kernel/flash_ops\.abi3\.so$",
     "FA3 (1.1 GB); loaded lazily by the dense-MHA prefill path only, which "
     "SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD=0 avoids"),
    (r"^sgl_kernel/infllm_ops\.[^/]*\.so$", "InfLLM-v2 attention only (lazy loader)"),
    (r"^sgl_kernel/sm100/", "Blackwell build; cc 9.0 loads sgl_kernel/sm90/common_ops"),
]
TREE_DISTS = {"sglang-kernel": "sgl_kernel_trim"}
# Top directory inside every part.  It does not depend on the part number, so every item is
# compressed exactly once and a part is just the concatenation of its items' xz streams.
TOP = "e2e-bundle"


def norm_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def log(msg: str) -> None:
    print(msg, flush=True)


def read_pins(path: Path) -> list[tuple[str, str]]:
    pins = read_pin_lines(path, r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)", "an exact pin")
    names = [norm_name(n) for n, _ in pins]
    dups = {n for n in names if names.count(n) > 1}
    if dups:
        raise SystemExit(f"{path}: pinned twice: {sorted(dups)}")
    return pins


def wheel_dist_version(filename: str) -> tuple[str, str]:
    parts = filename[:-4].split("-")
    return norm_name(parts[0]), parts[1]


def find_wheels(wheel_dir: Path, pins: list[tuple[str, str]]) -> tuple[dict[str, Path], list[str]]:
    by_key: dict[tuple[str, str], list[Path]] = {}
    for p in wheel_dir.glob("*.whl"):
        by_key.setdefault(wheel_dist_version(p.name), []).append(p)
    found, missing = {}, []
    for name, ver in pins:
        cands = by_key.get((norm_name(name), ver), [])
        if not cands:
            missing.append(f"{name}=={ver}")
        else:
            # prefer a cp312 / abi3 build over a generic one if both are cached
            found[norm_name(name)] = sorted(cands, key=lambda p: ("cp312" not in p.name, p.name))[0]
    return found, missing


def download(pins: list[tuple[str, str]], wheel_dir: Path, python: str) -> None:
    wheel_dir.mkdir(parents=True, exist_ok=True)
    _, missing = find_wheels(wheel_dir, pins)
    if not missing:
        log(f"[download] all {len(pins)} wheels already in {wheel_dir}")
        return
    log(f"[download] {len(missing)} wheel(s) missing from {wheel_dir}: {' '.join(missing)}")
    cmd = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--python-version", "3.12", "--implementation", "cp",
           "--abi", "cp312", "--abi", "abi3", "--abi", "none", "-d", str(wheel_dir)]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    cmd += missing
    log("[download] " + " ".join(cmd))
    subprocess.run(cmd, check=True)
    _, missing = find_wheels(wheel_dir, pins)
    if missing:
        raise SystemExit(f"[download] still missing after pip download: {missing}")


# ----------------------------------------------------------------------------------------------
# Items: one wheel (wheels/<file>.whl) or one tree (trees/<name>/...) each, turned into tar bytes.
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Item:
    key: str            # normalised dist name, or the Debian package name
    version: str
    kind: str           # "wheel" | "tree" | "deb"
    label: str          # wheel file name, tree name or .deb file name
    raw_bytes: int = 0  # uncompressed payload (stored wheel or sum of tree files)
    xz_bytes: int = 0
    stream: bytes = b""  # xz stream of this item's tar members (under TOP/)
    sums: list = dataclasses.field(default_factory=list)  # [(relpath in part, sha256)]
    dropped: list = dataclasses.field(default_factory=list)  # [(path, size, why)]
    wheel_bytes: int = 0  # size of the wheel as downloaded
    tar_bytes: int = 0    # length of the uncompressed tar members


def tar_member(name: str, data: bytes | None, mode: int = 0o644) -> bytes:
    info = tarfile.TarInfo(name)
    info.mtime = FIXED_MTIME
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    if data is None:
        info.type = tarfile.DIRTYPE
        info.mode = 0o755
        return info.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape")
    info.size = len(data)
    info.mode = mode
    head = info.tobuf(tarfile.GNU_FORMAT, "utf-8", "surrogateescape")
    pad = (-len(data)) % tarfile.BLOCKSIZE
    return head + data + b"\0" * pad


def rewrite_record(record: bytes, removed: set[str]) -> bytes:
    out = []
    for line in record.decode("utf-8").splitlines(keepends=True):
        path = line.split(",", 1)[0]
        if path not in removed:
            out.append(line)
    return "".join(out).encode("utf-8")


def repack_wheel(src: Path, rules: list[tuple[str, str]]) -> tuple[bytes, list]:
    """Return (stored-zip bytes, dropped) with files matching rules removed and RECORD rewritten."""
    regs = [(re.compile(p), why) for p, why in rules]
    dropped, removed = [], set()
    with zipfile.ZipFile(src) as zin:
        infos = sorted(zin.infolist(), key=lambda i: i.filename)
        for i in infos:
            for rx, why in regs:
                if rx.search(i.filename):
                    dropped.append((i.filename, i.file_size, why))
                    removed.add(i.filename)
                    break
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zout:
            for i in infos:
                if i.filename in removed or i.is_dir():
                    continue
                data = zin.read(i.filename)
                if removed and re.fullmatch(r"[^/]+\.dist-info/RECORD", i.filename):
                    data = rewrite_record(data, removed)
                zi = zipfile.ZipInfo(i.filename, ZIP_DATE)
                zi.external_attr = i.external_attr
                zi.create_system = 3
                zi.compress_type = zipfile.ZIP_STORED
                zout.writestr(zi, data)
    return buf.getvalue(), dropped


def tree_from_wheel(src: Path, drop: list[tuple[str, str]]) -> tuple[list, list]:
    """Return ([(relpath, bytes, mode)], dropped) of the wheel's files minus `drop`."""
    regs = [(re.compile(p), why) for p, why in drop]
    files, dropped, removed = [], [], set()
    with zipfile.ZipFile(src) as zin:
        infos = sorted(zin.infolist(), key=lambda i: i.filename)
        for i in infos:
            if i.is_dir():
                continue
            hit = next((why for rx, why in regs if rx.search(i.filename)), None)
            if hit:
                dropped.append((i.filename, i.file_size, hit))
                removed.add(i.filename)
        for i in infos:
            if i.is_dir() or i.filename in removed:
                continue
            if i.filename.split("/", 1)[0].endswith(".data"):
                raise SystemExit(f"{src.name}: .data/ entries are not supported in a tree: {i.filename}")
            data = zin.read(i.filename)
            if re.fullmatch(r"[^/]+\.dist-info/RECORD", i.filename):
                data = rewrite_record(data, removed)
            mode = (i.external_attr >> 16) & 0o777 or 0o644
            files.append((i.filename, data, mode))
    # installed-by marker, as pip writes it
    dist_info = next(f for f, _, _ in files if f.endswith(".dist-info/METADATA")).rsplit("/", 1)[0]
    if not any(f == f"{dist_info}/INSTALLER" for f, _, _ in files):
        files.append((f"{dist_info}/INSTALLER", b"hisparse-e2e-bundle\n", 0o644))
        files.sort(key=lambda t: t[0])
    return files, dropped


ITEM_FORMAT = 1  # bump when the item layout changes (invalidates the item cache)


def item_cache_key(key: str, wheel_path: Path, preset: int) -> str:
    h = hashlib.sha256()
    h.update(json.dumps([ITEM_FORMAT, TOP, key, preset, STRIP_RULES.get(key, []),
                         SGL_KERNEL_DROP if key in TREE_DISTS else None, TREE_DISTS.get(key),
                         FIXED_MTIME]).encode())
    h.update(sha256_file(wheel_path).encode())
    return h.hexdigest()[:32]


def build_item(args: tuple) -> Item:
    """Transform one wheel (or take one .deb as it is) and compress it; results are cached in <cache-dir>/items/."""
    key, version, wheel_path, preset, cache_dir = args
    wheel_path = Path(wheel_path)
    ck = item_cache_key(key, wheel_path, preset)
    cdir = Path(cache_dir) / "items" if cache_dir else None
    if cdir and (cdir / f"{ck}.json").exists() and (cdir / f"{ck}.xz").exists():
        meta = json.loads((cdir / f"{ck}.json").read_text())
        item = Item(**meta)
        item.stream = (cdir / f"{ck}.xz").read_bytes()
        if len(item.stream) == item.xz_bytes:
            return item
    item = _build_item(key, version, wheel_path, preset)
    if cdir:
        cdir.mkdir(parents=True, exist_ok=True)
        (cdir / f"{ck}.xz.tmp").write_bytes(item.stream)
        os.replace(cdir / f"{ck}.xz.tmp", cdir / f"{ck}.xz")
        meta = {k: v for k, v in dataclasses.asdict(item).items() if k != "stream"}
        (cdir / f"{ck}.json").write_text(json.dumps(meta))
    return item


def _build_item(key: str, version: str, wheel_path: Path, preset: int) -> Item:
    if wheel_path.suffix == ".deb":
        data = wheel_path.read_bytes()
        item = Item(key, version, "deb", wheel_path.name)
        chunks = [tar_member(f"{TOP}/debs/{wheel_path.name}", data)]
        sums = [(f"debs/{wheel_path.name}", hashlib.sha256(data).hexdigest())]
        item.raw_bytes = len(data)
    elif key in TREE_DISTS:
        tree = TREE_DISTS[key]
        files, dropped = tree_from_wheel(wheel_path, SGL_KERNEL_DROP)
        item = Item(key, version, "tree", tree, dropped=dropped)
        chunks, sums = [], []
        dirs_done = set()
        for rel, data, mode in files:
            for d in _parents(f"trees/{tree}/{rel}"):
                if d not in dirs_done:
                    dirs_done.add(d)
                    chunks.append(tar_member(f"{TOP}/{d}", None))
            chunks.append(tar_member(f"{TOP}/trees/{tree}/{rel}", data, mode))
            sums.append((f"trees/{tree}/{rel}", hashlib.sha256(data).hexdigest()))
            item.raw_bytes += len(data)
    else:
        data, dropped = repack_wheel(wheel_path, STRIP_RULES.get(key, []))
        item = Item(key, version, "wheel", wheel_path.name, dropped=dropped)
        chunks = [tar_member(f"{TOP}/wheels/{wheel_path.name}", data)]
        sums = [(f"wheels/{wheel_path.name}", hashlib.sha256(data).hexdigest())]
        item.raw_bytes = len(data)
    item.wheel_bytes = wheel_path.stat().st_size
    item.sums = sums
    item.stream = lzma.compress(b"".join(chunks), format=lzma.FORMAT_XZ, preset=preset)
    item.xz_bytes = len(item.stream)
    item.tar_bytes = sum(len(c) for c in chunks)
    return item


def _parents(path: str) -> list[str]:
    parts = path.split("/")[:-1]
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def pack(items: list[Item], capacity: int) -> list[list[Item]]:
    """First-fit decreasing bin packing on the per-item compressed sizes."""
    bins: list[list[Item]] = []
    loads: list[int] = []
    for it in sorted(items, key=lambda i: (-i.xz_bytes, i.key)):
        if it.xz_bytes > capacity:
            raise SystemExit(f"{it.label}: {it.xz_bytes / MIB:.2f} MiB compressed alone exceeds the "
                             f"part capacity {capacity / MIB:.2f} MiB; strip it further")
        for b, load in enumerate(loads):
            if load + it.xz_bytes <= capacity:
                bins[b].append(it)
                loads[b] += it.xz_bytes
                break
        else:
            bins.append([it])
            loads.append(it.xz_bytes)
    for b in bins:
        b.sort(key=lambda i: i.key)
    return bins


def part_tail(part: str, nparts: int, items: list[Item], tar_len_so_far: int, requires: str = "") -> bytes:
    manifest = [f"# {part} of {nparts}: built by {MANIFEST_BUILDER}",
                "# kind\tname\tversion\tfile\traw_bytes"]
    for it in items:
        manifest.append(f"{it.kind}\t{it.key}\t{it.version}\t{it.label}\t{it.raw_bytes}")
        for path, size, why in it.dropped:
            manifest.append(f"#   dropped {path} ({size} bytes): {why}")
    sums = [f"{h}  {p}" for it in items for p, h in it.sums]
    body = tar_member(f"{TOP}/PART", f"{part} {nparts}\n".encode())
    body += tar_member(f"{TOP}/MANIFEST.txt", ("\n".join(manifest) + "\n").encode())
    body += tar_member(f"{TOP}/SHA256SUMS", ("\n".join(sums) + "\n").encode())
    if requires:
        body += tar_member(f"{TOP}/REQUIRES", requires.encode())
    total = tar_len_so_far + len(body) + 2 * tarfile.BLOCKSIZE
    pad = (-total) % tarfile.RECORDSIZE
    return body + b"\0" * (2 * tarfile.BLOCKSIZE + pad)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_part(path: Path, items: list[Item]) -> int:
    """Decompress + list the part with Python's tarfile; check every per-file checksum."""
    expected = {f"{TOP}/{p}": h for it in items for p, h in it.sums}
    seen = 0
    with tarfile.open(path, mode="r:xz") as tf:
        for m in tf:
            if m.isfile() and m.name in expected:
                h = hashlib.sha256(tf.extractfile(m).read()).hexdigest()
                if h != expected[m.name]:
                    raise SystemExit(f"{path}: checksum mismatch for {m.name}")
                seen += 1
    if seen != len(expected):
        raise SystemExit(f"{path}: {len(expected) - seen} file(s) missing from the archive")
    return seen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requirements", type=Path, default=DEFAULT_REQS)
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE,
                    help="download cache (wheels/ below it); default %(default)s")
    ap.add_argument("--wheel-dir", type=Path, default=None,
                    help="use these wheels instead of <cache-dir>/wheels")
    ap.add_argument("--out-dir", type=Path, default=DEFAULT_OUT, help="default %(default)s")
    ap.add_argument("--max-part-mib", type=float, default=55.0)
    ap.add_argument("--xz-preset", type=int, default=6, choices=range(0, 10))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--no-download", action="store_true", help="fail instead of downloading")
    ap.add_argument("--no-verify", action="store_true", help="skip re-reading the written parts")
    ap.add_argument("--no-item-cache", action="store_true",
                    help="recompress every item (default: reuse <cache-dir>/items/ keyed by wheel hash + rules)")
    ap.add_argument("--pip-python", default=sys.executable, help="python whose pip downloads")
    ap.add_argument("--report-json", type=Path, default=None, help="also write the size table as JSON")
    ap.add_argument("--no-mooncake", action="store_true", help="build part 1 only (no Mooncake part)")
    ap.add_argument("--mooncake-requirements", type=Path, default=MOONCAKE_REQS)
    ap.add_argument("--mooncake-debs", type=Path, default=MOONCAKE_DEBS,
                    help="Debian packages of the Mooncake part, downloaded to <cache-dir>/debs")
    args = ap.parse_args(argv)

    t0 = time.time()
    pins = read_pins(args.requirements)
    mooncake_pins = [] if args.no_mooncake else read_pins(args.mooncake_requirements)
    deb_pins = [] if args.no_mooncake else read_deb_pins(args.mooncake_debs)
    wheel_dir = args.wheel_dir or (args.cache_dir / "wheels")
    deb_dir = args.cache_dir / "debs"
    if not args.no_download:
        download(pins + mooncake_pins, wheel_dir, args.pip_python)
        if deb_pins:
            download_debs(deb_pins, deb_dir, log)
    wheels, missing = find_wheels(wheel_dir, pins + mooncake_pins)
    if missing:
        raise SystemExit(f"missing wheels in {wheel_dir}: {missing}")
    debs, missing = find_debs(deb_dir, deb_pins) if deb_pins else ({}, [])
    if missing:
        raise SystemExit(f"missing packages in {deb_dir}: {missing}")

    # 1) the Mooncake part must load on the GPU machine: check before compressing anything
    for name, _ in mooncake_pins:
        wheel = wheels[norm_name(name)]
        stored, _ = repack_wheel(wheel, STRIP_RULES.get(norm_name(name), []))
        external = check_closure(stored, wheel.name, list(debs.values()))
        log(f"[closure] {wheel.name}: every library its kept ELF files need is provided: "
            + ", ".join(f"{k} ({v})" for k, v in sorted(external.items())))

    # 2) transform + measure every item (parallel)
    jobs = [(norm_name(n), v, str(wheels[norm_name(n)]), args.xz_preset) for n, v in pins + mooncake_pins]
    jobs += [(name, version, str(debs[name]), args.xz_preset) for name, version in deb_pins]
    log(f"[build] transforming + compressing {len(jobs)} items with {args.jobs} job(s), xz preset {args.xz_preset}")
    item_cache = None if args.no_item_cache else str(args.cache_dir)
    items: list[Item] = []
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as ex:
        for it in ex.map(build_item, [job + (item_cache,) for job in jobs], chunksize=1):
            items.append(it)
            log(f"[build]   {it.label[:60]:60s} raw {it.raw_bytes / MIB:7.2f} MiB -> xz {it.xz_bytes / MIB:6.2f} MiB")

    # 3) pack each group into its own parts: item streams are final, only the small head/tail
    #    streams (< 64 KiB) are added
    cap = int(args.max_part_mib * MIB)
    bins = [(b, "") for b in pack(items[:len(pins)], cap - 64 * 1024)]
    if len(items) > len(pins):
        bins += [(b, MOONCAKE_REQUIRES) for b in pack(items[len(pins):], cap - 64 * 1024)]

    # 4) write parts: head stream + the items' xz streams + tail stream (MANIFEST, SHA256SUMS, REQUIRES, end blocks)
    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("part*.tar*")) + [out / "SHA256SUMS"]:
        if stale.exists():
            stale.unlink()
    part_rows = []
    sums_lines = []
    for idx, (b, requires) in enumerate(bins, start=1):
        part = f"part{idx}"
        folders = [TOP, f"{TOP}/wheels", f"{TOP}/trees"] + ([f"{TOP}/debs"] if any(it.kind == "deb" for it in b) else [])
        head = b"".join(tar_member(name, None) for name in folders)
        tail = part_tail(part, len(bins), b, len(head) + sum(it.tar_bytes for it in b), requires)
        streams = [lzma.compress(head, format=lzma.FORMAT_XZ, preset=args.xz_preset),
                   *[it.stream for it in b],
                   lzma.compress(tail, format=lzma.FORMAT_XZ, preset=args.xz_preset)]
        path = out / f"{part}.tar.xz"
        with open(path, "wb") as f:
            for s in streams:
                f.write(s)
        size = path.stat().st_size
        if size > cap:
            raise SystemExit(f"{path} is {size / MIB:.2f} MiB > {args.max_part_mib} MiB (packing estimate was off)")
        digest = sha256_file(path)
        (out / f"{part}.tar.xz.sha256").write_text(f"{digest}  {path.name}\n")
        sums_lines.append(f"{digest}  {path.name}")
        nfiles = verify_part(path, b) if not args.no_verify else None
        part_rows.append((part, size, b, digest, nfiles))
    (out / "SHA256SUMS").write_text("\n".join(sums_lines) + "\n")

    # 5) report
    log("")
    log(f"{'item':52s} {'version':>14s} {'part':>5s} {'wheel MiB':>9s} {'raw MiB':>8s} {'xz MiB':>7s}")
    for part, _, b, _, _ in part_rows:
        for it in sorted(b, key=lambda i: -i.xz_bytes):
            name = it.key + {"tree": " (tree)", "deb": " (deb)"}.get(it.kind, "")
            log(f"{name:52s} {it.version:>14s} {part:>5s} {it.wheel_bytes / MIB:9.2f} "
                f"{it.raw_bytes / MIB:8.2f} {it.xz_bytes / MIB:7.2f}")
            for path, size, why in it.dropped:
                log(f"    - dropped {path} ({size / MIB:.2f} MiB): {why}")
    log("")
    log(f"{'part':12s} {'bytes':>12s} {'MiB':>7s} {'items':>5s} {'files ok':>8s}  sha256")
    total = 0
    for part, size, b, digest, nfiles in part_rows:
        total += size
        log(f"{part + '.tar.xz':12s} {size:12,d} {size / MIB:7.2f} {len(b):5d} {str(nfiles):>8s}  {digest}")
    log(f"{'total':12s} {total:12,d} {total / MIB:7.2f}   (limit {args.max_part_mib} MiB per part)")
    log(f"[build] wrote {len(part_rows)} part(s) to {out} in {time.time() - t0:.0f} s")
    rel = os.path.relpath(out, REPO)
    for part, *_ in part_rows:
        log(f"[build] device run: carry [\"{rel}/{part}.tar.xz\", \"{rel}/{part}.tar.xz.sha256\"] and run "
            f"`bash tools/gpu-bundle/install_part.sh {rel}/{part}.tar.xz`")
    if args.report_json:
        args.report_json.write_text(json.dumps({
            "parts": [{"file": f"{p}.tar.xz", "bytes": s, "sha256": d,
                       "items": [{k: v for k, v in dataclasses.asdict(i).items() if k != "stream"} for i in b]}
                      for p, s, b, d, _ in part_rows]}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
