#!/usr/bin/env bash
# omnirig's soft-RoCE lane: real libibverbs against a real kernel RDMA device (rdma_rxe,
# "soft-RoCE") inside QEMU VMs, on hosts with no HCA and no RDMA modules.
#
#   ci/softroce.sh setup                        download and build the VM pieces (idempotent)
#   ci/softroce.sh run [OPTIONS] -- CMD [ARG..] boot 1 or 2 VMs, run CMD in each, power off
#   ci/softroce.sh selftest [--vms 2]           ibv_devinfo, ib_write_bw 64 KiB / 1 MiB, ib_write_lat 8 B
#   ci/softroce.sh clean                        delete the work dir
#
# How: a stock Debian kernel package (it ships rdma_rxe.ko) and the verbs user space
# (libibverbs1, ibverbs-providers for librxe, perftest, ...) are fetched with `apt-get download`
# and unpacked, never installed on the host. A busybox initramfs loads the modules, mounts the
# host's own / read-only over virtio-9p with the verbs packages stacked on top (overlayfs, writes
# to tmpfs) and switches root into it: every host path, this checkout and its target dir
# included, is the same path in the VM, so binaries built on the host run unchanged. A run
# folder is mounted read-write; the command's output and exit status come back through it.
# In the VM: `rdma link add rxe0 type rxe netdev <if>` on dummy0 (one VM: both ends on one rxe
# device) or on a virtio-net link between two VMs carried over a UNIX socket (two RoCE nodes; no
# host networking at all).
#
# run OPTIONS
#   --vms 1|2      VMs (default 1)        --timeout S   per-VM wall clock limit (default 300)
#   --cpus N       vCPUs (default 2)      --mem MiB     memory per VM (default 2048)
#   --share DIR    also mount DIR read-write at its host path (repeatable)
#   --env NAME     pass the host variable NAME (PATH, HOME, RUST_*, CARGO_*, OMNIRIG_* always are)
#   --mtu N        netdev MTU in the VM (default 9000, RoCE MTU 4096)
# CMD runs under bash in the caller's directory. One argument is a shell line; several are argv.
# In the VM: SOFTROCE_NODE (0|1), SOFTROCE_NODES, SOFTROCE_IP, SOFTROCE_PEER_IP (2 VMs),
# SOFTROCE_RDMA_DEV (rxe0), SOFTROCE_GID_INDEX (RoCEv2 IPv4 GID), SOFTROCE_RUN (shared folder),
# and `softroce_barrier NAME` (returns once every VM reached NAME).
# Exit status: the worst command status over the VMs; 124 a VM timed out; 125 a VM never
# reported (boot failure: the console log's tail is printed).
#
# Environment: SOFTROCE_WORK (default ${XDG_CACHE_HOME:-$HOME/.cache}/omnirig-softroce, outside
# the checkout), SOFTROCE_KERNEL_PKG (default: what linux-image-amd64 depends on),
# SOFTROCE_ACCEL=auto|kvm|tcg, SOFTROCE_NO_INSTALL=1 (never apt-get install on the host),
# SOFTROCE_QUIET=1 (no live output).
#
# Do not rebuild binaries a running VM uses: the host root is mounted with cache=loose.
set -euo pipefail

WORK=${SOFTROCE_WORK:-${XDG_CACHE_HOME:-$HOME/.cache}/omnirig-softroce}
# Bump when the built pieces (initramfs, stage 2, sysroot layout) change: setup reruns.
LAYOUT=1
# The verbs user space the VM needs; the host gets none of it installed.
VERBS_PKGS=(libibverbs1 ibverbs-providers librdmacm1 ibverbs-utils rdmacm-utils perftest)
# rdma_rxe and what the initramfs needs to reach the host root. rxe asks the crypto API for
# "crc32" (its ICRC) and the VM has no kmod to autoload it, so crc32 is loaded up front.
MODULES=(virtio_pci virtio_net 9pnet_virtio 9p overlay dummy crc32_generic crc32_pclmul
         rdma_rxe ib_uverbs rdma_ucm)

say() { printf 'softroce: %s\n' "$*" >&2; }
fail() { printf 'softroce: error: %s\n' "$*" >&2; exit 1; }

# ---------------------------------------------------------------------------------------------
# host side: qemu and apt
# ---------------------------------------------------------------------------------------------

