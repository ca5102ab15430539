#!/usr/bin/env bash
# fedge flash kit: turns a fresh Raspberry Pi OS Lite 64-bit (or JetPack 6) system into a fleet member.
#
#   sudo bash /PATH/TO/KIT/install.sh            # from the kit's directory, wherever it was copied
#
# Checks the device first (64-bit, Python 3.10+, enough memory for the client, enough free disk), then
# creates the system user "fedge" and the venv /opt/fedge/.venv, installs torch (a Pi: the pinned
# CPU-only build from PyTorch's index; a Jetson: NVIDIA's wheel placed in the kit) and fedge's client
# extra from the wheel in the kit, and the kit's apps (apps/: wheels checked against apps/SHA256SUMS,
# installed with their dependencies, then listed by fedge-client apps as apps/apps.txt says), installs
# this device's bundle as /etc/fedge/bundle.toml (0600, root) and removes the kit's copy, its data (in
# the kit, or fetched and checked by SHA-256), /etc/fedge/client.env and the systemd unit, enables the
# unit and, when systemd runs, starts it and waits until the client says the broker passed its
# presence back (it is online for the coordinator).
#
# Re-run it at will: every step checks what is there first, so a second run changes nothing; a kit
# with a newer fedge wheel upgrades fedge alone (torch stays), one with other app wheels the apps.
# It never prints the bundle.
# Exit status: 0 installed (and online, when it could check), 1 an error, 2 a bad option,
# 3 installed and running but not seen online within --wait-online seconds.
#
# Options: --prefix DIR (default /opt/fedge)  --keep-bundle (leave the kit's bundle in place)
#          --no-start (install and enable, do not start)  --wait-online S (default 120)
#          --ignore-memory (install on a device with less memory than the client needs)  -h|--help
set -euo pipefail
umask 022

KIT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PREFIX=/opt/fedge
KEEP_BUNDLE=0
START=1
WAIT_ONLINE=120
IGNORE_MEMORY=0
ETC=/etc/fedge
STATE=/var/lib/fedge
UNIT=/etc/systemd/system/fedge-client.service
# where the memory limits are read (the kernel's files; a test points them elsewhere)
MEMINFO=/proc/meminfo
PROC_CGROUP=/proc/self/cgroup
CGROUP_FS=/sys/fs/cgroup
T0=$(date +%s)
STEP_T=$T0

say() { printf '[fedge-kit] %s\n' "$*"; }
warn() { printf '[fedge-kit] warning: %s\n' "$*" >&2; }
fail() { printf '[fedge-kit] error: %s\n' "$*" >&2; exit 1; }
# "done <step>": one line per finished step with its seconds, which fleet owners and benchmarks read.
done_step() { local now; now=$(date +%s); say "step $1 done in $((now - STEP_T)) s"; STEP_T=$now; }

# The memory this system lets the client use, in MiB: the least of MemTotal and every memory cgroup
# limit on the way from this process's cgroup to the root (cgroup v2 memory.max, v1 limit_in_bytes).
memory_limit_mib() {
    local best limit base name path file _id ctrl
    best=$(awk '/^MemTotal:/ { print int($2 / 1024) }' "$MEMINFO" 2>/dev/null || true)
    [ -n "$best" ] || return 0   # no /proc: nothing to tell
    [ -r "$PROC_CGROUP" ] || { echo "$best"; return 0; }
    while IFS=: read -r _id ctrl path; do
        case "$ctrl" in
            "") set -- "$CGROUP_FS" "$CGROUP_FS/unified"; name=memory.max ;;
            *memory*) set -- "$CGROUP_FS/memory"; name=memory.limit_in_bytes ;;
            *) continue ;;
        esac
        for base in "$@"; do
            while :; do
                file="$base${path%/}/$name"
                if [ -r "$file" ]; then
                    limit=$(cat "$file")
                    if [ "$limit" != max ] && [ $((limit / 1048576)) -lt "$best" ]; then
                        best=$((limit / 1048576))
                    fi
                fi
                if [ -z "$path" ] || [ "$path" = / ]; then break; fi
                path=$(dirname "$path")
            done
        done
    done < "$PROC_CGROUP"
    echo "$best"
}

