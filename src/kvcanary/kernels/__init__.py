"""Triton kernels for the checks, one op per module, each matching its torch reference in
:mod:`kvcanary.checks` bit for bit. Importing this package needs Triton; the CPU path never does.

======== ============================== ==================================
op       kernel module                  torch reference
======== ============================== ==================================
verify   :mod:`kvcanary.kernels.verify`  :func:`kvcanary.checks.verify`
stamp    :mod:`kvcanary.kernels.stamp`   :func:`kvcanary.checks.stamp`
content  :mod:`kvcanary.kernels.content` :meth:`kvcanary.layout.KvLayout.fingerprint`
======== ============================== ==================================
"""
