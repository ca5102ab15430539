#!/usr/bin/env bash
# fedge flash kit: turns a fresh Raspberry Pi OS Lite 64-bit (or JetPack 6) system into a fleet member.
#
#   sudo bash /PATH/TO/KIT/install.sh            # from the kit's directory, wherever it was copied
#
# Creates the system user "fedge" and the venv /opt/fedge/.venv, installs torch (a Pi: the pinned
# CPU build from the package index; a Jetson: NVIDIA's wheel placed in the kit) and fedge's client
# extra from the wheel in the kit, installs this device's bundle as /etc/fedge/bundle.toml (0600,
# root) and removes the kit's copy, its data (when the kit has one), /etc/fedge/client.env and the
# systemd unit, enables the unit and, when systemd runs, starts it and checks it stays up.
#
# Re-run it at will: every step checks what is there first, so a second run changes nothing, and a
# kit with a newer fedge wheel upgrades fedge alone (torch stays). It never prints the bundle.
#
# Options: --prefix DIR (default /opt/fedge)  --keep-bundle (leave the kit's bundle in place)
#          --no-start (install and enable, do not start)  -h|--help
set -euo pipefail
umask 022

KIT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PREFIX=/opt/fedge
KEEP_BUNDLE=0
START=1
while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) PREFIX="${2:?--prefix needs a directory}"; shift 2 ;;
        --keep-bundle) KEEP_BUNDLE=1; shift ;;
        --no-start) START=0; shift ;;
        -h|--help) sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done

VENV="$PREFIX/.venv"
ETC=/etc/fedge
STATE=/var/lib/fedge
UNIT=/etc/systemd/system/fedge-client.service
T0=$(date +%s)
STEP_T=$T0

say() { printf '[fedge-kit] %s\n' "$*"; }
fail() { printf '[fedge-kit] error: %s\n' "$*" >&2; exit 1; }
# "done <step>": one line per finished step with its seconds, which fleet owners and benchmarks read.
done_step() { local now; now=$(date +%s); say "step $1 done in $((now - STEP_T)) s"; STEP_T=$now; }

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

# 1. the service's user
if ! id fedge >/dev/null 2>&1; then
    useradd --system --home-dir "$STATE" --shell /usr/sbin/nologin fedge
fi
done_step user

# 2. the venv
if [ ! -x "$VENV/bin/python" ]; then
    mkdir -p "$PREFIX"
    if ! python3 -m venv "$VENV" 2>/dev/null; then
        command -v apt-get >/dev/null || fail "python3 -m venv failed and there is no apt-get to install python3-venv"
        say "installing python3-venv"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3-venv >/dev/null
        rm -rf "$VENV"
        python3 -m venv "$VENV"
    fi
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
done_step venv

# 3. torch: the one heavy package, installed first and pinned, so fedge's torch>=2.1 never pulls another
have_torch() { "$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null || true; }
current=$(have_torch)
if [ "$FEDGE_KIT_TARGET" = jetson ]; then
    if [ -n "${TORCH_WHEEL:-}" ] && [ -f "$KIT/$TORCH_WHEEL" ]; then
        wanted=$(echo "$TORCH_WHEEL" | cut -d- -f2)
        if [ "$current" != "$wanted" ]; then
            say "installing NVIDIA's torch $wanted"
            "${PIP[@]}" install -q "$KIT/$TORCH_WHEEL"
        fi
    elif [ -z "$current" ]; then
        fail "no torch in $VENV and none in the kit: put NVIDIA's PyTorch wheel for this JetPack in $KIT and set TORCH_WHEEL in kit.env"
    fi
else
    wanted="${TORCH_SPEC#torch==}"
    if [ "${current%%+*}" != "${wanted%%+*}" ]; then
        say "installing $TORCH_SPEC (the largest download; minutes on a Pi)"
        # shellcheck disable=SC2086
        "${PIP[@]}" install -q ${TORCH_PIP_ARGS:-} "$TORCH_SPEC"
    fi
fi
[ -n "$(have_torch)" ] || fail "torch does not import in $VENV; see the pip output above"
done_step torch

# 4. fedge and the rest of its extra (client, or private-client with the privacy accountant); a different
# wheel (a new build) or extra replaces fedge alone
EXTRA="${FEDGE_EXTRA:-client}"
stamp="$PREFIX/.fedge-wheel.sha256"
sum="$(sha256sum "$KIT/$FEDGE_WHEEL" | cut -d' ' -f1) $EXTRA"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$sum" ]; then
    say "installing $FEDGE_WHEEL [$EXTRA]"
    "${PIP[@]}" install -q --force-reinstall --no-deps "$KIT/$FEDGE_WHEEL"
    "${PIP[@]}" install -q "$KIT/$FEDGE_WHEEL[$EXTRA]"
    echo "$sum" > "$stamp"
fi
"$VENV/bin/fedge-client" run --help >/dev/null || fail "fedge-client does not start; see the error above"
done_step fedge

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
client_id=$(sed -n 's/^client_id *= *"\(.*\)"/\1/p' "$ETC/bundle.toml")
done_step bundle

# 6. data, state and the service's environment
install -d -m 0750 -o fedge -g fedge "$STATE"
if [ -f "$KIT/data.npz" ]; then
    install -m 0640 -o fedge -g fedge "$KIT/data.npz" "$STATE/data.npz"
fi
install -m 0644 -o root -g root "$KIT/client.env" "$ETC/client.env"
done_step data

# 7. the unit
install -m 0644 -o root -g root "$KIT/fedge-client.service" "$UNIT"
if command -v systemd-analyze >/dev/null; then
    systemd-analyze verify "$UNIT" || fail "systemd-analyze rejects $UNIT"
fi
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload
    systemctl enable -q fedge-client
    if [ "$START" = 1 ]; then
        systemctl restart fedge-client
        sleep 5
        systemctl is-active -q fedge-client \
            || fail "fedge-client did not stay up: journalctl -u fedge-client -n 30"
        state="running"
    else
        state="enabled, not started (--no-start)"
    fi
elif command -v systemctl >/dev/null; then
    systemctl enable -q fedge-client 2>/dev/null || true
    state="enabled; systemd is not running here, so it starts at the next boot"
else
    state="installed; no systemd here, so start it the way the unit does"
fi
done_step service

versions=$("$VENV/bin/python" -c 'import importlib.metadata as m, torch; print("fedge", m.version("fedge"), "torch", torch.__version__)')
say "ok: $versions, device ${client_id:-?}, service $state, in $(( $(date +%s) - T0 )) s"
