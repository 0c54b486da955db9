"""A test package whose entry points exist only for the tests: `write_plugin_package(root)`
writes `fsplug_test/` and its `fsplug_test-0.1.dist-info/entry_points.txt` under `root`, which
the tests put on sys.path (in process) or PYTHONPATH (subprocesses). No pip install."""

from __future__ import annotations

from pathlib import Path

ENTRY_POINTS = """\
[fleetserve.general_plugins]
general_ok = fsplug_test:general_ok
general_raises = fsplug_test:general_raises
broken_import = fsplug_test.broken:setup

[fleetserve.server_plugins]
hello = fsplug_test.server:register
"""

INIT = '''\
import os


def log(event):
    """Append `event pid` to $FSPLUG_LOG: which process ran what."""
    path = os.environ.get("FSPLUG_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{event} {os.getpid()}\\n")


def general_ok():
    log("general_ok")
    from fleetserve.engine.models.oot_registry import register_model

    register_model("TinyOotForCausalLM", "fsplug_test.model:TinyOotForCausalLM")


def general_raises():
    log("general_raises")
    raise RuntimeError("boom from general_raises")
'''

BROKEN = 'raise ImportError("fsplug_test.broken cannot be imported")\n'

SERVER = """\
from aiohttp import web

from fsplug_test import log

log("server_import")


async def hello(request):
    return web.json_response({"hello": "from a plugin"})


def register(app):
    app.router.add_get("/hello", hello)
"""

MODEL = '''\
from fleetserve.engine.models.llama import LlamaForCausalLM


class TinyOotForCausalLM(LlamaForCausalLM):
    """An out-of-tree architecture: Llama's decoder under another name."""
'''


def write_plugin_package(root: Path) -> Path:
    pkg = root / "fsplug_test"
    pkg.mkdir(parents=True)
    for name, text in (("__init__.py", INIT), ("broken.py", BROKEN), ("server.py", SERVER),
                       ("model.py", MODEL)):  # fmt: skip
        (pkg / name).write_text(text)
    info = root / "fsplug_test-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fsplug_test\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    return root
