#!/usr/bin/env bash
# System packages for the local desktops (Debian/Ubuntu): the X server, a window manager, a
# taskbar, the desktop's apps, the tools the VM server uses to inspect windows, and bubblewrap,
# the sandbox each local desktop runs in (started by root, the sandbox runs the desktop as `nobody`
# with setpriv, from util-linux, an essential package every Debian/Ubuntu has). chromium is for the
# tests only: they render view.py's report headless. Run once on a fresh machine: `bash setup.sh`
# (as root, or as a user with sudo).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "setup.sh: run it as root, or install sudo" >&2; exit 1; }
  SUDO="sudo -E"
fi
$SUDO apt-get update -qq
# --no-install-recommends keeps the install small, so everything the desktop needs is named here,
# not left to "Recommends": the icon themes the desktop icons use, the X core fonts xterm draws
# with, the MIME database (file types) and desktop-file-utils (which apps open them). A fresh
# machine has none of these; a developer's machine may have them from elsewhere.
$SUDO apt-get install -y -qq --no-install-recommends \
  xvfb openbox tint2 pcmanfm xterm mousepad galculator x11-apps x11-utils \
  xdotool wmctrl xclip scrot python3-tk fonts-dejavu-core tesseract-ocr \
  lxde-icon-theme adwaita-icon-theme xfonts-base shared-mime-info desktop-file-utils \
  bubblewrap chromium