# A device with less memory than FEDGE_LOW_MEMORY_BELOW_MIB gets the allocator settings a kit made with
# --low-memory has (a smaller peak, slower training), unless its client.env sets the allocator already.
small_board_settings() {
    local env=$1 have setting
    [ -n "${FEDGE_LOW_MEMORY_ENV:-}" ] || return 0   # a kit.env from before these settings
    ! grep -q '^MALLOC_MMAP_THRESHOLD_=' "$env" || return 0
    have=$(memory_limit_mib)
    [ -n "$have" ] && [ "$have" -lt "${FEDGE_LOW_MEMORY_BELOW_MIB:-1024}" ] || return 0
    echo "# added by install.sh: this device lets the client use $have MiB, under $FEDGE_LOW_MEMORY_BELOW_MIB" >> "$env"
    for setting in $FEDGE_LOW_MEMORY_ENV; do
        echo "$setting" >> "$env"
    done
    say "memory: $have MiB, under ${FEDGE_LOW_MEMORY_BELOW_MIB}: the service gets the low-memory settings ($FEDGE_LOW_MEMORY_ENV: a smaller peak, slower training)"
}

# Refuse a device that cannot hold the client: below its need the kernel kills the service seconds
# after each start, before it logs a line.
check_memory() {
    local have
    have=$(memory_limit_mib)
    if [ -z "$have" ]; then
        warn "could not read this device's memory ($MEMINFO); the client needs about ${FEDGE_NEED_MIB:-?} MiB"
    elif [ "$have" -lt "${FEDGE_NEED_MIB:-0}" ]; then
        local text="this device lets a process use $have MiB (MemTotal, or a memory cgroup's limit), but fedge's client needs about ${FEDGE_NEED_WHY:-$FEDGE_NEED_MIB MiB}; the service would be killed for want of memory at every start. Give the device more memory (raise the container's or cgroup's limit), or make the kit for a smaller model or batch size (fedge-coordinator kit --model/--batch-size)"
        [ "$IGNORE_MEMORY" = 1 ] || fail "$text, or run install.sh --ignore-memory to install anyway"
        warn "$text (installing anyway: --ignore-memory)"
    else
        say "memory: $have MiB here, the client needs about ${FEDGE_NEED_MIB:-?} MiB"
    fi
}

# Free space (MB) on the filesystem that will hold PATH, which need not exist yet.
free_mb() {
    local at=$1
    while [ ! -e "$at" ]; do at=$(dirname "$at"); done
    df -Pm "$at" | awk 'NR == 2 { print $4 }'
}

# What this run will write into the venv, in MB: torch's download and install when torch is missing,
# fedge and its client extra always (a re-run that skips both needs little, but checking is cheap).
check_space() {
    local need=$1 have
    have=$(free_mb "$PREFIX")
    if [ "$have" -lt "$need" ]; then
        fail "$PREFIX needs about $need MB free for this install but its filesystem has $have MB; free space (sudo apt-get clean, remove old files) or give a larger card, or another --prefix"
    fi
    say "disk: $have MB free at $PREFIX, this install needs about $need MB"
}

make_venv() {
    [ -x "$VENV/bin/python" ] && return 0
    mkdir -p "$PREFIX"
    if ! python3 -m venv "$VENV" 2>/dev/null; then
        command -v apt-get >/dev/null || fail "python3 -m venv failed and there is no apt-get to install python3-venv"
        # a fresh image has no package lists yet: install would find no python3-venv
        say "installing python3-venv (apt-get update first)"
        DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null \
            || fail "apt-get update failed: check the network (ping deb.debian.org) and /etc/apt/sources.list"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3-venv >/dev/null \
            || fail "apt-get install python3-venv failed; see apt's message above"
        rm -rf "$VENV"
        python3 -m venv "$VENV"
    fi
}

