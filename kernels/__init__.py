"""Triton kernels of titan_lowbit, each with a pure-PyTorch reference of the same math.

The lowest layer of the package: ``titan_lowbit.optim`` and ``titan_lowbit.bitnet`` (and
through them ``titan_lowbit.torchtitan``) import these modules; they import nothing of
titan_lowbit, only each other (relatively), torch and Triton. ``private_apis`` is here for
that reason: the kernels consult it, and every layer above reads the same list.

The folder sits at the top of the repository, as the project's layout puts it, and is
imported only as ``titan_lowbit.kernels``, never as a top-level ``kernels``: the symlink
``titan_lowbit/kernels -> ../kernels`` makes it so in the clone and in the wheel alike.
Import analysis that does not follow the link shows this folder apart from the package;
each ``titan_lowbit.kernels.X`` import in ``titan_lowbit/`` is an arrow down to
``kernels/X.py`` (``tests/test_private_apis.py`` checks that none runs up).
"""