apt_refreshed=0
apt_refresh() {
  [[ $apt_refreshed == 1 ]] && return 0
  apt-get update -qq >&2 || say "apt-get update failed; trying with the lists we have"
  apt_refreshed=1
}

# apt options for a private source list that adds bookworm-backports (the system's /etc/apt is
# left alone). Needed where qemu-utils came from backports: bookworm's qemu-system-x86 would
# replace it with an older one.
backports_apt() {
  local d=$WORK/apt-backports mirror
  mkdir -p "$d/parts" "$d/lists/partial"
  cp /etc/apt/sources.list.d/*.sources "$d/parts/" 2>/dev/null || true
  [[ -f /etc/apt/sources.list ]] && cp /etc/apt/sources.list "$d/parts/system.list"
  mirror=$(awk '/^URIs:/ && $2 !~ /security/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
  [[ -n $mirror ]] || mirror=http://deb.debian.org/debian
  printf 'Types: deb\nURIs: %s\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
    "$mirror" > "$d/parts/backports.sources"
  APT_BPO=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$d/parts" -o "Dir::State::Lists=$d/lists")
}

need_qemu() {
  command -v qemu-system-x86_64 > /dev/null && return 0
  [[ ${SOFTROCE_NO_INSTALL:-0} == 1 ]] && fail "qemu-system-x86_64 is missing (SOFTROCE_NO_INSTALL=1)"
  command -v apt-get > /dev/null || fail "qemu-system-x86_64 is missing and there is no apt-get to install it"
  apt_refresh
  local utils
  utils=$(dpkg-query -W -f='${db:Status-Status} ${Version}' qemu-utils 2> /dev/null || true)
  if [[ $utils == installed*bpo* ]]; then
    say "installing qemu-system-x86 from bookworm-backports (qemu-utils $utils is a backport)"
    backports_apt
    apt-get "${APT_BPO[@]}" update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get "${APT_BPO[@]}" install -y -q --no-install-recommends \
      -t bookworm-backports qemu-system-x86 >&2
  else
    say "installing qemu-system-x86"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends qemu-system-x86 >&2
  fi
  command -v qemu-system-x86_64 > /dev/null || fail "qemu-system-x86_64 still missing after apt-get install"
}

# apt-get download PKG... into $WORK/debs, refreshing the lists once if the mirror moved on.
fetch_debs() {
  (( $# )) || return 0
  say "downloading $*"
  ( cd "$WORK/debs" && apt-get download -q -o APT::Sandbox::User=root "$@" >&2 ) && return 0
  apt_refresh
  ( cd "$WORK/debs" && apt-get download -q -o APT::Sandbox::User=root "$@" >&2 )
}

deb_of() { ls "$WORK/debs/$1"_*.deb 2> /dev/null | sed -n 1p; }

# ---------------------------------------------------------------------------------------------
# setup
# ---------------------------------------------------------------------------------------------

kernel_package() {
  if [[ -n ${SOFTROCE_KERNEL_PKG:-} ]]; then echo "$SOFTROCE_KERNEL_PKG"; return; fi
  # Keep the kernel of an earlier setup: superseded kernel debs vanish from the mirror.
  if [[ -s $WORK/kernel-package ]]; then cat "$WORK/kernel-package"; return; fi
  local k
  k=$(apt-cache depends linux-image-amd64 2> /dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
  if [[ -z $k ]] || ! apt-cache show "$k" > /dev/null 2>&1; then
    apt_refresh
    k=$(apt-cache depends linux-image-amd64 2> /dev/null | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
  fi
  [[ -n $k ]] || fail "cannot tell which kernel package linux-image-amd64 wants (set SOFTROCE_KERNEL_PKG)"
  echo "$k"
}

# Everything the VM needs on top of the host's root: the verbs packages plus whatever of their
# dependencies the host lacks (apt's simulated install lists exactly those).
userspace_packages() {
  local sim
  sim=$(apt-get -s install --no-install-recommends "${VERBS_PKGS[@]}" 2>&1) || {
    apt_refresh
    sim=$(apt-get -s install --no-install-recommends "${VERBS_PKGS[@]}" 2>&1) \
      || fail "apt cannot resolve ${VERBS_PKGS[*]}: $sim"
  }
  { printf '%s\n' "${VERBS_PKGS[@]}"; awk '$1 == "Inst" {print $2}' <<< "$sim"; } | sort -u
}

unpack_kernel() {
  local kdeb=$1
  if [[ $(cat "$WORK/kernel/.from" 2> /dev/null) != "$kdeb" ]]; then
    say "unpacking $(basename "$kdeb")"
    rm -rf "$WORK/kernel"
    mkdir -p "$WORK/kernel"
    dpkg -x "$kdeb" "$WORK/kernel"
    echo "$kdeb" > "$WORK/kernel/.from"
  fi
  KVER=$(basename "$(ls -d "$WORK"/kernel/lib/modules/*/ | sed -n 1p)")
  KMODS=$WORK/kernel/lib/modules/$KVER
}

