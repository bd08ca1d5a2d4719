"""The open-files limit (RLIMIT_NOFILE) of gateway and backend processes.

A gateway holds two sockets per request in flight (client and backend), so its
soft limit bounds how many requests it can hold (`gateway.limits` derives its
default global cap from it). Two things get in the way:

- macOS starts processes at a soft limit of 256 (Linux often 1024):
  `raise_open_files_limit` raises the soft limit to the hard one, as SGLang's
  ``set_ulimit`` does.
- Importing ``mlx_lm.utils`` runs ``setrlimit(RLIMIT_NOFILE, (2048, 4096))``
  (mlx-lm 0.32). That lowers a higher hard limit for good (an unprivileged
  process can never raise it again), and under a hard limit below 4096 (e.g.
  ``docker run --ulimit nofile=1024:1024``) the import fails with ValueError
  (ml-explore/mlx-lm issue 1589, unmerged fix PR 1590). `keep_hard_limit`
  runs that import under the policy of PR 1590: raise the soft limit toward
  the asked one, never touch the hard limit. `guard_mlx_lm_import` applies it
  to whichever import of ``mlx_lm.utils`` comes first, without importing
  mlx-lm itself (``mlxgw status`` stays fast).
"""

from __future__ import annotations

import contextlib
import errno
import importlib.abc
import logging
import sys
from typing import Optional

try:
    import resource
except ImportError:  # Windows: no limits to manage
    resource = None

log = logging.getLogger("mlxgw")

#: Open files a gateway or backend asks for. macOS refuses a soft limit above
#: ``OPEN_MAX`` (10240) even under an unlimited hard limit; that is tried next.
OPEN_FILES_WANTED = 65536
MACOS_OPEN_MAX = 10240

#: errno values that say this process ran out of something (files, buffers, memory),
#: not that a peer failed: what asyncio's accept loop treats as "out of system resource".
OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

#: The module whose import sets the limit (mlx_lm/utils.py, module scope).
MLX_LM_UTILS = "mlx_lm.utils"


def raise_open_files_limit(wanted: int = OPEN_FILES_WANTED) -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE toward ``wanted`` (never above the hard limit,
    never down); what servers such as SGLang do at start (``set_ulimit``). Logs a raise.

    Returns the (before, after) soft limits (open files); never raises (no
    ``resource`` module, e.g. on Windows: (0, 0)).
    """
    if resource is None:
        return 0, 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for target in (wanted, MACOS_OPEN_MAX):
        if hard != resource.RLIM_INFINITY:
            target = min(target, hard)
        if target <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            continue
        log.info("open files limit raised from %d to %d", soft, target)
        return soft, target
    return soft, soft


def out_of_resources(exc: Optional[BaseException]) -> bool:
    """True when ``exc``, or an error it was raised from or during, is an OSError whose errno
    is in `OUT_OF_RESOURCES` (aiohttp's ClientConnectorError is an OSError carrying it)."""
    seen = 0
    while exc is not None and seen < 16:  # the cause chain is short; the bound guards a cycle
        if isinstance(exc, OSError) and exc.errno in OUT_OF_RESOURCES:
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def open_files_limit() -> int:
    """This process's soft RLIMIT_NOFILE (open files); 0 when unknown or unlimited."""
    if resource is None:
        return 0
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 0 if soft == resource.RLIM_INFINITY else soft


@contextlib.contextmanager
def keep_hard_limit():
    """Inside this block, ``resource.setrlimit(RLIMIT_NOFILE, (soft, hard))`` only raises
    the soft limit toward ``soft`` (capped at the current hard limit) and never changes
    the hard one; other resources pass through. Policy from ml-explore/mlx-lm PR 1590."""
    if resource is None:
        yield
        return
    real = resource.setrlimit

    def setrlimit(which, limits):
        if which != resource.RLIMIT_NOFILE:
            return real(which, limits)
        cur_soft, cur_hard = resource.getrlimit(which)
        want = limits[0]
        if cur_hard != resource.RLIM_INFINITY and (want == resource.RLIM_INFINITY or want > cur_hard):
            want = cur_hard
        if want != resource.RLIM_INFINITY and (cur_soft == resource.RLIM_INFINITY or want <= cur_soft):
            return None
        return real(which, (want, cur_hard))

    resource.setrlimit = setrlimit
    try:
        yield
    finally:
        resource.setrlimit = real


class _Loader(importlib.abc.Loader):
    """Runs one module's code under `keep_hard_limit`; everything else is the real loader's."""

    def __init__(self, real):
        self._real = real

    def create_module(self, spec):
        return self._real.create_module(spec)

    def exec_module(self, module):
        with keep_hard_limit():
            self._real.exec_module(module)

    def __getattr__(self, name):  # get_source, get_code, ... for tracebacks and inspect
        return getattr(self._real, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds ``mlx_lm.utils`` with the other finders and wraps its loader in `_Loader`."""

    def find_spec(self, fullname, path, target=None):
        if fullname != MLX_LM_UTILS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def guard_mlx_lm_import() -> bool:
    """Make the first import of ``mlx_lm.utils`` in this process keep the open-files
    hard limit (see the module docstring). Call it before anything imports mlx-lm;
    idempotent. Returns False when it came too late (already imported) or there is
    nothing to guard (no ``resource`` module)."""
    if resource is None or MLX_LM_UTILS in sys.modules:
        return False
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    return True
