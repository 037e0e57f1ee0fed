#!/usr/bin/env bash
# System packages for the local desktops (Debian/Ubuntu, as root): the X server, a window manager,
# a taskbar, the desktop's apps, and the tools the VM server uses to inspect windows.
# chromium is for the tests only: they render view.py's report headless.
# Run once on a fresh machine: `sudo bash setup.sh`.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends \
  xvfb openbox tint2 pcmanfm xterm mousepad galculator x11-apps x11-utils \
  xdotool wmctrl xclip scrot python3-tk fonts-dejavu-core tesseract-ocr \
  chromium
# The desktop's look and fonts (vm_server.py --xvfb). These are only "Recommends" of the packages
# above, so --no-install-recommends would skip them: the icon themes the desktop icons use, and
# the X core fonts xterm draws with.
apt-get install -y -qq --no-install-recommends lxde-icon-theme adwaita-icon-theme xfonts-base
