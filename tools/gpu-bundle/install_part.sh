#!/usr/bin/env bash
# Install ONE part of the offline SGLang bundle (built by tools/gpu-bundle/build_bundle.py) into $SITE
# on the GPU machine.  From the repository root, with the part carried:
#
#   bash tools/gpu-bundle/install_part.sh .e2e/parts/part1.tar.xz     # SGLang 0.5.17 and its wheels
#   bash tools/gpu-bundle/install_part.sh .e2e/parts/part2.tar.xz     # Mooncake (PD), needs part 1 installed
#
# Steps: verify the part's sha256 (PART.sha256 beside it, else the line in SHA256SUMS beside it),
# skip if this exact part is already installed (marker in $SITE/.e2e-installed/), unpack to a temp
# dir, verify the per-file SHA256SUMS inside, refuse the part if $SITE lacks a package its REQUIRES
# names (part 2 without part 1: the machine was recycled), `pip install --no-index --no-deps --target
# $SITE` the wheels (wheel by wheel + unzip fallback for any wheel pip rejects, e.g. the
# manylinux_2_34-tagged sglang wheel on a glibc < 2.34 box), copy the trees (trees/<name>/<entry> ->
# $SITE/<entry>), unpack the Debian packages (debs/*.deb, `dpkg-deb -x`) into $SYSLIBS/root and link
# into $SYSLIBS/lib the shared libraries this machine lacks (every library of a source package
# together, so that libmlx5 never meets another build's libibverbs); optionally byte-compile, write
# the marker.
#
# Env: SITE=/tmp/site   PY=<python of the GPU venv; default /opt/torch/.venv/bin/python3, else python3>
#      SYSLIBS=/tmp/mooncake-sys (benchmarks/e2e/run_e2e.py --mooncake-syslibs; the PD servers' LD_LIBRARY_PATH gets $SYSLIBS/lib)
#      SYSLIB_DIRS="<dirs>" (where the machine's own libraries are looked for; default the x86_64 lib dirs,
#      plus `ldconfig -p` unless LDCONFIG=0)
#      FORCE=1 (reinstall even if the marker matches)   COMPILE=0 (skip byte-compiling $SITE)
#      DRY_RUN=1 (verify + unpack + list what would be done; installs nothing)
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore

PART=${1:?usage: install_part.sh path/to/partN.tar.xz}
SITE=${SITE:-/tmp/site}
SYSLIBS=${SYSLIBS:-/tmp/mooncake-sys}
SYSLIB_DIRS=${SYSLIB_DIRS:-/lib/x86_64-linux-gnu /usr/lib/x86_64-linux-gnu /lib64 /usr/lib64 /usr/local/lib /usr/lib /lib}
LDCONFIG=${LDCONFIG:-1}
FORCE=${FORCE:-0}
COMPILE=${COMPILE:-1}
DRY_RUN=${DRY_RUN:-0}
say() { echo "[install_part] $*"; }
die() { echo "[install_part] ERROR: $*" >&2; exit 1; }

if [ -z "${PY:-}" ]; then
  for cand in /opt/torch/.venv/bin/python3 python3; do
    if command -v "$cand" >/dev/null 2>&1; then PY=$cand; break; fi
  done
fi
[ -n "${PY:-}" ] || die "no python found (set PY=)"
[ -f "$PART" ] || die "no such part: $PART"
T0=$(date +%s)
NAME=$(basename "$PART")
DIR=$(cd "$(dirname "$PART")" && pwd)
say "part=$PART site=$SITE python=$PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"

# ---- 1. whole-part checksum
SUM=$(sha256sum "$PART" | awk '{print $1}')
EXPECTED=""
if [ -f "$PART.sha256" ]; then
  EXPECTED=$(awk 'NR==1{print $1}' "$PART.sha256")
elif [ -f "$DIR/SHA256SUMS" ]; then
  EXPECTED=$(awk -v n="$NAME" '$2==n || $2=="*"n {print $1}' "$DIR/SHA256SUMS" | head -1)
fi
if [ -n "$EXPECTED" ]; then
  [ "$SUM" = "$EXPECTED" ] || die "sha256 mismatch for $NAME: got $SUM, expected $EXPECTED (truncated transfer?)"
  say "sha256 OK ($SUM)"
else
  say "WARNING: no $NAME.sha256 / SHA256SUMS beside the part; relying on the checksums inside it"
fi