# Module NAME's file in the unpacked kernel (names use _ or - interchangeably).
module_file() {
  local a=$1 b=${1//_/-}
  find "$KMODS" -type f \( -name "$a.ko*" -o -name "$b.ko*" \) | sed -n 1p
}

decompress() {
  case $1 in
    *.xz) xz -dc "$1" ;;
    *.zst) zstd -dcq "$1" ;;
    *.gz) gzip -dc "$1" ;;
    *) cat "$1" ;;
  esac
}

# Depth-first over each module's `depends=` (its .modinfo section): dependencies land in
# $INITRD/modules before the module that needs them, and load-order lists that order.
declare -A MOD_DONE=()
add_module() {
  local m=${1//-/_} f dep
  [[ -n ${MOD_DONE[$m]:-} ]] && return 0
  MOD_DONE[$m]=1
  f=$(module_file "$m")
  [[ -n $f ]] || return 0 # built into the kernel
  decompress "$f" > "$INITRD/modules/$m.ko"
  for dep in $(readelf -p .modinfo "$INITRD/modules/$m.ko" | sed -n 's/.*depends=//p' | tr ',' ' '); do
    add_module "$dep"
  done
  echo "$m" >> "$INITRD/modules/load-order"
}

# The PVH entry of the uncompressed vmlinux boots without real mode or in-guest decompression:
# several seconds faster per boot under TCG. Found by its compression magic inside the bzImage.
extract_vmlinux() {
  local z=$1 out=$2 magic tool off
  rm -f "$out"
  for magic in xz gzip zstd; do
    case $magic in
      xz) off=$(grep -abo $'\xfd7zXZ\x00' "$z" | sed -n 1p | cut -d: -f1 || true); tool="xz -dc" ;;
      gzip) off=$(grep -abo $'\x1f\x8b\x08' "$z" | sed -n 1p | cut -d: -f1 || true); tool="gzip -dc" ;;
      zstd) off=$(grep -abo $'\x28\xb5\x2f\xfd' "$z" | sed -n 1p | cut -d: -f1 || true); tool="zstd -dcq" ;;
    esac
    [[ -n $off ]] || continue
    tail -c +$((off + 1)) "$z" | $tool > "$out.part" 2> /dev/null || true
    # XEN_ELFNOTE_PHYS32_ENTRY (note type 0x12) marks a PVH entry point
    if readelf -n "$out.part" 2> /dev/null | grep '(0x00000012)' > /dev/null; then
      mv "$out.part" "$out"
      return 0
    fi
  done
  rm -f "$out.part"
  return 1
}

