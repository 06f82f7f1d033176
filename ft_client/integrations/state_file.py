"""The learned timeouts' file in a folder the user names (Lightning's ``exp_dir``), which
other users may be able to write: read and written under `ft_client.safefiles`' rule.

- the folder is used only where `safefiles.shared_dir_problem` finds nothing (ours; not
  writable by others but under the sticky bit); a missing one is made, mode 0700;
- the file is read only where it is a regular file of ours that no one else can write
  (`safefiles.load_json`), and put in force only where the client's loader takes it (the
  bounds of `ft_client.learning.state_dict`);
- it is written through a fresh file renamed into place (`safefiles.write_json_atomic`): a
  symlink planted at its name is replaced, never written through.

Anything else costs one warning naming the path and the reason, and the run goes on with the
timeouts it has (docs/integrations.md, "A foreign or unsafe exp_dir file"). No Lightning here.
"""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Callable
from typing import Any

from ft_client import safefiles
from ft_client.errors import RankMonitorClientError

MAX_BYTES = 1 << 20
"""The largest state file read (ours are a few KiB)."""


class StateFile:
    """``folder/name``, read at ``setup`` and written by rank 0 when timeouts were learned."""

    def __init__(self, folder: pathlib.Path, name: str, logger: logging.Logger) -> None:
        self.path = folder / name
        self.folder = folder
        self.logger = logger
        self._refused = False  # the folder failed the rule: neither read nor written again
        self._warned: set[str] = set()

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:  # one warning per kind of problem, not one per write
            self._warned.add(key)
            self.logger.warning("ft_client: %s", message)

    def _folder_ok(self, create: bool) -> bool:
        if self._refused:
            return False
        try:
            if create:
                safefiles.make_dir(self.folder)
            else:
                problem = safefiles.shared_dir_problem(self.folder) if self.folder.exists() else None
                if problem is not None:
                    raise safefiles.UnsafeFileError(f"refusing to use the folder {self.folder}: {problem}")
        except OSError as e:  # UnsafeFileError is one
            self._refused = True
            self._warn("folder", f"the learned timeouts are neither read from nor written to {self.path}: {e}")
            return False
        return True

    def load(self, apply: Callable[[Any], None]) -> bool:
        """Give the file's JSON to ``apply`` (the client's ``load_state_dict``); False, after
        one warning, where the file may not be read, is not JSON or ``apply`` refuses it; False
        quietly where there is none."""
        if not self._folder_ok(create=False):
            return False
        try:
            apply(safefiles.load_json(self.path, MAX_BYTES))
        except FileNotFoundError:
            return False
        except (OSError, RankMonitorClientError) as e:  # UnsafeFileError is an OSError
            self._warn("read", f"ignoring {self.path}: {e}; the timeouts in force stay")
            return False
        return True

    def write(self, state: dict[str, Any]) -> None:
        """Put ``state`` in the file (a fresh file renamed over it); a failure costs one warning."""
        if not self._folder_ok(create=True):
            return
        try:
            safefiles.write_json_atomic(self.path, state, indent=None)
        except OSError as e:
            self._warn("write", f"cannot write the learned timeouts to {self.path}: {e}")
