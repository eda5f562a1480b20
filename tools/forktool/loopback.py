"""Run a command in a network namespace of its own whose only interface is loopback.

`./fork test` runs pytest this way (after its set-up, which needs the package index).
NOTE: Mooncake 0.3.13's transfer engine listens on every interface, in every process that
opens a store (its P2P handshake port binds INADDR_ANY/in6addr_any with no option to narrow
it, transfer_metadata_plugin.cpp), so in a test on the host's network the store's ports are
reachable from beyond 127.0.0.1. Inside a namespace with only `lo` there is nothing beyond
127.0.0.1 to reach them from: the tests' listeners are private to the run, and a test cannot
reach the network either.

Run as a script (`python loopback.py CMD...`) inside `unshare --net`, it brings `lo` up and
execs CMD; it imports nothing of the fork, so the venv's Python can run it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import struct
import subprocess
import sys

# <linux/sockios.h>, <net/if.h>
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1


def unshare_argv() -> list[str] | None:
    """The `unshare` invocation that gives a new network namespace here, or None where this
    user may not make one (no `unshare`, or no CAP_SYS_ADMIN and no user namespaces)."""
    exe = shutil.which("unshare")
    if exe is None:
        return None
    # NOTE: as root a network namespace needs no user namespace; otherwise one that maps the
    # user to itself (not to root, which would make set-up code believe it may run apt-get).
    argv = [exe, "--net"] if os.geteuid() == 0 else [exe, "--net", "--map-current-user"]
    probe = subprocess.run([*argv, "true"], capture_output=True)
    return argv if probe.returncode == 0 else None


def wrap(python: str, argv: list[str]) -> tuple[list[str], str]:
    """`argv` run in a loopback-only namespace where one can be made, with the line that
    says which network the command gets."""
    unshare = unshare_argv()
    if unshare is None:
        return argv, ("tests run on the host's network: this user cannot make a network "
                      "namespace (unshare --net); Mooncake's ports in the store tests listen "
                      "on every interface")
    return ([*unshare, python, os.path.abspath(__file__), *argv],
            "tests run in a network namespace of their own with only loopback")


def interfaces() -> list[str]:
    return sorted(name for _, name in socket.if_nameindex())


def _bring_loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(s, _SIOCGIFFLAGS, req)[:18])[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | _IFF_UP))


if __name__ == "__main__":
    _bring_loopback_up()
    os.execvp(sys.argv[1], sys.argv[1:])
