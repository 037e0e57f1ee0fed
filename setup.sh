#!/usr/bin/env bash
# System packages for the local desktops (Debian/Ubuntu, as root): the X server, a window manager,
# a taskbar, the desktop's apps, and the tools the VM server uses to inspect windows.
# Run once on a fresh machine: `sudo bash setup.sh`.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends \
  xvfb openbox tint2 pcmanfm xterm mousepad galculator x11-apps x11-utils \
  xdotool wmctrl xclip scrot python3-tk fonts-dejavu-core tesseract-ocr
