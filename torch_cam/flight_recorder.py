"""The flight recorder: the last ops of every cam group of this process (csrc/core/
flight_recorder.hpp states the format). Each group keeps ``flight_recorder_entries`` of them and
writes the dump by itself when it fails (a timeout, a dead or failed peer); these functions read
or write it on demand, e.g. from a signal handler or a watchdog of one's own.
``python -m torch_cam.trace DUMP...`` reads the dumps of all ranks."""
from __future__ import annotations

import json

from . import _C
from .config import Options


def flight_recorder(reason: str = "on demand") -> dict:
    """This process's flight recorder, every live cam group, as a dict."""
    return json.loads(_C.flight_recorder_json(reason))


def dump_flight_recorder(path: str | None = None, reason: str = "on demand") -> str:
    """Writes this process's flight recorder to ``path`` (default: the file a failure would
    write, ``<flight_recorder_path><global rank>.json``) and returns the path."""
    if path is None:
        prefix = Options.from_env().flight_recorder_path
        if not prefix:
            raise ValueError("torch_cam.dump_flight_recorder: no path given and TORCH_CAM_FLIGHT_RECORDER_PATH is empty")
        path = f"{prefix}{flight_recorder()['rank']}.json"
    _C.dump_flight_recorder(path, reason)
    return path