# ---- 2. idempotency
MARKER_DIR="$SITE/.e2e-installed"
MARKER="$MARKER_DIR/$NAME.sha256"
if [ "$FORCE" != 1 ] && [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$SUM" ]; then
  say "already installed (marker $MARKER matches); nothing to do. FORCE=1 reinstalls."
  exit 0
fi

# ---- 3. unpack + per-file checksums
WORK=$(mktemp -d "${TMPDIR:-/tmp}/e2e_part.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
case "$PART" in
  *.tar.xz|*.txz)
    if command -v xz >/dev/null 2>&1; then tar -xJf "$PART" -C "$WORK"
    else "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' "$PART" "$WORK"; fi ;;
  *.tar) tar -xf "$PART" -C "$WORK" ;;
  *) die "unknown part format: $PART (expected .tar.xz or .tar)" ;;
esac
TOPDIR=$(find "$WORK" -mindepth 1 -maxdepth 1 -type d | head -1)
[ -n "$TOPDIR" ] || die "no top directory inside $PART"
cd "$TOPDIR"
[ -f SHA256SUMS ] || die "$PART has no SHA256SUMS inside"
sha256sum -c --quiet SHA256SUMS || die "per-file checksum mismatch inside $PART"
say "unpacked $(cat PART 2>/dev/null | awk '{print $1" of "$2}') ($(grep -vc '^#' MANIFEST.txt) items); per-file checksums OK"

if [ -f REQUIRES ]; then
  for need in $(cat REQUIRES); do
    [ -d "$SITE/$need" ] || die "$NAME needs '$need' in $SITE, which another part installs (part1.tar.xz): install that part first; if it had been installed, the machine was recycled since"
  done
  say "requirements present in $SITE: $(tr '\n' ' ' < REQUIRES)"
fi

if [ "$DRY_RUN" = 1 ]; then
  say "DRY_RUN: would install into $SITE:"
  grep -v '^#' MANIFEST.txt | awk -F'\t' '{printf "  %-6s %-28s %s\n", $1, $2, $3}'
  exit 0
fi
mkdir -p "$SITE" "$MARKER_DIR"

