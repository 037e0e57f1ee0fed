"""task_solutions.py: one scripted solution per task in tasks/, as the Action dicts an agent would send.

Used by tests/test_tasks.py, which proves every shipped task on a real local desktop
(`python -m pytest -q tests/test_tasks.py`): after the task's setup, doing nothing must score 0.0
and replaying SOLUTIONS[task_id] must score 1.0 (infeasible tasks: the last action is `fail`).

The actions are in screen pixels for the 1280x720 `vm_server.py --xvfb` desktop. They lean on the
keyboard wherever the app allows it (a typed command, ctrl+s, the file manager's type-ahead), and
click only at places that never move: the desktop icons, whose positions come from the server's own
layout constant. The test sends every action with `?settle=watch`: the server answers once the
desktop has settled (settle.py), so an app's window or a dialog is up before the next key goes to
it, and no solution needs a `wait` for that. Two are left, around the Enter of a GTK save dialog
(see save_as): GTK's file chooser works on timers of its own, which no watch can see. An evaluator
only looks at the outcome, so any other path to it scores the same.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from desktop import desktop_icons  # noqa: E402 -- the icon layout every --xvfb desktop uses

SCREEN = (1280, 720)
ICONS = desktop_icons(SCREEN)  # label -> (x, y) centre of the icon, e.g. "Terminal" -> (74, 46)


# ---------------------------------------------------------------------------------------------
# Tiny constructors, so a solution reads like the steps a person would take


def launch(label: str) -> list[dict]:
    """Double-click a desktop icon. The watched settle answers once the app's window is up and
    drawn (with a fixed settle this needed a `wait` of 2 s: keys sent before the window exists go
    to the desktop)."""
    x, y = ICONS[label]
    return [{"type": "double_click", "x": x, "y": y}]


def type_(text: str) -> dict:
    return {"type": "type", "text": text}


def key(*keys: str) -> dict:
    return {"type": "key", "keys": list(keys)}


def wait(seconds: int = 1) -> dict:
    return {"type": "wait", "amount": seconds}


def save_as(path: str) -> list[dict]:
    """In a GTK save dialog (focus starts in the Name field): select what is there (Save As fills in
    the current name, with only its stem selected), type a path, wait, press enter, wait. Both waits
    stay: GTK's file chooser works on timers of its own, with nothing running or drawing meanwhile,
    which no watch can see. After the typed path it completes it in the background and turns the
    Save button sensitive (0.1-0.3 s later), and swallows an Enter that comes before (2 of ~36 save
    dialogs in our runs without the first wait); after the Enter it writes the file and closes only
    ~0.5 s later (measured: 0.55-0.6 s, with 0.2 s of stillness before it)."""
    return [key("ctrl", "a"), type_(path), wait(), key("enter"), wait()]


def select(name_prefix: str) -> list[dict]:
    """File manager: select a file by typing the start of its name (type-ahead search), then close
    the search box so the next key goes to the file view again."""
    return [type_(name_prefix), key("escape")]


def goto(path: str) -> list[dict]:
    """File manager: open a folder through the location bar (ctrl+l)."""
    return [key("ctrl", "l"), type_(path), key("enter")]


# pcmanfm opens HOME in a window openbox centres on the 1280x720 screen (its frame spans x 320-960),
# the items in name order along its first row: Desktop, Documents, Downloads, Pictures, notes.txt.
FOLDER_ITEMS = {"Desktop": (528, 215), "Documents": (621, 215), "Downloads": (715, 215), "Pictures": (810, 215)}


def open_item(name: str) -> list[dict]:
    """File manager, just opened on HOME: double-click an item of its first row. The two-screen
    path bench/learning.py --method arpo-multi trains (the desktop icon, then the folder in the
    window it opened), so the test proves that path, not only a keyboard one."""
    x, y = FOLDER_ITEMS[name]
    return [{"type": "double_click", "x": x, "y": y}]


# ---------------------------------------------------------------------------------------------
# task id -> actions

SOLUTIONS: dict[str, list[dict]] = {
    # -- open / close one app
    "terminal-open": launch("Terminal"),
    "editor-open": launch("Text Editor"),
    "calc-open": launch("Calculator"),
    "clock-open": launch("Clock"),
    "files-open-documents": launch("File Manager") + goto("~/Documents"),
    "files-open-downloads": launch("File Manager") + open_item("Downloads"),
    "files-open-pictures": launch("File Manager") + open_item("Pictures"),
    "calc-close": [key("alt", "f4")],  # openbox's close-window binding
    "terminal-close": [type_("exit\n")],

    # -- terminal (setup opened an xterm, which has the focus)
    "terminal-touch-file": [type_("touch ~/ready.flag\n")],
    "terminal-mkdir-nested": [type_("mkdir -p ~/projects/website/assets\n")],
    "terminal-count-lines": [type_("cat ~/data/names.txt | wc -l > ~/data/count.txt\n")],
    "terminal-grep-errors": [type_("grep ERROR ~/logs/app.log > ~/logs/errors.txt\n")],
    "terminal-sort-file": [type_("sort ~/fruits.txt > ~/fruits_sorted.txt\n")],
    "terminal-backup-copy": [type_("cd ~/app\n"), type_("cp config.ini config.ini.bak\n")],
    "terminal-delete-tmp": [type_("rm ~/cache/*.tmp\n")],
    "terminal-list-pictures": [type_("ls ~/Pictures > ~/pictures.txt\n")],

    # -- text editor (setup opened the file, except for editor-new-file)
    "editor-new-file": launch("Text Editor") + [type_("milk, eggs, bread"), key("ctrl", "s")]
    + save_as("~/Documents/shopping.txt"),
    "editor-append-line": [key("ctrl", "end"), type_("water the plants\n"), key("ctrl", "s")],
    # Retyping the whole letter is a legitimate way to replace a name; the check sees only the file.
    "editor-replace-name": [key("ctrl", "a"),
                            type_("Dear Alice,\n\nThank you for the lovely dinner. Alice, your lasagna "
                                  "was the best I have had.\n\nSee you soon,\nCarol\n"),
                            key("ctrl", "s")],
    "editor-save-as": [key("ctrl", "shift", "s")] + save_as("~/Documents/final.txt"),
    "editor-insert-header": [key("ctrl", "home"), type_("name,phone\n"), key("ctrl", "s")],
    "editor-delete-line": [key("ctrl", "home"), key("shift", "down"), key("delete"), key("ctrl", "s")],

    # -- file manager (setup opened the folder; the file view has the focus)
    "files-rename": select("draft") + [key("f2"), key("ctrl", "a"), type_("final_report.txt"),
                                       key("enter")],
    "files-new-folder": [key("ctrl", "shift", "n"), type_("archive"), key("enter")],
    "files-trash-file": select("old") + [key("delete"), key("enter")],  # confirm: Yes
    "files-copy-to-folder": select("holiday") + [key("ctrl", "c")] + goto("~/Backup")
    + [key("ctrl", "v")],
    "files-move-to-folder": select("report") + [key("ctrl", "x")] + goto("~/Documents")
    + [key("ctrl", "v")],

    # -- two apps
    # galculator has the focus: compute, copy the display, paste it into a new editor document.
    "calc-to-editor": [type_("1234*56"), key("enter"), key("ctrl", "c")] + launch("Text Editor")
    + [key("ctrl", "v"), key("ctrl", "s")] + save_as("~/result.txt"),
    # type-ahead + enter opens the file in its default app, the editor.
    "files-open-in-editor": [type_("plan"), key("enter"), key("ctrl", "end"),
                             type_("Deadline: Friday\n"), key("ctrl", "s")],
    # The editor (opened last) has the focus; 4 = a.jpg..d.jpg, which `ls ~/photos/*.jpg | wc -l`
    # in the terminal would tell an agent.
    "terminal-count-to-editor": [key("ctrl", "end"), type_("4"), key("ctrl", "s")],

    # -- infeasible: the right answer is to say so
    "infeasible-browser": [{"type": "fail"}],
    "infeasible-print": [{"type": "fail"}],
    "infeasible-email": [{"type": "fail"}],
    "infeasible-spreadsheet-chart": [{"type": "fail"}],
}