setup() {
  mkdir -p "$WORK/debs"
  exec 9> "$WORK/.setup.lock"
  flock 9
  need_qemu
  local kpkg pkgs=() missing=() p
  kpkg=$(kernel_package)
  mapfile -t pkgs < <(userspace_packages)
  for p in "$kpkg" busybox-static "${pkgs[@]}"; do [[ -n $(deb_of "$p") ]] || missing+=("$p"); done
  fetch_debs "${missing[@]}"
  echo "$kpkg" > "$WORK/kernel-package"
  for p in "$kpkg" busybox-static "${pkgs[@]}"; do
    [[ -n $(deb_of "$p") ]] || fail "package $p was not downloaded"
  done

  local stamp
  stamp="$LAYOUT $(sha256sum "$0" | cut -c1-16) $(for p in "$kpkg" busybox-static "${pkgs[@]}"; do basename "$(deb_of "$p")"; done | tr '\n' ' ')"
  if [[ -f $WORK/initrd.cpio.gz && $(cat "$WORK/.stamp" 2> /dev/null) == "$stamp" ]]; then
    return 0
  fi

  unpack_kernel "$(deb_of "$kpkg")"
  local bbroot=$WORK/busybox
  rm -rf "$bbroot"
  dpkg -x "$(deb_of busybox-static)" "$bbroot"
  local BB=$bbroot/bin/busybox
  [[ -x $BB ]] || fail "busybox-static has no bin/busybox"

  say "building the verbs layer (${pkgs[*]})"
  local SYS=$WORK/sysroot
  rm -rf "$SYS"
  mkdir -p "$SYS"
  for p in "${pkgs[@]}"; do dpkg -x "$(deb_of "$p")" "$SYS"; done
  rm -rf "$SYS/usr/share/doc" "$SYS/usr/share/man"
  # The host is merged-/usr (/lib -> usr/lib): a real lib/ dir in an overlay layer above it would
  # hide that symlink, so the packages' top-level dirs move under usr/.
  local d
  for d in bin sbin lib lib64; do
    if [[ -d $SYS/$d && ! -L $SYS/$d ]]; then
      mkdir -p "$SYS/usr/$d"
      cp -a "$SYS/$d/." "$SYS/usr/$d/"
      rm -rf "${SYS:?}/$d"
    fi
  done
  mkdir -p "$SYS/usr/lib/omnirig-softroce"
  cp "$BB" "$SYS/usr/lib/omnirig-softroce/busybox"
  write_stage2 > "$SYS/usr/lib/omnirig-softroce/stage2"
  chmod +x "$SYS/usr/lib/omnirig-softroce/stage2"

  say "building the initramfs for $KVER"
  INITRD=$WORK/initrd
  rm -rf "$INITRD"
  mkdir -p "$INITRD"/{bin,modules,proc,sys,dev,host,rw,root}
  cp "$BB" "$INITRD/bin/busybox"
  : > "$INITRD/modules/load-order"
  MOD_DONE=()
  local m
  for m in "${MODULES[@]}"; do add_module "$m"; done
  grep -qx rdma_rxe "$INITRD/modules/load-order" || fail "kernel $KVER has no rdma_rxe module"
  write_init > "$INITRD/init"
  chmod +x "$INITRD/init"
  (cd "$INITRD" && find . | "$BB" cpio -o -H newc 2> /dev/null | gzip -1) > "$WORK/initrd.cpio.gz.part"
  mv "$WORK/initrd.cpio.gz.part" "$WORK/initrd.cpio.gz"
  cp "$WORK/kernel/boot/vmlinuz-$KVER" "$WORK/vmlinuz"
  if extract_vmlinux "$WORK/vmlinuz" "$WORK/vmlinux"; then say "boots vmlinux through its PVH entry"; fi

  # every verbs tool must find its libraries in the layer or on the host
  local f missing_libs=""
  for f in "$SYS"/usr/bin/*; do
    [[ -x $f && -f $f ]] || continue
    missing_libs+=$(LD_LIBRARY_PATH=$SYS/usr/lib/x86_64-linux-gnu ldd "$f" 2> /dev/null | grep 'not found' | sed "s|^|$(basename "$f"):|" || true)
  done
  [[ -z $missing_libs ]] || say "warning: unresolved libraries: $missing_libs"
  for p in "$kpkg" busybox-static "${pkgs[@]}"; do
    dpkg-deb -f "$(deb_of "$p")" Package Version | paste -sd' '
  done > "$WORK/manifest.txt"
  echo "$stamp" > "$WORK/.stamp"
  say "setup done in $WORK: kernel $KVER, modules $(paste -sd' ' "$INITRD/modules/load-order")"
}

# Stage 1, PID 1 in the initramfs.
write_init() {
  cat << 'EOF'
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
die() { echo "softroce-init: $*"; echo o > /proc/sysrq-trigger; sleep 10; }
for m in $(cat /modules/load-order); do insmod /modules/$m.ko || echo "softroce-init: insmod $m failed"; done
for kv in $(cat /proc/cmdline); do
  case $kv in sr.*=*) k=${kv%%=*}; eval "SR_${k#sr.}=\${kv#*=}" ;; esac
done
P9="trans=virtio,version=9p2000.L,msize=262144"
mount -t 9p -o $P9,ro,cache=loose host /host || die "cannot mount the host root"
mount -t tmpfs -o mode=0755 rw /rw || die "tmpfs"
mkdir -p /rw/up /rw/wk /rw/verbs
# the verbs layer is its own 9p export: overlayfs refuses lower dirs nested in one another
mount -t 9p -o $P9,ro,cache=loose verbs /rw/verbs || die "cannot mount the verbs layer"
mount -t overlay root -o lowerdir=/rw/verbs:/host,upperdir=/rw/up,workdir=/rw/wk /root || die "overlay"
mkdir -p "/root$SR_run" && mount -t 9p -o $P9,cache=mmap run "/root$SR_run" || die "cannot mount the run folder"
n=0
while [ $n -lt "${SR_shares:-0}" ]; do
  eval "dir=\$SR_share$n"
  mkdir -p "/root$dir" && mount -t 9p -o $P9,cache=mmap share$n "/root$dir" || echo "softroce-init: share $dir failed"
  n=$((n + 1))
done
for d in proc sys dev; do mount --move /$d /root/$d; done
exec switch_root /root /bin/bash /usr/lib/omnirig-softroce/stage2
EOF
}

# Stage 2, in the VM on the host's user space: network, rxe0, the command, power off.
write_stage2() {
  cat << 'EOF'
#!/bin/bash
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
for kv in $(cat /proc/cmdline); do
  case $kv in sr.*=*) k=${kv%%=*}; printf -v "SR_${k#sr.}" '%s' "${kv#*=}" ;; esac
done
RUN=$SR_run NODE=$SR_node
poweroff_now() { sync; echo o > /proc/sysrq-trigger; sleep 10; }
report() { echo "$1" > "$RUN/rc.$NODE"; poweroff_now; }
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs shm /dev/shm
mount -t tmpfs run /run
# /tmp stays the host's (read-only below, writable through the overlay): checkouts there work
ln -sf /proc/self/fd /dev/fd
exec > >(tee "$RUN/vm.$NODE.log" > /dev/console) 2>&1
echo "node$NODE" > /proc/sys/kernel/hostname
ulimit -l unlimited
ip link set lo up
if [ -e /sys/class/net/eth0 ]; then NETDEV=eth0; else
  [ -e /sys/class/net/dummy0 ] || ip link add dummy0 type dummy
  NETDEV=dummy0
fi
ip addr add "$SR_ip/24" dev $NETDEV
ip link set $NETDEV mtu "$SR_mtu" || echo "softroce: mtu $SR_mtu refused on $NETDEV"
ip link set $NETDEV up
rdma link add rxe0 type rxe netdev $NETDEV || { echo "softroce: rdma link add rxe0 failed"; report 125; }
# RoCEv2 needs the IPv4-mapped GID (::ffff:a.b.c.d), which appears shortly after the port is up
GIDX=
for _ in $(seq 200); do
  state=$(cat /sys/class/infiniband/rxe0/ports/1/state 2> /dev/null)
  for g in /sys/class/infiniband/rxe0/ports/1/gids/*; do
    [[ $(cat "$g" 2> /dev/null) == 0000:0000:0000:0000:0000:ffff:* ]] && { GIDX=${g##*/}; break; }
  done
  [[ $state == *ACTIVE* && -n $GIDX ]] && break
  sleep 0.05
