#!/usr/bin/env bash
# Build kube-apiserver and kube-controller-manager v1.20.2 from Debian's `kubernetes` source package,
# once, into a cache outside the repo (the real-API-server test tier needs them; no prebuilt binary
# exists in any registry we can reach). Idempotent: does nothing when the binaries are cached, or when
# DSV4_KUBE_APISERVER / DSV4_KUBE_CONTROLLER_MANAGER (and DSV4_ETCD) point at prebuilt ones.
#
#   cache: ${DSV4_KUBE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dsv4/kube}/v1.20.2/bin/
#
# Needs root (apt-get) and the package registries; nothing else from the network.
set -euo pipefail

version=v1.20.2
cache_root=${DSV4_KUBE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dsv4/kube}
cache=$cache_root/$version
bin=$cache/bin

have_prebuilt() {
  [[ -n "${DSV4_KUBE_APISERVER:-}" && -x "${DSV4_KUBE_APISERVER}" ]] &&
    [[ -n "${DSV4_KUBE_CONTROLLER_MANAGER:-}" && -x "${DSV4_KUBE_CONTROLLER_MANAGER}" ]]
}
have_cached() { [[ -x $bin/kube-apiserver && -x $bin/kube-controller-manager ]]; }
have_etcd() { [[ -n "${DSV4_ETCD:-}" && -x "${DSV4_ETCD}" ]] || command -v etcd >/dev/null; }

if have_prebuilt && have_etcd; then
  echo "build-kube: using prebuilt binaries from DSV4_KUBE_* (nothing to do)"
  exit 0
fi
if have_cached && have_etcd; then
  echo "build-kube: $version cached in $bin (nothing to do)"
  exit 0
fi

# golang-go: Debian's go1.19; rsync/jq: kube's make; etcd-server: the store the tests start;
# reflect2 1.0.2: replaces the vendored 1.0.1, which SIGSEGVs under go>=1.18.
apt_pkgs=(golang-go rsync jq etcd-server golang-github-modern-go-reflect2-dev make)
missing=()
for p in "${apt_pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  echo "build-kube: apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if have_cached || have_prebuilt; then exit 0; fi

work=$cache/work
src=$cache/src
rm -rf "$src"
mkdir -p "$work/lists/partial" "$work/parts" "$src" "$bin"

# A private deb-src list derived from the deb entries already configured in /etc/apt (whatever mirror
# this machine uses), so the system's own apt state is left untouched.
python3 - "$work/parts/dsv4-src.sources" <<'PY'
import glob, re, sys

codename = ""
for line in open("/etc/os-release"):
    if line.startswith("VERSION_CODENAME="):
        codename = line.split("=", 1)[1].strip().strip('"')
stanzas = []
for path in glob.glob("/etc/apt/sources.list.d/*.sources"):
    for block in re.split(r"\n\s*\n", open(path).read()):
        fields = {}
        for line in block.splitlines():
            if line.startswith("#") or ":" not in line or line.startswith(" "):
                continue
            key, value = line.split(":", 1)
            fields[key.strip()] = value.strip()
        if "deb" in fields.get("Types", "").split() and fields.get("Enabled", "yes") != "no":
            stanzas.append(fields)
for path in ["/etc/apt/sources.list", *glob.glob("/etc/apt/sources.list.d/*.list")]:
    try:
        lines = open(path).read().splitlines()
    except FileNotFoundError:
        continue
    for line in lines:
        m = re.match(r"^deb\s+(\[[^\]]*\]\s+)?(\S+)\s+(\S+)\s+(.*)$", line.strip())
        if m:
            fields = {"URIs": m.group(2), "Suites": m.group(3), "Components": m.group(4)}
            signed = re.search(r"signed-by=(\S+?)[\s\]]", m.group(1) or "")
            if signed:
                fields["Signed-By"] = signed.group(1)
            stanzas.append(fields)
out = []
for f in stanzas:
    suites = [s for s in f.get("Suites", "").split() if not codename or s.startswith(codename)]
    if not suites:
        continue
    text = f"Types: deb-src\nURIs: {f['URIs']}\nSuites: {' '.join(suites)}\nComponents: {f.get('Components', 'main')}\n"
    if "Signed-By" in f:
        text += f"Signed-By: {f['Signed-By']}\n"
    out.append(text)
if not out:
    sys.exit("build-kube: no deb entry for this release in /etc/apt to derive a deb-src list from")
open(sys.argv[1], "w").write("\n".join(out))
PY

apto=(-o "Dir::Etc::SourceList=/dev/null" -o "Dir::Etc::SourceParts=$work/parts"
  -o "Dir::State::Lists=$work/lists" -o "Dir::Cache::archives=$work" -o "APT::Sandbox::User=root")
echo "build-kube: fetching Debian's kubernetes source package"
apt-get "${apto[@]}" update -qq
(cd "$work" && rm -f kubernetes_* && apt-get "${apto[@]}" source --download-only -qq kubernetes)
orig=$(ls "$work"/kubernetes_*.orig.tar.gz | head -1)
case "$orig" in *1.20.2*) ;; *) echo "build-kube: expected kubernetes 1.20.2, got $orig" >&2; exit 1 ;; esac
tar xzf "$orig" -C "$src"
tree=$(ls -d "$src"/kubernetes-*/ | head -1)
cd "$tree"

r=vendor/github.com/modern-go/reflect2
rm -rf "$r" && mkdir -p "$r"
cp /usr/share/gocode/src/github.com/modern-go/reflect2/*.go /usr/share/gocode/src/github.com/modern-go/reflect2/*.s "$r"/
rm -f "$r"/*_test.go
mkdir -p .go/src/k8s.io && ln -sfn ../../.. .go/src/k8s.io/kubernetes # the GOPATH layout debian/rules uses

# The Go build cache lives beside the binaries, so a rebuild (new machine image, same cache) is fast.
# kube's make points GOCACHE at _output/local/go/cache, so that path is linked to the kept one.
mkdir -p "$cache/go-build" "$cache/home" _output/local/go
ln -sfn "$cache/go-build" _output/local/go/cache
echo "build-kube: make kube-apiserver kube-controller-manager (about 15 min cold on 2 cores)"
env GOPATH="$PWD/.go" HOME="$cache/home" CGO_ENABLED=0 GOFLAGS= \
  make WHAT="cmd/kube-apiserver cmd/kube-controller-manager" \
  KUBE_GIT_VERSION="$version" KUBE_GIT_TREE_STATE=clean
for b in kube-apiserver kube-controller-manager; do
  install -m 0755 "_output/bin/$b" "$bin/$b.tmp" && mv "$bin/$b.tmp" "$bin/$b"
done
"$bin/kube-apiserver" --version
cd /
rm -rf "$src" "$work"
echo "build-kube: built into $bin"