have_torch() { "$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null || true; }

# pip of the venv; its downloads go to a folder beside the venv rather than to /tmp (a small tmpfs on
# some images) and nothing is cached, so the space checked above is the space used.
pip_install() {
    local tmp="$PREFIX/.pip-tmp" code=0
    mkdir -p "$tmp"
    TMPDIR="$tmp" "$VENV/bin/python" -m pip --disable-pip-version-check --no-cache-dir install -q "$@" || code=$?
    rm -rf "$tmp"
    return "$code"
}

# torch: the one heavy package, installed first and pinned, so fedge's torch>=2.1 never pulls another
install_torch() {
    local current wanted
    current=$(have_torch)
    if [ "$FEDGE_KIT_TARGET" = jetson ]; then
        if [ -n "${TORCH_WHEEL:-}" ] && [ -f "$KIT/$TORCH_WHEEL" ]; then
            wanted=$(echo "$TORCH_WHEEL" | cut -d- -f2)
            if [ "$current" != "$wanted" ]; then
                say "installing NVIDIA's torch $wanted from the kit (about ${TORCH_INSTALLED_MB:-?} MB installed)"
                pip_install "$KIT/$TORCH_WHEEL"
            fi
        elif [ -z "$current" ]; then
            fail "no torch in $VENV and none in the kit: put NVIDIA's PyTorch wheel for this JetPack in $KIT and set TORCH_WHEEL in kit.env"
        fi
    else
        wanted="${TORCH_SPEC#torch==}"
        if [ "${current%%+*}" != "${wanted%%+*}" ]; then
            say "installing $TORCH_SPEC, ${TORCH_FROM:-from the package index}: about ${TORCH_DOWNLOAD_MB:-?} MB to download, about ${TORCH_INSTALLED_MB:-?} MB installed (the largest step; minutes on a Pi)"
            local index=()
            [ -z "${TORCH_INDEX:-}" ] || index=(--index-url "$TORCH_INDEX")
            # shellcheck disable=SC2086  # TORCH_PIP_ARGS is a list of words
            pip_install "${index[@]}" ${TORCH_PIP_ARGS:-} "$TORCH_SPEC" \
                || fail "pip could not install $TORCH_SPEC${TORCH_INDEX:+ from $TORCH_INDEX}; see pip's message above (no network? a pin that index does not have?)"
        fi
    fi
    [ -n "$(have_torch)" ] || fail "torch does not import in $VENV; see the pip output above"
}

# fedge and the rest of its extra (client, or private-client with the privacy accountant); a different
# wheel (a new build) or extra replaces fedge alone
install_fedge() {
    local extra="${FEDGE_EXTRA:-client}" stamp="$PREFIX/.fedge-wheel.sha256" sum
    sum="$(sha256sum "$KIT/$FEDGE_WHEEL" | cut -d' ' -f1) $extra"
    if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$sum" ]; then
        say "installing $FEDGE_WHEEL [$extra]"
        pip_install --force-reinstall --no-deps "$KIT/$FEDGE_WHEEL"
        pip_install "${KIT}/${FEDGE_WHEEL}[${extra}]"
        echo "$sum" > "$stamp"
    fi
    "$VENV/bin/fedge-client" run --help >/dev/null || fail "fedge-client does not start; see the error above"
}

# The fleet owner's apps (fedge-coordinator kit --app): the wheels in the kit's apps/, checked against its
# manifest, installed into the venv beside fedge with their own dependencies, from the package index and
# the index torch came from (so a torch-family dependency is its CPU build), torch held at the installed
# version (no dependency may pull another torch). Other wheels than the last install's (by SHA-256) are
# installed anew. Then fedge-client imports every installed app to list it, and each of the kit's must be
# listed with the identity apps/apps.txt gives, the coordinator's: a device with another would refuse tasks,
# and one that does not load would stop the service.
install_apps() {
    local apps="$KIT/apps" stamp="$PREFIX/.fedge-apps.sha256" sum torch name version digest weights listed line
    local wheels=() index=()
    [ -f "$apps/SHA256SUMS" ] || return 0
    (cd "$apps" && sha256sum --quiet -c SHA256SUMS) \
        || fail "the app wheels in $apps do not match the kit's manifest ($apps/SHA256SUMS): copy the kit again"
    while read -r _ name; do wheels+=("$apps/$name"); done < "$apps/SHA256SUMS"
    sum=$(sha256sum "$apps/SHA256SUMS" | cut -d' ' -f1)
    if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$sum" ]; then
        say "installing the apps ${FEDGE_APPS:-} from ${wheels[*]##*/} and their dependencies"
        torch=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))') \
            || fail "no torch in $VENV to install the apps beside"
        [ -z "${TORCH_INDEX:-}" ] || index=(--extra-index-url "$TORCH_INDEX")
        pip_install --force-reinstall --no-deps "${wheels[@]}"
        # shellcheck disable=SC2086  # TORCH_PIP_ARGS is a list of words
        pip_install "${index[@]}" ${TORCH_PIP_ARGS:-} "${wheels[@]}" "torch==$torch" \
            || fail "pip could not install the apps' dependencies; see pip's message above (no network? a dependency that needs another torch than $torch?)"
        echo "$sum" > "$stamp"
    fi
    # an app that does not load is named above; it fails the install below only when it is one of the kit's
    listed=$("$VENV/bin/fedge-client" apps) || warn "fedge-client apps names an installed app that does not load"
    while IFS= read -r line; do
        read -r name version digest weights <<< "$line"
        if ! grep -qxF "$line" <<< "$listed"; then
            fail "fedge-client apps does not list app $name $version with digest $digest${weights:+ and $weights}, the coordinator's, as the kit expects; it lists $(awk '{ printf "%s%s %s (digest %.12s)", (NR > 1 ? ", " : ""), $1, $2, $3 }' <<< "$listed")"
        fi
        say "app $name $version (digest ${digest:0:12}) installed"
    done < "$apps/apps.txt"
}