done
[[ -n $GIDX ]] || { echo "softroce: rxe0 has no IPv4 GID (port state: $state)"; report 125; }
echo "softroce: node $NODE: rxe0 on $NETDEV $SR_ip, port $state, GID index $GIDX, $(cut -d' ' -f1 /proc/uptime)s after boot"
export SOFTROCE_NODE=$NODE SOFTROCE_NODES=$SR_nodes SOFTROCE_IP=$SR_ip SOFTROCE_PEER_IP=${SR_peer:-} \
  SOFTROCE_RDMA_DEV=rxe0 SOFTROCE_NETDEV=$NETDEV SOFTROCE_GID_INDEX=$GIDX SOFTROCE_RUN=$RUN
softroce_barrier() {
  touch "$SOFTROCE_RUN/barrier.$1.$SOFTROCE_NODE"
  local t n k
  for ((t = 0; t < 3000; t++)); do
    n=0
    for ((k = 0; k < SOFTROCE_NODES; k++)); do [ -e "$SOFTROCE_RUN/barrier.$1.$k" ] && n=$((n + 1)); done
    [ $n -eq "$SOFTROCE_NODES" ] && return 0
    sleep 0.1
  done
  echo "softroce_barrier $1: the other node never came" >&2
  return 1
}
export -f softroce_barrier
. "$RUN/env.sh"
cd "$SOFTROCE_CWD" 2> /dev/null || cd /
touch "$RUN/ready.$NODE"
bash "$RUN/cmd.sh" > "$RUN/out.$NODE" 2>&1 < /dev/null
rc=$?
echo "softroce: node $NODE: command exited $rc"
report $rc
EOF
}

