"""Which torchtitan line is installed, for the modules that serve both lines.

titan_lowbit integrates with torchtitan 0.2 (TOML configs, custom_import) and 0.3 (Python
configs, --override.imports), each through its own module of ``titan_lowbit.torchtitan``.
The private APIs of torch, Triton and torchtitan that titan_lowbit uses, and the versions
they were tested with, are listed in ``kernels/private_apis.py``
(``titan_lowbit.kernels.private_apis``).
"""

from __future__ import annotations

from titan_lowbit.kernels.private_apis import installed

TORCHTITAN_LINES = ((0, 2), (0, 3))


def torchtitan_line() -> tuple[int, int] | None:
    """The (major, minor) line of the installed torchtitan, or None without torchtitan."""
    version = installed("torchtitan")
    return None if version is None else tuple(version[:2])
