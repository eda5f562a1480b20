"""`./fork test`'s network: a namespace of its own with only loopback where this user
can make one (forktool/loopback.py), the host's network with a line saying so where
not."""

from __future__ import annotations

import json
import subprocess
import sys

from forktool import loopback

# What a command run through the wrapper sees: its interfaces, and whether a listener
# on every interface (as Mooncake's handshake port binds) answers on loopback.
PROBE = (
    "import json, socket\n"
    "srv = socket.socket(); srv.bind(('0.0.0.0', 0)); srv.listen()\n"
    "c = socket.create_connection(('127.0.0.1', srv.getsockname()[1]), timeout=5)\n"
    "print(json.dumps(sorted(n for _, n in socket.if_nameindex())))\n"
)


def test_the_wrapped_command_sees_only_loopback_and_loopback_works():
    argv, line = loopback.wrap(sys.executable, [sys.executable, "-c", PROBE])
    got = json.loads(
        subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    )
    if loopback.unshare_argv() is None:
        # No namespace for this user: the command runs as given, and the line says so.
        assert argv == [sys.executable, "-c", PROBE]
        assert "host's network" in line
        assert got == loopback.interfaces()
    else:
        assert got == ["lo"]
        assert "only loopback" in line