# The app the service runs (client.env's FEDGE_APP): a kit with several apps must be told which.
check_app_choice() {
    local app
    [ -n "${FEDGE_APPS:-}" ] || return 0
    app=$(sed -n 's/^FEDGE_APP=//p' "$KIT/client.env")
    [ -n "$app" ] || fail "this kit installs the apps $FEDGE_APPS: say which this device runs with FEDGE_APP=NAME in $KIT/client.env (the service's fedge-client run --app), then run install.sh again"
    case " $FEDGE_APPS vision " in
        *" $app "*) ;;
        *) fail "FEDGE_APP=$app in $KIT/client.env is none of this kit's apps ($FEDGE_APPS) nor vision" ;;
    esac
}

# Download URL to FILE with whatever the image has (Pi OS Lite has curl and wget; python3 always).
fetch() {
    local url=$1 file=$2
    if command -v curl >/dev/null; then
        curl -fsSL --retry 3 -o "$file" "$url"
    elif command -v wget >/dev/null; then
        wget -q -O "$file" "$url"
    else
        python3 -c 'import shutil, sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=60) as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)' "$url" "$file"
    fi
}

# This device's data: the kit's data.npz, or DATA_URL fetched and checked against DATA_SHA256 (data too
# large for a boot partition), installed as STATE/data.npz; else the device has it at FEDGE_DATA already.
install_data() {
    local owner=()
    if [ "$(id -u)" = 0 ] && id fedge >/dev/null 2>&1; then owner=(-o fedge -g fedge); fi
    if [ -f "$KIT/data.npz" ]; then
        install -m 0640 "${owner[@]}" "$KIT/data.npz" "$STATE/data.npz"
    elif [ -n "${DATA_URL:-}" ]; then
        if [ -f "$STATE/data.npz" ] && [ "$(sha256sum "$STATE/data.npz" | cut -d' ' -f1)" = "$DATA_SHA256" ]; then
            say "data: $STATE/data.npz is already the one $DATA_URL holds"
            return 0
        fi
        say "fetching this device's data from $DATA_URL"
        local part="$STATE/.data.npz.part" got
        fetch "$DATA_URL" "$part" || { rm -f "$part"; fail "could not fetch $DATA_URL; check the URL and that this device reaches it"; }
        got=$(sha256sum "$part" | cut -d' ' -f1)
        if [ "$got" != "$DATA_SHA256" ]; then
            rm -f "$part"
            fail "the data at $DATA_URL has SHA-256 $got, not the $DATA_SHA256 the kit expects: upload the right file, or make the kit again with this file's sha256sum"
        fi
        chmod 0640 "$part"
        [ ${#owner[@]} = 0 ] || chown fedge:fedge "$part"
        mv -f "$part" "$STATE/data.npz"
        say "data: $(du -h "$STATE/data.npz" | cut -f1) checked by SHA-256"
    fi
    # the service's --data: a file it names (npz:PATH, or an app's absolute path) must be on this device
    local spec path=""
    spec=$(sed -n 's/^FEDGE_DATA=//p' "$KIT/client.env")
    case "$spec" in
        npz:*) path=${spec#npz:} ;;
        /*) path=$spec ;;
    esac
    if [ -n "$path" ] && [ ! -e "$path" ]; then
        warn "the service's data $path is not on this device yet; put it there (or make the kit with --data-file, --data-dir or --data-url) before the first round"
    fi
}

# The client's lines since the service's last start (the journal; a test gives its own).
service_log() { journalctl -u fedge-client --since "@$1" -o cat --no-pager 2>/dev/null; }
service_running() { systemctl is-active -q fedge-client; }
service_failure() {
    local result
    result=$(systemctl show -p Result --value fedge-client 2>/dev/null || true)
    if [ "$result" = oom-kill ]; then
        echo "it was killed for want of memory (systemd: oom-kill)"
    else
        echo "systemd says: ${result:-unknown}"
    fi
}

# Wait until the client logs that the broker passed its presence back: then it is online for the
# coordinator. Sets ONLINE to yes, no (still running, not online after the wait) or unknown (no journal).
wait_online() {
    local since=$1 deadline=$(( $(date +%s) + WAIT_ONLINE ))
    ONLINE=unknown
    [ -n "${FEDGE_ONLINE_LINE:-}" ] || return 0   # a kit.env that does not say what to wait for
    ONLINE=no
    while [ "$(date +%s)" -le "$deadline" ]; do
        if service_log "$since" | grep -qF "$FEDGE_ONLINE_LINE"; then
            ONLINE=yes
            return 0
        fi
        if ! service_running; then
            fail "fedge-client stopped $(( $(date +%s) - since )) s after it started; $(service_failure). Its last lines: journalctl -u fedge-client -n 30"
        fi
        sleep 1
    done
}

main() {
    while [ $# -gt 0 ]; do
        case "$1" in
            --prefix) PREFIX="${2:?--prefix needs a directory}"; shift 2 ;;
            --keep-bundle) KEEP_BUNDLE=1; shift ;;
            --no-start) START=0; shift ;;
            --wait-online) WAIT_ONLINE="${2:?--wait-online needs seconds}"; shift 2 ;;
            --ignore-memory) IGNORE_MEMORY=1; shift ;;
            -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}"; exit 0 ;;
            *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
        esac
    done
    VENV="$PREFIX/.venv"

    [ "$(id -u)" = 0 ] || fail "run it as root: sudo bash $KIT/install.sh"
    [ -f "$KIT/kit.env" ] || fail "$KIT/kit.env is missing: make the kit again with fedge-coordinator kit"
    # shellcheck source=/dev/null
    . "$KIT/kit.env"
    : "${FEDGE_KIT_TARGET:?kit.env names no target}" "${FEDGE_WHEEL:?kit.env names no fedge wheel}"

    case "$(uname -m)" in
        aarch64|x86_64) ;;
        armv7l|armv6l) fail "this is a 32-bit OS ($(uname -m)): PyTorch has no wheels for it; flash the 64-bit Raspberry Pi OS" ;;
        *) fail "unsupported machine $(uname -m): fedge devices are 64-bit ARM (or x86-64)" ;;
    esac
    command -v python3 >/dev/null || fail "python3 is missing: apt-get install python3"
    python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
        || fail "python3 is $(python3 -V 2>&1 | cut -d' ' -f2); fedge needs 3.10 or newer (Pi OS Bookworm, JetPack 6)"
    [ -f "$KIT/$FEDGE_WHEEL" ] || fail "the fedge wheel $FEDGE_WHEEL is not in $KIT"
    say "kit for ${FEDGE_KIT_TARGET} on $(uname -m), python $(python3 -V 2>&1 | cut -d' ' -f2), into $PREFIX"

    # 0. will it fit: memory for the client, disk for what this run installs
    check_memory
    check_app_choice
    local need=$(( ${FEDGE_MB:-200} + 100 ))
    if [ -z "$([ -x "$VENV/bin/python" ] && have_torch)" ]; then
        need=$(( need + ${TORCH_DOWNLOAD_MB:-0} + ${TORCH_INSTALLED_MB:-0} ))
    fi
    check_space "$need"
    done_step checks

    # 1. the service's user
    if ! id fedge >/dev/null 2>&1; then
        useradd --system --home-dir "$STATE" --shell /usr/sbin/nologin fedge
    fi
    done_step user

    # 2. the venv
    make_venv
    done_step venv

    # 3. torch
    install_torch
    done_step torch

    # 4. fedge, and the apps the kit holds
    install_fedge
    done_step fedge
    if [ -d "$KIT/apps" ]; then
        install_apps
        done_step apps
    fi

    # 5. the bundle (it holds the device's password): root-only, and gone from the kit once installed
    install -d -m 0700 -o root -g root "$ETC"
    if [ -f "$KIT/bundle.toml" ]; then
        install -m 0600 -o root -g root "$KIT/bundle.toml" "$ETC/bundle.toml"
        if [ "$KEEP_BUNDLE" = 0 ]; then
            shred -u "$KIT/bundle.toml" 2>/dev/null || rm -f "$KIT/bundle.toml"
        fi
    elif [ ! -f "$ETC/bundle.toml" ]; then
        fail "no bundle: neither $KIT/bundle.toml nor $ETC/bundle.toml exists; make the kit again"
    fi
    local client_id
    client_id=$(sed -n 's/^client_id *= *"\(.*\)"/\1/p' "$ETC/bundle.toml")
    done_step bundle

    # 6. data, state and the service's environment
    install -d -m 0750 -o fedge -g fedge "$STATE"
    install_data
    install -m 0644 -o root -g root "$KIT/client.env" "$ETC/client.env"
    small_board_settings "$ETC/client.env"
    done_step data

    # 7. the unit
    install -m 0644 -o root -g root "$KIT/fedge-client.service" "$UNIT"
    if command -v systemd-analyze >/dev/null; then
        systemd-analyze verify "$UNIT" || fail "systemd-analyze rejects $UNIT"
    fi
    local state code=0
    if [ -d /run/systemd/system ]; then
        systemctl daemon-reload
        systemctl enable -q fedge-client
        if [ "$START" = 1 ]; then
            local since
            since=$(date +%s)
            systemctl restart fedge-client
            ONLINE=unknown
            if command -v journalctl >/dev/null; then
                say "waiting up to $WAIT_ONLINE s for the device to announce itself to the broker"
                wait_online "$since"
            fi
            case "$ONLINE" in
                yes) state="running, online on the broker" ;;
                no) state="running, but NOT seen online within $WAIT_ONLINE s"; code=3
                    warn "the client runs but has not said the broker passed its presence back: is the broker up and reachable from here? journalctl -u fedge-client -n 30" ;;
                *) state="running (could not check it is online: no journal)" ;;
            esac
        else
            state="enabled, not started (--no-start)"
        fi
    elif command -v systemctl >/dev/null; then
        systemctl enable -q fedge-client 2>/dev/null || true
        state="enabled; systemd is not running here, so it starts at the next boot (not checked online)"
    else
        state="installed; no systemd here, so start it the way the unit does (not checked online)"
    fi
    done_step service

    local versions
    versions=$("$VENV/bin/python" -c 'import importlib.metadata as m, torch; print("fedge", m.version("fedge"), "torch", torch.__version__)')
    say "ok: $versions${FEDGE_APPS:+, apps $FEDGE_APPS}, device ${client_id:-?}, service $state, in $(( $(date +%s) - T0 )) s"
    return "$code"
}

# Run when executed; when sourced (the tests), only define the functions.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    main "$@"
fi
