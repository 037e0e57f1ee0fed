"""vm/: what runs inside each VM, behind vm_server.py (the VM side's one entry point).

    act.py      POST /action: the body checked against the action schema and the screen, done with pyautogui
    tasks.py    POST /setup and /evaluate: the step and check types (task files are checked against them too)
    rules.py    what a request may ask: the program allow-list and argv rules, HOME confinement, field checks
    procs.py    the desktop's processes and windows (spawn, list windows, kill our process tree)
    settle.py   when the screen has settled after an action (?settle=watch)
    desktop.py  the local Xvfb desktop of `vm_server.py --xvfb` (session, icons, HOME template, reset)
    sandbox.py  bubblewrap around a --xvfb desktop and its server

Nothing here imports torch or the trainer side. To serve a desktop of your own VM, copy FILES (below)
into one folder of the VM and run `python vm_server.py` there (docs/vm.md); desktop.py and sandbox.py
are only imported with --xvfb. tests/test_layers.py checks that what vm_server.py imports is FILES,
and the sandbox of a local desktop shows its server exactly these files of the repository.
"""

# What a VM needs of this repository (paths from its root): the server, the action schema it checks
# POST /action with (actions.py: stdlib only), and this folder.
FILES = ("vm_server.py", "actions.py", "vm")