ensure_setup() {
  # cheap check first; setup itself is idempotent and takes the lock
  if [[ -f $WORK/initrd.cpio.gz && -f $WORK/.stamp ]] && command -v qemu-system-x86_64 > /dev/null \
     && [[ $(cut -d' ' -f1-2 "$WORK/.stamp") == "$LAYOUT $(sha256sum "$0" | cut -c1-16)" ]]; then
    return 0
  fi
  setup
}

# ---------------------------------------------------------------------------------------------
# run
# ---------------------------------------------------------------------------------------------

# KVM only where it can run a stock kernel: a PVM host (kvm_pvm, paravirtual nested KVM) hangs a
# Debian kernel right after "Probing EDD", and so does a CPU without vmx/svm.
accel() {
  local a=${SOFTROCE_ACCEL:-auto}
  if [[ $a == auto ]]; then
    if [[ -w /dev/kvm && ! -d /sys/module/kvm_pvm ]] && grep -qwE 'vmx|svm' /proc/cpuinfo; then a=kvm; else a=tcg; fi
  fi
  if [[ $a == kvm ]]; then
    QEMU_ACCEL=(-accel kvm -cpu host)
  else
    # Without ERMS/FSRM the guest kernel copies with rep movsq instead of rep movsb, which TCG
    # emulates byte by byte: rxe is ~3.5x faster this way.
    QEMU_ACCEL=(-accel tcg,thread=multi,tb-size=256 -cpu max,-erms,-fsrm)
  fi
  ACCEL=$a
}