# ---- 4. wheels
unzip_wheel() {  # $1=wheel: plain extraction (purelib/platlib of .data/ go to the top level)
  "$PY" - "$1" "$SITE" <<'PYEOF'
import os, shutil, sys, zipfile
whl, site = sys.argv[1], sys.argv[2]
n = 0
with zipfile.ZipFile(whl) as z:
    tops = {i.filename.split("/", 1)[0] for i in z.infolist()}
    for top in tops:  # replace, like pip --upgrade does
        if not top.endswith(".data"):
            p = os.path.join(site, top)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
    for info in z.infolist():
        name = info.filename
        head, _, rest = name.partition("/")
        if head.endswith(".data"):
            sub, _, rest2 = rest.partition("/")
            if sub not in ("purelib", "platlib"):
                continue
            name = rest2
        if not name or name.endswith("/"):
            continue
        dst = os.path.join(site, name)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with z.open(info) as src, open(dst, "wb") as out:
            shutil.copyfileobj(src, out)
        mode = (info.external_attr >> 16) & 0o777
        if mode:
            os.chmod(dst, mode)
        n += 1
print(f"[install_part] unzipped {os.path.basename(whl)} ({n} files)")
PYEOF
}
shopt -s nullglob
WHEELS=(wheels/*.whl)
PIP=("$PY" -m pip install --no-index --no-deps --no-compile --upgrade --disable-pip-version-check
     --no-warn-script-location --no-warn-conflicts --quiet --target "$SITE")
if ((${#WHEELS[@]})); then
  say "pip installing ${#WHEELS[@]} wheel(s) into $SITE"
  if ! "${PIP[@]}" "${WHEELS[@]}"; then
    say "bulk pip install failed; retrying wheel by wheel (unzip fallback for rejected wheels)"
    for w in "${WHEELS[@]}"; do
      if "${PIP[@]}" "$w" 2>"$WORK/pip.err"; then
        say "pip installed $(basename "$w")"
      else
        say "pip rejected $(basename "$w"): $(tail -1 "$WORK/pip.err")"
        unzip_wheel "$w"
      fi
    done
  fi
fi

# ---- 5. trees
for t in trees/*/; do
  for e in "$t"*; do
    rm -rf "${SITE:?}/$(basename "$e")"
    cp -a "$e" "$SITE/"
  done
  say "copied tree $(basename "$t") -> $SITE ($(ls "$t" | tr '\n' ' '))"
done

# ---- 6. Debian packages: unpacked apart from the system, only what the machine lacks is linked
DEBS=(debs/*.deb)
if ((${#DEBS[@]})); then
  command -v dpkg-deb >/dev/null 2>&1 || die "dpkg-deb not found: cannot unpack ${#DEBS[@]} Debian package(s)"
  case "$SYSLIBS" in /|/usr|/usr/*|/lib*|/etc*|"$SITE") die "SYSLIBS=$SYSLIBS: use a folder of its own (default /tmp/mooncake-sys)" ;; esac
  rm -rf "$SYSLIBS"
  mkdir -p "$SYSLIBS/root" "$SYSLIBS/lib"
  : > "$SYSLIBS/sonames.txt"
  for d in "${DEBS[@]}"; do
    dpkg-deb -x "$d" "$SYSLIBS/root"
    src=$(dpkg-deb -f "$d" Source | awk '{print $1}')
    [ -n "$src" ] || src=$(dpkg-deb -f "$d" Package)
    # shared libraries directly in (usr/)lib/x86_64-linux-gnu, as <source package> <path>
    dpkg-deb -c "$d" | awk '{print $6}' | sed 's#^\./##' \
      | grep -E '^(usr/)?lib/x86_64-linux-gnu/[^/]+\.so\.[0-9][^/]*$' | sed "s#^#$src #" >> "$SYSLIBS/sonames.txt"
  done
  "$PY" - "$SYSLIBS" "$LDCONFIG" $SYSLIB_DIRS <<'PYEOF'
import collections, os, subprocess, sys
syslibs, ldconfig, dirs = sys.argv[1], sys.argv[2] == "1", sys.argv[3:]
known = set()
if ldconfig:
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout
        known = {line.split()[0] for line in out.splitlines()[1:] if line.strip()}
    except (OSError, subprocess.SubprocessError):
        pass
def on_machine(name):
    return name in known or any(os.path.exists(os.path.join(d, name)) for d in dirs)
groups = collections.defaultdict(list)
for line in open(os.path.join(syslibs, "sonames.txt")):
    src, path = line.split()
    groups[src].append(path)
def soname(name):  # libfoo.so.1, not the real file libfoo.so.1.2.3 (whose full version may differ here)
    return name.rsplit(".so.", 1)[1].isdigit()
linked, kept = [], []
with open(os.path.join(syslibs, "LINKED.txt"), "w") as record:
    for src, paths in sorted(groups.items()):
        names = [os.path.basename(p) for p in paths]
        missing = [n for n in names if soname(n) and not on_machine(n)]
        if not missing:
            kept.append(src)
            continue
        for p in paths:
            name = os.path.basename(p)
            os.symlink(os.path.join(syslibs, "root", p), os.path.join(syslibs, "lib", name))
            record.write(f"{name}\t{src}\t{'missing' if name in missing else 'with ' + missing[0]}\n")
        linked.append(f"{src} ({', '.join(missing)} missing)")
print(f"[install_part] system libraries linked into {syslibs}/lib: {'; '.join(linked) or 'none (the machine has them all)'}")
print(f"[install_part] the machine's own copies used for: {' '.join(kept) or 'none'}")
PYEOF
fi

# ---- 7. byte-compile what this part installed (saves the first server start from compiling ~10k
#         modules, in parallel here); the top-level folders of its wheels and trees
if [ "$COMPILE" = 1 ]; then
  TC=$(date +%s)
  DIRS=()
  for b in $("$PY" - "${WHEELS[@]}" <<'PYEOF'
import sys, zipfile
names = set()
for whl in sys.argv[1:]:
    with zipfile.ZipFile(whl) as z:
        names |= {n.split("/", 1)[0] for n in z.namelist() if "/" in n}
print(" ".join(sorted(n for n in names if not n.endswith((".dist-info", ".data")))))
PYEOF
  ) $(for t in trees/*/; do ls "$t"; done); do
    case "$b" in *.dist-info|*.data|bin|share|include) continue ;; esac
    [ -d "$SITE/$b" ] && DIRS+=("$SITE/$b")
  done
  # -qq: silent (a few vendored files are not Python 3); a failure here is harmless
  if ((${#DIRS[@]})); then "$PY" -m compileall -qq -j 0 "${DIRS[@]}" >/dev/null 2>&1 || true; fi
  say "byte-compiled ${#DIRS[@]} folder(s) of $SITE in $(( $(date +%s) - TC )) s"
fi

echo "$SUM" > "$MARKER"
say "done: $NAME in $(( $(date +%s) - T0 )) s; installed:"
grep -v '^#' MANIFEST.txt | awk -F'\t' '{printf "  %-6s %-28s %s\n", $1, $2, $3}'
say "use: PYTHONPATH=$SITE (benchmarks/e2e/run_e2e.py sets it)"