run() {
  local vms=1 mem=2048 cpus=2 timeout=300 mtu=9000 shares=() envs=()
  while (( $# )); do
    case $1 in
      --vms) vms=$2; shift 2 ;;
      --mem) mem=$2; shift 2 ;;
      --cpus) cpus=$2; shift 2 ;;
      --timeout) timeout=$2; shift 2 ;;
      --mtu) mtu=$2; shift 2 ;;
      --share) shares+=("$(readlink -f "$2")"); shift 2 ;;
      --env) envs+=("$2"); shift 2 ;;
      --) shift; break ;;
      -*) fail "unknown run option $1" ;;
      *) break ;;
    esac
  done
  (( $# )) || fail "no command: ci/softroce.sh run [OPTIONS] -- CMD [ARGS...]"
  [[ $vms == 1 || $vms == 2 ]] || fail "--vms must be 1 or 2, not $vms"
  [[ $timeout =~ ^[0-9]+$ ]] || fail "--timeout wants seconds, not $timeout"
  local s
  for s in "$WORK" "$PWD" "${shares[@]}"; do
    [[ $s =~ [[:space:],] ]] && fail "paths with spaces or commas cannot be shared with the VM: '$s'"
  done
  ensure_setup
  accel
  # QEMU's multi-threaded TCG itself sometimes aborts on an assertion early in a boot (exit
  # 134, physmem.c iotlb_to_section: two of three two-VM boots of the hil lane in one CI run
  # on 2026-12-06, none of the rdma lane's), through no doing of the guest's. Such a run is
  # booted again, up to twice; any other failure stands.
  local attempt rc
  for attempt in 1 2 3; do
    SOFTROCE_ABORTED=0
    rc=0
    boot "$@" || rc=$?
    if (( rc != 0 )) && [[ $SOFTROCE_ABORTED == 1 && $attempt -lt 3 ]]; then
      say "QEMU aborted (exit 134: an assertion in the emulator, not the guest); booting again"
      continue
    fi
    return "$rc"
  done
}

# One boot of `run`'s VMs with its options (vms, mem, cpus, timeout, mtu, shares, envs, from
# the caller), running CMD; sets SOFTROCE_ABORTED=1 where a QEMU process aborted (exit 134)
# before its node wrote a result.
boot() {
  local kver
  kver=$(basename "$(ls -d "$WORK"/kernel/lib/modules/*/ | sed -n 1p)")
  mkdir -p "$WORK/runs"
  local R
  R=$(mktemp -d "$WORK/runs/$(date +%Y%m%d-%H%M%S).XXXX")
  chmod 0777 "$R"
  if (( $# == 1 )); then printf '%s\n' "$1" > "$R/cmd.sh"; else printf '%q ' "$@" > "$R/cmd.sh"; echo >> "$R/cmd.sh"; fi
  {
    local v
    for v in PATH HOME USER RUST_BACKTRACE RUST_LOG RUST_TEST_THREADS "${envs[@]}" \
             $(compgen -e | grep -E '^(CARGO_|OMNIRIG_)' || true); do
      [[ -n ${!v+x} ]] && printf 'export %s=%q\n' "$v" "${!v}"
    done
    printf 'SOFTROCE_CWD=%q\n' "$PWD"
  } > "$R/env.sh"
  local kernel=$WORK/vmlinuz
  [[ -f $WORK/vmlinux ]] && kernel=$WORK/vmlinux
  local sock=$R/link.sock pids=() i
  trap 'for p in "${pids[@]}"; do kill "$p" 2> /dev/null || true; done; exit 130' INT TERM
  local t0=$SECONDS
  for ((i = 0; i < vms; i++)); do
    local cmdline="console=ttyS0 quiet loglevel=4 panic=-1 tsc=reliable no_timer_check nowatchdog"
    cmdline+=" sr.node=$i sr.nodes=$vms sr.run=$R sr.ip=10.77.0.$((i + 1)) sr.mtu=$mtu sr.shares=${#shares[@]}"
    [[ $vms == 2 ]] && cmdline+=" sr.peer=10.77.0.$((2 - i))"
    local args=("${QEMU_ACCEL[@]}" -m "$mem" -smp "$cpus" -nodefaults -no-user-config -display none
      -no-reboot -kernel "$kernel" -initrd "$WORK/initrd.cpio.gz" -serial "file:$R/console.$i.log"
      -virtfs "local,path=/,mount_tag=host,security_model=none,readonly=on,multidevs=remap"
      -virtfs "local,path=$WORK/sysroot,mount_tag=verbs,security_model=none,readonly=on,multidevs=remap"
      -virtfs "local,path=$R,mount_tag=run,security_model=none,multidevs=remap")
    local k
    for k in "${!shares[@]}"; do
      args+=(-virtfs "local,path=${shares[$k]},mount_tag=share$k,security_model=none,multidevs=remap")
      cmdline+=" sr.share$k=${shares[$k]}"
    done
    if [[ $vms == 2 ]]; then
      # node 0 listens on the UNIX socket, node 1 connects: a point-to-point virtio-net link
      local server=off
      [[ $i == 0 ]] && server=on
      args+=(-netdev "stream,id=link,server=$server,addr.type=unix,addr.path=$sock"
        -device "virtio-net-pci,netdev=link,mac=52:54:00:77:00:0$((i + 1))")
      if [[ $i == 1 ]]; then
        for _ in $(seq 200); do [[ -S $sock ]] && break; sleep 0.05; done
      fi
    fi
    timeout -k 5 "$timeout" qemu-system-x86_64 "${args[@]}" -append "$cmdline" > "$R/qemu.$i.log" 2>&1 &
    pids+=($!)
  done
  local follower=
  if [[ $vms == 1 && ${SOFTROCE_QUIET:-0} != 1 ]]; then
    tail -n +1 -s 0.3 -F --pid="${pids[0]}" "$R/out.0" 2> /dev/null &
    follower=$!
  fi
  # Each QEMU's exit, polled (bash's `wait -n` loses children that have already exited).
  local qrc=() left=${#pids[@]}
  while (( left )); do
    for i in "${!pids[@]}"; do
      [[ -n ${qrc[i]:-} ]] && continue
      kill -0 "${pids[$i]}" 2> /dev/null && continue
      local r=0 j
      wait "${pids[$i]}" || r=$?
      qrc[i]=$r
      left=$((left - 1))
      # A QEMU that aborted leaves its peer waiting out a barrier for minutes: stop it.
      if (( r == 134 && left )); then
        say "node $i: QEMU aborted (exit 134); stopping the other VM"
        for j in "${!pids[@]}"; do [[ -n ${qrc[j]:-} ]] || kill "${pids[$j]}" 2> /dev/null || true; done
      fi
    done
    if (( left )); then sleep 0.5; fi
  done
  trap - INT TERM
  [[ -n $follower ]] && { wait "$follower" 2> /dev/null || true; }
  local worst=0 rc
  for ((i = 0; i < vms; i++)); do
    if [[ -z $follower ]]; then
      [[ $vms == 2 ]] && echo "===== node $i ====="
      cat "$R/out.$i" 2> /dev/null || true
    fi
    if [[ -f $R/rc.$i ]]; then
      rc=$(cat "$R/rc.$i")
    elif [[ ${qrc[i]} == 124 || ${qrc[i]} == 137 ]]; then
      rc=124
      say "node $i: timed out after ${timeout}s"
    else
      rc=125
      [[ ${qrc[i]} == 134 ]] && SOFTROCE_ABORTED=1
      say "node $i: no result (qemu exit ${qrc[i]}); console tail ($R/console.$i.log):"
      tail -n 25 "$R/console.$i.log" >&2 2> /dev/null || true
      cat "$R/qemu.$i.log" >&2 2> /dev/null || true
    fi
    (( rc > worst )) && worst=$rc
  done
  say "$vms VM(s), kernel $kver, accel $ACCEL, $((SECONDS - t0))s wall, exit $worst, run folder $R"
  # keep the 20 newest run folders
  ls -1dt "$WORK"/runs/*/ 2> /dev/null | tail -n +21 | xargs -r rm -rf
  return "$worst"
}

# perftest on the rxe link: one VM runs both ends on rxe0, two VMs run server on node 0 and client
# on node 1. -F: no CPU frequency check (it fails under TCG); -D: duration mode, reliable there.
selftest() {
  ensure_setup
  local script=$WORK/selftest.sh
  cat > "$script" << 'EOF'
set -u
gid=$SOFTROCE_GID_INDEX port=18800 status=0
if [ "$SOFTROCE_NODES" = 2 ]; then
  role=$([ "$SOFTROCE_NODE" = 0 ] && echo server || echo client); peer=$SOFTROCE_PEER_IP
else role=both; peer=$SOFTROCE_IP; fi
if [ "$SOFTROCE_NODE" = 0 ]; then ibv_devinfo -d rxe0 | grep -E 'hca_id|transport|state|active_mtu|link_layer'; fi
perf() { # NAME TOOL ARGS...: server side in the background (1 VM) or on node 0 (2 VMs)
  local name=$1 tool=$2; shift 2; port=$((port + 1))
  local cmd=("$tool" -d rxe0 -x "$gid" -F -p "$port" "$@")
  if [ $role = server ]; then "${cmd[@]}" > "/tmp/$name.server" 2>&1 || status=1; return; fi
  local srv=
  if [ $role = both ]; then "${cmd[@]}" > "/tmp/$name.server" 2>&1 & srv=$!; fi
  local ok=0
  for _ in $(seq 60); do
    sleep 0.3
    if "${cmd[@]}" "$peer" > "/tmp/$name.client" 2>&1; then ok=1; break; fi
    grep -qE "Couldn't connect|Unable to open file descriptor" "/tmp/$name.client" || break
  done
  [ -n "$srv" ] && wait $srv
  if [ $ok = 0 ]; then status=1; echo "FAILED: ${cmd[*]} $peer"; tail -n 5 "/tmp/$name.client"; return; fi
  printf '%-32s %s\n' "$tool $*" "$(grep -A1 '#bytes' "/tmp/$name.client" | tail -n 1 | tr -s ' \t' ' ')"
}
if [ $role != server ]; then echo "ib_write_bw: #bytes #iterations BW-peak BW-average[MB/s] MsgRate[Mpps]"; fi
perf bw64k ib_write_bw -s 65536 -D 4
perf bw1m ib_write_bw -s 1048576 -D 4
if [ $role != server ]; then echo "ib_write_lat: #bytes #iterations t_min t_max t_typical t_avg t_stdev 99% 99.9% [usec]"; fi
perf lat8 ib_write_lat -s 8 -n 2000
exit $status
EOF
  run "$@" -- "bash $script"
}

case ${1:-} in
  setup) shift; setup ;;
  run) shift; run "$@" ;;
  selftest) shift; selftest "$@" ;;
  clean) rm -rf "$WORK" ;;
  *) sed -n '2,35p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
